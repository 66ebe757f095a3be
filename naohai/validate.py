"""One checker for every number, flag and key a user writes.

Recipes, strategy files, device profiles and command-line numbers all go through
these functions, so the same mistake gets the same answer everywhere: a
:class:`naohai.errors.UserError` naming the file (``where``), the key path and
the rule, which the CLI prints as one paragraph with exit code 2.

* YAML is read with :func:`load_yaml`, which refuses duplicate keys (plain
  PyYAML keeps the last one and silently drops the first) and documents whose aliases
  expand beyond :data:`MAX_YAML_NODES` values (an alias bomb), before expanding them.
* JSON files users hand over (a Hugging Face ``config.json``, its tokenizer's and generation settings, a
  PEFT ``adapter_config.json``) are read with :func:`read_json_object`, whose :func:`unique_json_object`
  refuses duplicate keys the same way.
* :func:`integer` and :func:`number` refuse booleans, strings, ``.nan`` and
  ``.inf``, fractions where an integer is meant, and values outside the range
  (every integer has an upper bound, so ``1e21`` devices is an error, not a plan;
  an integer of 400 digits, beyond a float's range, is one too).
* :func:`cli_int` makes argparse ``type=`` converters with the same rules for
  integer flags.
"""
from __future__ import annotations

import argparse
import json
import math
from typing import Any, Dict, Iterable, Optional

import yaml

from naohai.errors import UserError, did_you_mean

#: default upper bound of an integer setting (MindSpore's int32 attributes)
INT_MAX = 2 ** 31 - 1
#: upper bound of device counts and mesh axis sizes
MAX_DEVICES = 1_000_000


