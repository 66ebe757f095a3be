"""Model weights from wherever they are: one entry point, one reader per kind of source.

:func:`find_weights(path) <find_weights>` asks each registered source in turn whether
``path`` is one of its kind; the first that says yes opens it.  The sources shipped:

* ``checkpoint``: a naohai checkpoint folder (``manifest.json``), or a run folder (its
  newest checkpoint);
* ``model folder``: an imported model (``naohai ckpt import``: ``model.ckpt`` +
  ``recipe.yaml``);
* ``hugging face``: a Hugging Face model folder (``config.json`` + ``*.safetensors``), its model
  read from ``config.json`` by :mod:`naohai.convert.hf` (the families it knows), its tokenizer
  ``tokenizer.json`` when the folder has one;
* ``adapter folder``: LoRA adapters over a base (``naohai ckpt import --from peft``,
  :mod:`naohai.checkpoint.adapters`).

A fine-tuning run's checkpoints hold only its adapters; they and adapter folders read as the
merged model (base weights + ``alpha / rank * B A``, the base checked against the fingerprint
recorded with the adapters), so everything below serves them unchanged;
:attr:`Weights.adapters` gives the factors themselves.

Another kind is one function that returns :class:`Weights`, added with :func:`register_source`.  Every reader answers with the recipe the weights
belong to and, when asked (:meth:`Weights.tensors`), the model's full float32 tensors by
naohai parameter name: a checkpoint of a sharded layout is merged first, optimizer
moments and step state are left out.

``naohai generate``, ``naohai eval`` and ``naohai data score`` read through
:func:`load_model`; ``train.init_from`` through :func:`start_checkpoint` (naohai checkpoints
are resharded straight to the run's layout by :mod:`naohai.checkpoint.relayout`, as on resume; other
sources are written as one full checkpoint first, :func:`write_full_checkpoint`).
"""
from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from typing import Callable, Dict, List, Mapping, Optional, Tuple

import numpy as np

from naohai import devices
from naohai.checkpoint import adapters as ad
from naohai.checkpoint import store
from naohai.checkpoint.files import sha256_file, write_json
from naohai.config import Recipe, recipe_from_dict
from naohai.errors import UserError
from naohai.runfiles import temp_dir_beside


