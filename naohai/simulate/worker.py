"""Per-rank compile worker, run by every msrun process of a simulated-device job.

Usage (msrun does this): ``python .../naohai/simulate/worker.py <spec.json>``.

The spec (written by :mod:`naohai.simulate.harness`) names a *target*, a callable
``"module:function"`` called with ``**spec["kwargs"]`` after ``ms.set_device("GPU")`` and
``init()``.  The target sets up the parallel context itself and returns either
``(network, compile_args)`` or a list ``[(name, network, compile_args[, prepare]), ...]`` of the
graphs this rank compiles, in order (naohai's train step, then its eval net); ``prepare()``, where
given, runs right before that graph's compile (naohai's: the shared model's training mode).  This
module compiles each and writes ``<out_dir>/rank_<r>/result.json``: ok / error (type,
MindSpore message, op and parameter names found in it, which graph), the first
graph's per-parameter layouts and shard shapes, communication op counts per graph
read from its last front-end IR (kept as ``rank_<r>/<name>.ir``; the first graph's
also as ``final.ir``), compile times and peak RSS.  The first graph's parameter
strategy file goes to ``<out_dir>/rank_<r>/strategy.ckpt``; with ``save_slices`` in the
spec, this rank's compile-time parameter slices go to ``rank_<r>/slices.ckpt``.
"""
from __future__ import annotations

import importlib
import json
import os
import resource
import shutil
import sys
import time
import traceback
from pathlib import Path

if __package__ in (None, ""):  # run as a script by msrun: make sibling imports work
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from naohai.simulate.irstats import count_comm_ops, final_ir_file  # noqa: E402
from naohai.simulate.msgparse import parse_mindspore_error  # noqa: E402


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def _resolve(target: str):
    module_name, sep, func_name = target.partition(":")
    if not sep or not module_name or not func_name:
        raise ValueError(f"target must look like 'package.module:function', got {target!r}")
    return getattr(importlib.import_module(module_name), func_name)


def _layouts(network) -> dict:
    """Parameter name -> layout from ``parameter_layout_dict`` (plus sliced shapes)."""
    out = {}
    layout_dict = getattr(network, "parameter_layout_dict", None) or {}
    for name, lay in layout_dict.items():
        lay = list(lay)
        entry = {"dev_matrix": list(lay[0]), "tensor_map": list(lay[1]),
                 "slice_shape": list(lay[2])}
        if len(lay) > 5:
            entry["opt_shard_group"] = lay[5]
            # group names look like "<size>-<hash>"; optimizer sharding splits the slice's first dim
            size = str(lay[5]).split("-", 1)[0]
            if lay[5] and size.isdigit() and entry["slice_shape"]:
                entry["opt_shard_size"] = int(size)
                entry["opt_local_shape"] = [entry["slice_shape"][0] // int(size)] + entry["slice_shape"][1:]
        if len(lay) > 6:
            entry["full_shape"] = list(lay[6])
        if len(lay) > 7:
            entry["opt_slice_shape"] = list(lay[7])
        out[name] = entry
    try:
        params = network.parameters_dict()
    except Exception:  # pragma: no cover - exotic wrappers
        params = {}
    for name, p in params.items():
        entry = out.setdefault(name, {})
        entry["local_shape"] = list(p.shape)
    return out


def _set_strategy_file(network, path: str) -> None:
    from naohai.strategy.autoparallel import save_strategy_file
    save_strategy_file(network, path)


def _collect_ir(rank: int, rank_dir: Path, name: str, result: dict, first: bool) -> None:
    """Copy the graph just compiled's validate IR to ``rank_dir/<name>.ir`` and count its
    communication ops; the IR folder is then emptied so the next graph's files stand alone."""
    ir_dir = os.environ.get("MS_DEV_SAVE_GRAPHS_PATH")
    if not ir_dir:
        return
    rank_ir = Path(ir_dir) / f"rank_{rank}"
    final = final_ir_file(rank_ir)
    if final is None:
        return
    text = final.read_text(errors="replace")
    (rank_dir / f"{name}.ir").write_text(text)
    result.setdefault("comm_ops_by_graph", {})[name] = count_comm_ops(text)
    if first:
        result["ir_file"] = final.name
        result["comm_ops"] = result["comm_ops_by_graph"][name]
        shutil.copy(final, rank_dir / "final.ir")
    keep = Path(ir_dir) / f"rank_{rank}.{name}"
    shutil.rmtree(keep, ignore_errors=True)
    rank_ir.rename(keep)  # kept (or removed below) per graph


def _save_slices(network, path: Path) -> str:
    """This rank's compile-time parameter values (its slices, optimizer-shard slices included, plus
    replicated scalars; not accumulation buffers or the learning-rate table), as a checkpoint
    would hold them."""
    import mindspore as ms
    layout = getattr(network, "parameter_layout_dict", None) or {}
    params = [p for p in network.get_parameters()
              if (p.name in layout or int(p.size) <= 1) and not p.name.startswith("accu_grads")
              and p.name != "learning_rate"]
    ms.save_checkpoint([{"name": p.name, "data": p} for p in params], str(path))
    return str(path)


def _write(path: Path, data: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True, default=str))
    os.replace(tmp, path)