# --------------------------------------------------------------------------- YAML
class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that refuses a key written twice in one mapping."""


def _construct_mapping(loader: _UniqueKeyLoader, node: yaml.MappingNode, deep: bool = False) -> Dict:
    loader.flatten_mapping(node)
    seen: Dict[Any, Any] = {}
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=True)
        try:
            hash(key)
        except TypeError:
            raise yaml.constructor.ConstructorError(None, None, f"unhashable key {key!r}",
                                                    key_node.start_mark) from None
        if key in seen:
            first = seen[key]
            raise yaml.constructor.ConstructorError(
                None, None, f"duplicate key {key!r} (first written at line {first.line + 1}); "
                            f"YAML would silently keep only the last one", key_node.start_mark)
        seen[key] = key_node.start_mark
    return yaml.SafeLoader.construct_mapping(loader, node, deep)


_UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


#: most nodes a YAML document may stand for once its aliases are expanded (recipes and strategy files
#: have hundreds; an alias bomb of a few lines has billions)
MAX_YAML_NODES = 100_000


def _expanded_nodes(node, memo: Dict[int, int], active: set) -> int:
    key = id(node)
    if key in memo:
        return memo[key]
    if key in active:
        raise yaml.composer.ComposerError(None, None, "an alias refers to the node that contains it "
                                          "(a recursive document)", node.start_mark)
    active.add(key)
    if isinstance(node, yaml.SequenceNode):
        n = 1 + sum(_expanded_nodes(c, memo, active) for c in node.value)
    elif isinstance(node, yaml.MappingNode):
        n = 1 + sum(_expanded_nodes(k, memo, active) + _expanded_nodes(v, memo, active) for k, v in node.value)
    else:
        n = 1
    active.discard(key)
    if n > MAX_YAML_NODES:
        raise yaml.composer.ComposerError(None, None, f"the document's aliases expand to more than "
                                          f"{MAX_YAML_NODES:,} values (an alias bomb?); refused before "
                                          f"expanding it", node.start_mark)
    memo[key] = n
    return n


def load_yaml(stream) -> Any:
    """``yaml.safe_load`` that raises ``yaml.YAMLError`` on duplicate keys and on a document whose
    aliases would expand to more than :data:`MAX_YAML_NODES` values (checked on the composed node
    graph, where an alias is one shared node, before anything is constructed)."""
    loader = _UniqueKeyLoader(stream)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        _expanded_nodes(node, {}, set())
        return loader.construct_document(node)
    finally:
        loader.dispose()


class DuplicateJSONKey(ValueError):
    """A JSON object that names one key twice (``json.load`` keeps the last and drops the first)."""


def unique_json_object(pairs) -> Dict[str, Any]:
    """``object_pairs_hook`` for ``json.load`` / ``json.loads``: the object, or :class:`DuplicateJSONKey`
    naming the repeated key."""
    out: Dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise DuplicateJSONKey(f"the key {key!r} is written twice (JSON readers keep the last one and drop "
                                   f"the first, so which one was meant is unknown)")
        out[key] = value
    return out


def read_json_object(path: str) -> Dict[str, Any]:
    """The JSON object in the file ``path``; a key written twice, unreadable JSON or another type exits 2
    naming the file."""
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh, object_pairs_hook=unique_json_object)
    except DuplicateJSONKey as exc:
        raise UserError(str(exc), where=path) from None
    except (OSError, ValueError) as exc:
        raise UserError(f"is not readable JSON ({exc})", where=path) from None
    if not isinstance(data, dict):
        raise UserError(f"must hold a JSON object, not {type(data).__name__}", where=path)
    return data


# --------------------------------------------------------------------------- values
def _fail(where: Optional[str], key: str, msg: str, rule: str) -> None:
    raise UserError(msg, where=where, key=key, rule=rule)


def _describe(value: Any) -> str:
    if isinstance(value, float) and math.isnan(value):
        return ".nan"
    if isinstance(value, float) and math.isinf(value):
        return ".inf" if value > 0 else "-.inf"
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) > 10 ** 12:
        return _big(value)
    return repr(value)


def _big(n: int) -> str:
    """A large integer as 1e+30; YAML and JSON integers have no bound, and beyond 1.8e308 ``float(n)``
    (and ``f"{n:g}"``) raise OverflowError, so the digits are counted instead."""
    if abs(n) < 10 ** 300:
        return f"{float(n):g}"
    digits = str(abs(n))
    return f"{'-' if n < 0 else ''}{digits[0]}.{digits[1:3]}e+{len(digits) - 1}"


def integer(value: Any, where: Optional[str], key: str, minimum: Optional[int] = None,
            maximum: int = INT_MAX) -> int:
    """A whole number in [minimum, maximum]; 8.0 is accepted as 8, 8.5, .inf, true and '8' are not."""
    rng = f"an integer in [{minimum}, {maximum}]" if minimum is not None else f"an integer <= {maximum}"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        _fail(where, key, f"must be {rng}, got {_describe(value)}", "type: integer")
    if isinstance(value, float) and not math.isfinite(value):
        _fail(where, key, f"must be {rng}, got {_describe(value)}", "finite integer")
    if int(value) != value:
        _fail(where, key, f"must be {rng}, got {value!r} (not whole)", "type: integer")
    n = int(value)
    if (minimum is not None and n < minimum) or n > maximum:
        _fail(where, key, f"must be {rng}, got {_describe(n)}",
              (f"{minimum} <= " if minimum is not None else "") + f"{key.split('.')[-1]} <= {maximum}")
    return n


def number(value: Any, where: Optional[str], key: str, minimum: Optional[float] = None,
           maximum: Optional[float] = None, above: Optional[float] = None, below: Optional[float] = None) -> float:
    """A finite number; ``minimum``/``maximum`` are inclusive bounds, ``above``/``below`` exclusive."""
    parts = []
    if minimum is not None:
        parts.append(f">= {minimum:g}")
    if above is not None:
        parts.append(f"> {above:g}")
    if maximum is not None:
        parts.append(f"<= {maximum:g}")
    if below is not None:
        parts.append(f"< {below:g}")
    rng = "a finite number" + (" " + " and ".join(parts) if parts else "")
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        _fail(where, key, f"must be {rng}, got {_describe(value)}", "type: number")
    try:
        x = float(value)
    except OverflowError:            # an integer beyond 1.8e308 (YAML and JSON integers have no bound)
        x = math.inf
    if not math.isfinite(x):
        _fail(where, key, f"must be {rng}, got {_describe(value)}", "finite number")
    bad = ((minimum is not None and x < minimum) or (maximum is not None and x > maximum)
           or (above is not None and x <= above) or (below is not None and x >= below))
    if bad:
        _fail(where, key, f"must be {rng}, got {x:g}", f"{key.split('.')[-1]} {' and '.join(parts)}")
    return x


def boolean(value: Any, where: Optional[str], key: str) -> bool:
    if not isinstance(value, bool):
        _fail(where, key, f"must be true or false, got {_describe(value)}", "type: boolean")
    return value


def string(value: Any, where: Optional[str], key: str) -> str:
    if not isinstance(value, str):
        _fail(where, key, f"must be a string, got {_describe(value)}", "type: string")
    return value


def text(value: Any, where: Optional[str], key: str, default: str = "") -> str:
    """A line of text (a bare number such as ``name: 2024`` is read as its text; None is ``default``); a list,
    a mapping or a boolean is refused (its ``str()`` was once taken as the text)."""
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        _fail(where, key, f"must be a line of text, got {_describe(value)}", "type: string")
    return str(value)


def choice(value: Any, allowed: Iterable[str], where: Optional[str], key: str) -> str:
    allowed = tuple(allowed)
    if not isinstance(value, str) or value not in allowed:
        _fail(where, key, f"'{value}' is not one of {', '.join(allowed)}.{did_you_mean(str(value), allowed)}",
              "allowed values")
    return value


def mapping(value: Any, where: Optional[str], key: str) -> Dict[str, Any]:
    """A YAML mapping (``None``, an empty section, counts as empty)."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        _fail(where, key, f"must be a mapping, got {type(value).__name__}", "type: mapping")
    return value


def known_keys(data: Dict[str, Any], allowed: Iterable[str], where: Optional[str], prefix: str = "") -> None:
    allowed = tuple(allowed)
    for k in data:
        if k not in allowed:
            path = f"{prefix}.{k}" if prefix else str(k)
            _fail(where, path, f"unknown key '{k}'.{did_you_mean(str(k), allowed)} Known keys: "
                               f"{', '.join(allowed)}.", "known keys")


# --------------------------------------------------------------------------- command line
def cli_int(minimum: int = 1, maximum: int = INT_MAX):
    """An argparse ``type=`` for an integer flag in [minimum, maximum]."""
    def convert(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer in [{minimum}, {maximum}], got {text!r}") from None
        if not minimum <= value <= maximum:
            raise argparse.ArgumentTypeError(f"must be an integer in [{minimum}, {maximum}], got {value}")
        return value
    convert.__name__ = "integer"
    return convert


def cli_seconds(maximum: float = 30 * 24 * 3600.0):
    """An argparse ``type=`` for a duration flag: a finite number of seconds above 0 and at most ``maximum``
    (30 days: a larger one is a typo, and a wait that long would overflow the clocks it is added to)."""
    def convert(text: str) -> float:
        rule = f"must be a number of seconds above 0 and at most {maximum:,.0f}"
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{rule}, got {text!r}") from None
        if not (math.isfinite(value) and 0 < value <= maximum):
            raise argparse.ArgumentTypeError(f"{rule}, got {text!r}")
        return value
    convert.__name__ = "seconds"
    return convert