@dataclass
class Weights:
    """One source of model weights: what it is, the recipe of its model, how to read its tensors."""

    kind: str                                        # "checkpoint", "model folder", ...
    path: str                                        # the folder read (a run resolves to its checkpoint)
    recipe: Recipe                                   # the model (and run) the weights belong to
    read: Callable[[], Mapping[str, np.ndarray]]     # full float32 tensors by naohai parameter name (maybe lazy)
    step: Optional[int] = None                       # training step of a checkpoint
    checkpoint: Optional[str] = None                 # the naohai checkpoint folder, when it is one
    tokenizer_sha256: Optional[str] = None           # the tokenizer the weights were trained with, if known
    fingerprint: Optional[str] = None                # cheap content id (adapters.fingerprint_of computes one else)
    adapters: Optional[Callable[[], Dict[str, np.ndarray]]] = None   # LoRA factors: tensors() merges them in
    reads_whole: bool = True                         # tensors() reads every tensor at once (else one when asked)

    def tensors(self) -> Mapping[str, np.ndarray]:
        """The model's float32 tensors by parameter name; a checkpoint's or an imported folder's are read from
        their file when asked (each access reads again), so take each once or copy what you keep."""
        return self.read()

    def describe(self) -> str:
        return f"{self.kind} {self.path}" + (f" (step {self.step})" if self.step is not None else "") \
            + (" (LoRA adapters over their base)" if self.adapters is not None else "")

    def tokenizer_file(self) -> str:
        """The tokenizer of this model: the recipe's ``data.tokenizer``, else ``tokenizer.model`` or
        ``tokenizer.json`` in the run folder (a checkpoint being ``<run>/checkpoints/step_N``) or in the
        model folder, else the recipe's default place.

        A relative ``data.tokenizer`` (``runs/tiny/tokenizer.model`` in ``recipes/sft-tiny.yaml``) was relative
        to the folder training ran in, which the run folder gives back (it is that folder joined with the
        recorded ``train.output_dir``): it is read there first, then from the current folder, and a file whose
        SHA-256 is not the one the weights were trained with (when the checkpoint records it) is passed over, so
        `generate` / `eval` of a fine-tuning run work from any folder and never read another run's tokenizer."""
        from naohai.data.pipeline import default_tokenizer_path
        folder = os.path.dirname(os.path.dirname(os.path.abspath(self.checkpoint))) if self.checkpoint else self.path
        given = self.recipe.data.tokenizer
        if given:
            places = [given] if os.path.isabs(given) else [os.path.join(p, given) for p in self._training_dirs()]
            wrong = []
            for place in places:
                if os.path.exists(place):
                    if self._same_tokenizer(place):
                        return place
                    wrong.append(place)
            if wrong:
                raise UserError(f"is not the tokenizer these weights were trained with (its SHA-256 differs from "
                                f"{str(self.tokenizer_sha256)[:12]}..., recorded with them)", where=wrong[0],
                                key="data.tokenizer")
        for name in ("tokenizer.model", "tokenizer.json"):
            if os.path.exists(os.path.join(folder, name)):
                return os.path.join(folder, name)
        if self.checkpoint is None:     # a model folder: the run's default place means nothing here
            raise UserError(f"has no tokenizer (tokenizer.json or tokenizer.model) and its recipe names none "
                            f"(data.tokenizer); put the model's own tokenizer file in the folder", where=self.path,
                            key="data.tokenizer")
        return default_tokenizer_path(self.recipe)

    def _training_dirs(self) -> List[str]:
        """Where the recipe's relative paths may point from: the folder training ran in (known when the run
        folder's path ends with the recorded relative ``train.output_dir``), then the current folder."""
        out = []
        recorded = self.recipe.train.output_dir
        if self.checkpoint and recorded and not os.path.isabs(recorded):
            run = os.path.dirname(os.path.dirname(os.path.abspath(self.checkpoint)))
            tail = os.sep + os.path.normpath(recorded)
            if run.endswith(tail):
                out.append(run[:-len(tail)] or os.sep)
        return out + [os.getcwd()]

    def _same_tokenizer(self, path: str) -> bool:
        """Whether the tokenizer file ``path`` is the one recorded with the weights (True when none is)."""
        if not self.tokenizer_sha256:
            return True
        from naohai.data.tokenizer import Tokenizer
        try:
            return Tokenizer.load(path).sha256 == self.tokenizer_sha256
        except UserError:
            return False


@dataclass(frozen=True)
class Source:
    kind: str
    accepts: Callable[[str], bool]      # is ``path`` of this kind?
    open: Callable[[str, bool], Weights]  # (path, verify): read its recipe (tensors later, on demand)
    what: str                           # one phrase for the error listing what a path may be


_SOURCES: List[Source] = []


def register_source(kind: str, accepts: Callable[[str], bool], open: Callable[[str, bool], Weights],
                    what: str) -> None:
    """Add a kind of weight source; it is asked after the ones registered before it.  ``open(path, verify)``
    reads what the weights belong to; ``verify`` False skips the content hashes a source may check."""
    if any(s.kind == kind for s in _SOURCES):
        raise ValueError(f"weight source '{kind}' is already registered")
    _SOURCES.append(Source(kind, accepts, open, what))


def find_weights(path: str, verify: bool = True) -> Weights:
    """The weights at ``path`` (any registered kind), their recipe read, their tensors not yet; a naohai
    checkpoint is verified first (sizes and SHA-256; ``verify=False``: sizes only)."""
    if not str(path).strip():
        raise UserError("the model path is empty; give a run folder, a checkpoint folder, a model folder or a "
                        "Hugging Face model folder", where="command line", rule="a non-empty path")
    if not os.path.exists(path):
        raise UserError("not found (expected a run folder, a checkpoint folder, a model folder or a Hugging Face "
                        "model folder)", where=path)
    for source in _SOURCES:
        if source.accepts(path):
            return source.open(path, verify)
    raise UserError("holds no model weights: expected " + "; or ".join(s.what for s in _SOURCES), where=path)