def main(argv) -> int:
    spec = json.loads(Path(argv[1]).read_text())
    for p in spec.get("sys_path", []):
        if p not in sys.path:
            sys.path.insert(0, p)
    rank = int(os.environ.get("RANK_ID", os.environ.get("MS_NODE_ID", "0")))
    rank_dir = Path(spec["out_dir"]) / f"rank_{rank}"
    rank_dir.mkdir(parents=True, exist_ok=True)
    result = {"rank": rank, "ok": False, "stage": "start", "target": spec["target"]}
    t_start = time.time()
    try:
        import mindspore as ms
        from mindspore.communication import init, get_rank, get_group_size
        ms.set_context(mode=ms.GRAPH_MODE)
        ms.set_device("GPU")
        result["stage"] = "init"
        init()
        result["rank"] = rank = get_rank()
        result["group_size"] = get_group_size()
        result["init_s"] = round(time.time() - t_start, 3)
        result["stage"] = "build"
        built = _resolve(spec["target"])(**spec.get("kwargs", {}))
        graphs = built if isinstance(built, list) else [("main", built[0], tuple(built[1]))]
        result["graphs"] = [item[0] for item in graphs]
        result["compile_s"] = 0.0
        strategy_path = rank_dir / "strategy.ckpt"
        for i, (name, network, compile_args, *prepare) in enumerate(graphs):
            if i == 0:
                _set_strategy_file(network, str(strategy_path))
            result["stage"] = f"compile {name}"
            t0 = time.time()
            for before_compile in prepare:     # a target may carry a callable to run first (its cells' mode)
                before_compile()
            network.compile(*compile_args)
            result["compile_s"] = round(result["compile_s"] + time.time() - t0, 3)
            result.setdefault("compile_s_by_graph", {})[name] = round(time.time() - t0, 3)
            _collect_ir(rank, rank_dir, name, result, first=(i == 0))
            if i == 0:
                result["parameters"] = _layouts(network)
                if spec.get("save_slices"):
                    result["slices_file"] = _save_slices(network, rank_dir / "slices.ckpt")
        result["ok"] = True
        result["stage"] = "done"
        result["strategy_file"] = str(strategy_path) if strategy_path.exists() else None
    except BaseException as exc:  # noqa: BLE001 - everything is reported, nothing hidden
        result["error"] = parse_mindspore_error(exc)
        result["error"]["traceback"] = traceback.format_exc()[-4000:]
    if not spec.get("keep_ir", False):
        ir_dir = os.environ.get("MS_DEV_SAVE_GRAPHS_PATH")
        if ir_dir:
            for d in [Path(ir_dir) / f"rank_{rank}", *Path(ir_dir).glob(f"rank_{rank}.*")]:
                shutil.rmtree(d, ignore_errors=True)
    result["peak_rss_mb"] = round(_peak_rss_mb(), 1)
    result["wall_s"] = round(time.time() - t_start, 3)
    _write(rank_dir / "result.json", result)
    sys.stdout.flush()
    # exit 0 even on a compile error: the verdict is in result.json, and a non-zero exit
    # makes msrun tear down ranks that are still compiling.
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
