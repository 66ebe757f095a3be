"""naohai.validate: the one checker for user-written numbers, keys and YAML."""
import argparse
import io
import math

import pytest
import yaml

from naohai import validate
from naohai.errors import UserError


@pytest.mark.parametrize("value", [math.inf, -math.inf, math.nan, 2.5, True, "8", None, 1e21, 0, -3])
def test_integer_refuses(value):
    with pytest.raises(UserError) as e:
        validate.integer(value, "f.yaml", "mesh.data", 1, 1000)
    assert e.value.where == "f.yaml" and e.value.key == "mesh.data" and e.value.rule


@pytest.mark.parametrize("check", [validate.integer, validate.number])
@pytest.mark.parametrize("digits", [20, 309, 400])
def test_integers_beyond_a_floats_range_are_refused_not_overflowed(check, digits):
    """YAML and JSON integers have no bound: 1 followed by 400 zeros (beyond float's 1.8e308) was an
    OverflowError traceback from float(); it is an out-of-range value like 1e21, named by its magnitude."""
    for value in (10 ** digits, -(10 ** digits)):
        with pytest.raises(UserError) as e:
            check(value, "adapter_config.json", "lora_alpha", 1, 1000)
        text = str(e.value)
        assert e.value.key == "lora_alpha" and e.value.rule and len(text) < 200, text
        assert f"{'-' if value < 0 else ''}1{'.00' if digits >= 300 else ''}e+{digits}" in text, text


def test_integer_without_minimum_states_only_the_upper_bound():
    with pytest.raises(UserError) as e:
        validate.integer(10 ** 12, "r.yaml", "model.hidden_size")
    text = str(e.value)
    assert "must be an integer <= 2147483647" in text and "-inf" not in text
    assert e.value.rule == "hidden_size <= 2147483647"


def test_integer_accepts_whole_floats_in_range():
    assert validate.integer(8.0, "f", "k", 1) == 8 and validate.integer(1000, "f", "k", 1, 1000) == 1000


@pytest.mark.parametrize("value,kw", [(math.nan, {}), (math.inf, {}), (0, {"above": 0}), (1.5, {"maximum": 1}),
                                      (2, {"below": 2}), (-1, {"minimum": 0}), ("x", {}), (False, {})])
def test_number_refuses(value, kw):
    with pytest.raises(UserError):
        validate.number(value, "p.yaml", "memory_gb", **kw)


def test_duplicate_yaml_keys_refused_at_any_depth():
    assert validate.load_yaml(io.StringIO("a: 1\nb: {c: 2}\n")) == {"a": 1, "b": {"c": 2}}
    for text in ("a: 1\na: 2\n", "b: {c: 1, c: 2}\n", "layers:\n  '0-9': {}\n  '0-9': {}\n"):
        with pytest.raises(yaml.YAMLError, match="duplicate key"):
            validate.load_yaml(io.StringIO(text))


def test_cli_int_converter():
    conv = validate.cli_int(1, 10)
    assert conv("3") == 3
    for bad in ("0", "-1", "11", "1e3", "x"):
        with pytest.raises(argparse.ArgumentTypeError):
            conv(bad)


def _alias_bomb(levels=9):
    lines = ['a: &a ["x", "x", "x", "x", "x", "x", "x", "x", "x"]']
    names = "abcdefghijklmnop"
    for p, c in zip(names[:levels - 1], names[1:levels]):
        lines.append(f"{c}: &{c} [" + ", ".join([f"*{p}"] * 9) + "]")
    return "\n".join(lines) + "\n"


def test_an_alias_bomb_is_refused_before_it_expands(tmp_path, capsys):
    import io
    import yaml
    from naohai.cli import main
    from naohai.validate import MAX_YAML_NODES, load_yaml
    bomb = _alias_bomb()                               # 9**9 = 387 million strings once expanded
    with pytest.raises(yaml.YAMLError, match="alias bomb"):
        load_yaml(io.StringIO(bomb))
    recipe = tmp_path / "bomb.yaml"
    recipe.write_text("model: {preset: tiny}\n" + bomb.replace("i: &i", "name: &i"), encoding="utf-8")
    assert main(["plan", str(recipe)]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "alias bomb" in err and str(recipe) in err and "Traceback" not in err
    # ordinary anchors (a shared block) still work
    assert load_yaml(io.StringIO("d: &d {a: 1}\ne: *d\n")) == {"d": {"a": 1}, "e": {"a": 1}}
    assert MAX_YAML_NODES >= 10_000