def model_tensors(recipe: Recipe, tensors: Mapping[str, object]) -> Mapping[str, np.ndarray]:
    """The model's parameters among ``tensors`` (MindSpore tensors or arrays, or a mapping that reads each when
    asked), each as a float32 array when asked: a model filled from it (:func:`load_model`) holds one read
    tensor at a time beside its own weights."""
    from naohai.checkpoint.reshard import ModelTensors
    from naohai.model.params import param_shapes
    return ModelTensors(tensors, {p.name for p in param_shapes(recipe.model)})


# --------------------------------------------------------------------------- naohai checkpoints
def _is_checkpoint(path: str) -> bool:
    return os.path.isdir(path) and (os.path.exists(os.path.join(path, store.MANIFEST))
                                    or bool(store.list_checkpoints(path)))


def _open_checkpoint(path: str, verify: bool) -> Weights:
    from naohai.checkpoint.reshard import merged_tensors
    chosen = store.resolve_checkpoint(path)
    man = store.verified(chosen, hash_files=verify)
    where = os.path.join(chosen, store.MANIFEST)
    recipe = recipe_from_dict(man["recipe"], where=where)
    found = Weights("checkpoint", chosen, recipe,
                    lambda: model_tensors(recipe, merged_tensors(chosen, hash_files=False)),   # hashed above
                    step=int(man.get("step", 0)), checkpoint=chosen,
                    tokenizer_sha256=(man.get("identity") or {}).get("tokenizer_sha256"),
                    fingerprint=ad.checkpoint_fingerprint(man), reads_whole=False)   # a tensor at a time
    if man.get(ad.BASE_KEY) is not None:          # a fine-tuning run's: adapters only
        found.reads_whole = _base_is_seeded(man[ad.BASE_KEY])     # else folded into a base read when asked
        if recipe.finetune is None:
            raise UserError(f"integrity error: records a base ({ad.BASE_KEY}) but its recipe has no finetune "
                            f"section", where=where, key=ad.BASE_KEY)
        found.adapters = lambda: _trained(merged_tensors(chosen, hash_files=False))
        found.read = lambda: ad.merged(read_base(man[ad.BASE_KEY], recipe, where), found.adapters(), recipe, where)
    return found


def _trained(tensors: Mapping[str, object]) -> Dict[str, np.ndarray]:
    """The adapter factors among a fine-tuning checkpoint's tensors, as float32 arrays."""
    from naohai.checkpoint.reshard import as_float32
    from naohai.model.finetune import is_trained_name
    return {name: as_float32(tensors[name]) for name in tensors if is_trained_name(name)}


# --------------------------------------------------------------------------- imported model folders
def _is_model_dir(path: str) -> bool:
    from naohai.convert.model_dir import is_model_dir
    return is_model_dir(path)


def _open_model_dir(path: str, verify: bool) -> Weights:
    from naohai.convert.model_dir import WEIGHTS, load_model_dir
    recipe, tensors = load_model_dir(path)
    return Weights("model folder", path, recipe, lambda: model_tensors(recipe, tensors),
                   fingerprint=ad.file_fingerprint(os.path.join(path, WEIGHTS)), reads_whole=False)


# --------------------------------------------------------------------------- adapter folders
def _is_adapter_dir(path: str) -> bool:
    return ad.is_adapter_dir(path)


def _open_adapter_dir(path: str, verify: bool) -> Weights:
    recipe, factors, base, _ = ad.read_adapter_dir(path)
    where = os.path.join(path, ad.ADAPTER_INFO)
    return Weights("adapter folder", path, recipe,
                   lambda: ad.merged(read_base(base, recipe, where), factors, recipe, where),
                   fingerprint=ad.file_fingerprint(os.path.join(path, ad.ADAPTER_WEIGHTS)),
                   adapters=lambda: dict(factors), reads_whole=_base_is_seeded(base))


# --------------------------------------------------------------------------- Hugging Face folders
def _is_hf_folder(path: str) -> bool:
    from naohai.convert.hf.folder import is_hf_folder
    return is_hf_folder(path)


def _open_hf_folder(path: str, verify: bool) -> Weights:
    from naohai.convert.hf.convert import open_hf
    from naohai.data.hf_tokenizer import HFTokenizer
    recipe, read = open_hf(path)
    tokenizer = recipe.data.tokenizer
    sha = HFTokenizer.load(tokenizer, key=None).sha256 if tokenizer else None
    return Weights("hugging face folder", path, recipe, lambda: model_tensors(recipe, read()),
                   tokenizer_sha256=sha, reads_whole=False)                      # a stored tensor at a time


register_source("checkpoint", _is_checkpoint, _open_checkpoint,
                "a naohai checkpoint folder (manifest.json) or a run folder with checkpoints/")
register_source("model folder", _is_model_dir, _open_model_dir,
                "an imported model folder (model.ckpt + recipe.yaml, from `naohai ckpt import`)")
register_source("hugging face", _is_hf_folder, _open_hf_folder,
                "a Hugging Face model folder (config.json + *.safetensors) of a family naohai knows")
register_source("adapter folder", _is_adapter_dir, _open_adapter_dir,
                "an adapter folder (adapter.ckpt + adapter.json + recipe.yaml, from `naohai ckpt import --from peft`)")


def _base_is_seeded(record: object) -> bool:
    """Is the adapters' base a model drawn from a seed (built and copied whole), not weights read from a path?"""
    return not isinstance(record, dict) or record.get("path") is None


def read_base(record: Dict[str, object], recipe, where: str) -> Mapping[str, np.ndarray]:
    """The base model tensors a :data:`naohai.checkpoint.adapters.BASE_KEY` record names (the base of a
    fine-tuning run's adapters), checked against its fingerprint; read when asked unless drawn from a seed."""
    if not isinstance(record, dict) or "fingerprint" not in record:
        raise UserError(f"integrity error: the record of the adapters' base ({ad.BASE_KEY}) is damaged", where=where,
                        key=ad.BASE_KEY)
    if _base_is_seeded(record):
        return ad.seed_tensors(recipe, int(record.get("seed", 0)))
    path = record["path"]
    if not os.path.exists(path):
        raise UserError(f"the adapters were trained on the base {path} ({record.get('describe')}), which is gone; "
                        f"the adapters alone are not a model", where=where, key=f"{ad.BASE_KEY}.path")
    found = find_weights(path)
    mine = ad.fingerprint_of(found)
    if mine != record["fingerprint"]:
        raise UserError(f"base mismatch: the adapters were trained on {record.get('describe')} (fingerprint "
                        f"{str(record['fingerprint'])[:12]}...), but {path} now holds other weights "
                        f"({mine[:12]}...); give the original base", where=where, key=f"{ad.BASE_KEY}.path")
    return model_tensors(recipe, found.tensors())


# --------------------------------------------------------------------------- users
def load_model(path: str, seed: int = 0, verify: bool = True,
               before_read: Optional[Callable[[Weights], None]] = None):
    """``(weights, NaohaiLM)``: the model of ``path``'s recipe holding its weights (generate, eval, score);
    ``verify`` as for :func:`find_weights`.  ``before_read(weights)`` runs once the source is known and before
    any tensor is read or the model built: a caller's own checks (its tokenizer, its text) fail in a second,
    not after a load of minutes."""
    from naohai.convert.weights import assign_weights
    from naohai.model.transformer import NaohaiLM

    found = find_weights(path, verify)
    check_loads_in_memory(found)
    if before_read is not None:
        before_read(found)
    model = NaohaiLM(found.recipe.model, seed=seed)       # LoRA adapters come merged into the weights
    ft = found.recipe.finetune
    if ft is not None and ft.method != "lora":          # the other methods' tensors come beside the base's
        from naohai.model.finetune import apply_finetune
        apply_finetune(model, ft, seed, where=found.path)
    assign_weights(model, found.tensors(), where=found.path)
    return found, model


#: bytes a loaded model holds per parameter at the least: its float32 weights (a 187M-parameter model built alone
#: held 1.1 x its float32 bytes, 2026-11-30) and, from a source read whole (:attr:`Weights.reads_whole`), the float32
#: tensors read to fill them; from one read a tensor at a time, the largest tensor instead
LOAD_BYTES_PER_PARAM = 4


def load_bytes(found: Weights) -> int:
    """The least memory in bytes a model of ``found`` holds while it is loaded (see :data:`LOAD_BYTES_PER_PARAM`)."""
    from naohai.model.params import param_shapes
    sizes = [int(np.prod(p.shape, dtype=np.int64)) for p in param_shapes(found.recipe.model)]
    read = sum(sizes) if found.reads_whole else max(sizes, default=0)
    return LOAD_BYTES_PER_PARAM * (sum(sizes) + read)


def check_loads_in_memory(found: Weights, total: Optional[int] = None) -> None:
    """Refuse (exit 2) a model whose weights cannot be held in this machine's memory while they are read
    (:func:`load_bytes` against ``MemTotal``), before any tensor is read: a 7B model on a 24 GB machine was read
    until the kernel killed the process, with no message."""
    from naohai.model.params import count_params

    total = devices.machine_memory() if total is None else total
    params = count_params(found.recipe.model)
    need = load_bytes(found)
    if total and need > total:
        gb = 1024.0 ** 3
        how = ("read whole as float32 tensors and held by the model in float32 as well" if found.reads_whole else
               "held by the model in float32, read a tensor at a time")
        raise UserError(f"this model cannot be loaded in this machine's memory: its {params:,} parameters are {how}, "
                        f"at least {need / gb:,.1f} GB, and the machine has {total / gb:,.1f} GB (MemTotal). Run it "
                        f"on a machine with more memory; nothing was read", where=found.path,
                        rule="the model's float32 bytes, and those read to fill it, <= MemTotal")


def check_fits(found: Weights, recipe: Recipe, where: str) -> None:
    """Refuse weights whose parameters (names and shapes) are not those of ``recipe``'s model."""
    from naohai.model.params import param_shapes
    wanted = {p.name: tuple(p.shape) for p in param_shapes(recipe.model)}
    given = {p.name: tuple(p.shape) for p in param_shapes(found.recipe.model)}
    missing = sorted(set(wanted) - set(given))
    extra = sorted(set(given) - set(wanted))
    shapes = sorted(n for n in set(wanted) & set(given) if wanted[n] != given[n])
    if missing or extra or shapes:
        detail = "; ".join(part for part in (
            f"missing {missing[:3]}" if missing else "", f"not in this model {extra[:3]}" if extra else "",
            ", ".join(f"{n} {given[n]} vs {wanted[n]}" for n in shapes[:3]) if shapes else "") if part)
        raise UserError(f"the weights of {found.describe()} do not fit this recipe's model ({detail})",
                        where=where, key="train.init_from")


def source_stamp(path: str) -> str:
    """12 hex digits naming the files below ``path`` as they are now (relative name, size, modification
    time): cheap, and different when a file of the source is rewritten, added or removed."""
    import hashlib
    import json
    entries = []
    for folder, dirs, files in os.walk(path):
        dirs.sort()
        for f in sorted(files):
            full = os.path.join(folder, f)
            st = os.stat(full)
            entries.append((os.path.relpath(full, path), st.st_size, st.st_mtime_ns))
    return hashlib.sha256(json.dumps(entries).encode("utf-8")).hexdigest()[:12]


def write_full_checkpoint(found: Weights, out: str, manifest: Dict[str, object]) -> str:
    """``found``'s model tensors as a naohai checkpoint of full tensors at ``out`` (atomic: written in a
    new temporary folder beside it, then renamed), so any layout can be made from it by :func:`naohai.checkpoint.reshard.reshard_checkpoint`."""
    from naohai import ckpt_format
    if os.path.exists(out):
        return out
    tmp = temp_dir_beside(out)       # a fresh uniquely named folder: nothing of the user's is removed
    try:
        name = store.rank_file(0)
        tensors = found.tensors()    # written one at a time, as save_checkpoint would write them
        ckpt_format.write(os.path.join(tmp, name),
                          ((k, np.ascontiguousarray(tensors[k], np.float32)) for k in sorted(tensors)))
        files = {name: {"rank": 0, "sha256": sha256_file(os.path.join(tmp, name)),
                        "bytes": os.path.getsize(os.path.join(tmp, name))}}
        layout = {"mode": "standalone", "world": 1, "signature": "full", "ranks_with_files": [0],
                  "mesh": {"data": 1, "model": 1, "pipeline": 1}, "stages": 1, "describe": "full tensors"}
        write_json(os.path.join(tmp, store.MANIFEST),
                   dict(manifest, format=store.FORMAT, step=0, layout=layout, files=files,
                        recipe=found.recipe.to_dict(), written_from=found.describe()))
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def start_checkpoint(path: str, recipe: Recipe, tokenizer_sha256: Optional[str], run_dir: str, *, rank: int,
                     all_ok: Callable[[bool], bool]) -> Tuple[Weights, str]:
    """``(weights, checkpoint folder)`` a run starts from for ``train.init_from: path``: the weights must
    fit ``recipe``'s model and come from the run's tokenizer (``tokenizer_sha256``, when both are known);
    a source that is not a naohai checkpoint is first written by rank 0 as one full checkpoint in
    ``<run_dir>/init/`` (every rank waits).  Mistakes are :class:`UserError` naming ``train.init_from``."""
    where = recipe.source or "recipe"
    try:
        found = find_weights(path)
    except UserError as exc:
        raise UserError(exc.message, where=exc.where, key="train.init_from") from None
    check_fits(found, recipe, where)
    ft = found.recipe.finetune
    if found.adapters is not None and ft is not None and ft.method != "lora":
        raise UserError(f"{found.describe()} holds a {ft.method} adapter, which does not fold into model weights: "
                        f"starting from it would drop the adapter. Start from its base "
                        f"({(found.recipe.train.init_from or 'the base it names')}) or resume the run itself",
                        where=where, key="train.init_from")
    if found.tokenizer_sha256 and tokenizer_sha256 and found.tokenizer_sha256 != tokenizer_sha256:
        try:
            source_tokenizer = found.tokenizer_file()
        except UserError:            # its recorded file is no longer the one it was trained with
            source_tokenizer = found.recipe.data.tokenizer or "the source's own tokenizer"
        raise UserError(f"the weights of {found.describe()} were trained with another tokenizer (SHA-256 "
                        f"{found.tokenizer_sha256[:12]}..., this run's is {tokenizer_sha256[:12]}...): their token "
                        f"ids mean other pieces here. Give the source's tokenizer as data.tokenizer "
                        f"({source_tokenizer}) in a new output folder", where=where, key="train.init_from")
    if found.checkpoint is not None and found.adapters is None:     # adapters: merged into a full one first
        return found, found.checkpoint
    # named after the source's files as they are now: a source changed in place gets a new full copy, never
    # the stale one an earlier start wrote
    name = f"{os.path.basename(os.path.normpath(found.path))}-full-{source_stamp(found.path)}"
    chosen, error = os.path.join(run_dir, "init", name), None
    if rank == 0:
        try:
            write_full_checkpoint(found, chosen, {"seed": recipe.train.seed})
        except UserError as exc:
            error = exc
    if not all_ok(error is None):
        raise error or UserError("rank 0 could not read the weights (see its log)", where=path, key="train.init_from")
    return found, chosen
