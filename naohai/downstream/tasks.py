"""lm-eval tasks for naohai models: find and check them, run them, report the results.

* :func:`prepare` checks every include folder's YAML files (lm-eval itself skips a file it cannot
  parse without a word, so the task would later look "unknown"), checks the task names, then
  loads the tasks (datasets included) once: a bad name, a YAML that does not parse or a missing
  data file is a :class:`~naohai.errors.UserError` (exit 2) before anything runs.  The tasks shipped
  in ``naohai/downstream/shipped/`` (tag ``naohai``) are always on the include path.
* :func:`run` evaluates prepared tasks with an lm-eval model (no sampling of few-shot examples
  differs between calls: the few-shot seed is fixed), :func:`rows` flattens lm-eval's results into
  one row per (task, metric): value, stderr, n, few-shot, model step.
* :func:`table` is the printed table, :func:`write_results` the JSON beside the run (atomic).

lm-eval (``pip install -e ".[eval]"``) is imported only inside these functions;
:func:`require_lm_eval` turns its absence into the install instruction.
"""
from __future__ import annotations

import json
import logging
import math
import os
import time
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence

from naohai.errors import UserError, did_you_mean

SHIPPED = os.path.join(os.path.dirname(os.path.abspath(__file__)), "shipped")
FEWSHOT_SEED = 1234
INSTALL = 'pip install -e ".[eval]"  (or: pip install lm-eval)'


def require_lm_eval(where: str = "command line", key: Optional[str] = "--tasks") -> None:
    try:
        import lm_eval  # noqa: F401
    except ImportError:
        raise UserError(f"downstream tasks need lm-evaluation-harness, which is not installed; install it with "
                        f"{INSTALL}", where=where, key=key) from None


def split_names(text: Any, where: str, key: str) -> List[str]:
    """Task names from 'a,b' or a list; empty names and duplicates are errors."""
    items = text if isinstance(text, (list, tuple)) else str(text or "").split(",")
    names = [str(n).strip() for n in items]
    if not names or any(not n for n in names):
        raise UserError(f"needs comma-separated task names, got {text!r}", where=where, key=key)
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise UserError(f"names a task twice: {', '.join(dupes)}", where=where, key=key)
    return names


def include_paths(extra: Sequence[str] = (), where: str = "command line", key: str = "--include-path") -> List[str]:
    out = [SHIPPED]
    for path in extra:
        if not os.path.isdir(path):
            raise UserError(f"'{path}' is not a folder of task YAML files", where=where, key=key)
        out.append(os.path.abspath(path))
    return out


def check_yaml_files(paths: Sequence[str]) -> None:
    """Every ``*.yaml`` under ``paths`` parses and names a task, group or tag (as lm-eval reads it)."""
    from lm_eval.tasks._yaml_loader import load_yaml

    for root in paths:
        for dirpath, _, files in sorted(os.walk(root)):
            for name in sorted(files):
                if not name.endswith(".yaml"):
                    continue
                path = os.path.join(dirpath, name)
                try:
                    cfg = load_yaml(path, resolve_func=False, recursive=True)
                except Exception as exc:                       # yaml.YAMLError, a missing include, ...
                    text = " ".join(str(exc).split())
                    raise UserError(f"this task file does not parse ({type(exc).__name__}: {text}); lm-eval "
                                    f"would skip it silently and its task would look unknown", where=path) from None
                if not isinstance(cfg, dict) or not any(k in cfg for k in ("task", "group", "tag")):
                    raise UserError("this task file names no 'task' (nor 'group' / 'tag'); every YAML file in a "
                                    "task folder must define one", where=path)


@dataclass
class Prepared:
    """Loaded tasks, ready for :func:`run` as often as wanted."""

    names: List[str]
    loaded: Dict[str, Any]           # TaskManager.load's result
    num_fewshot: Optional[int]
    limit: Optional[int]

    def shots(self) -> Dict[str, int]:
        return {name: int(task.get_config("num_fewshot") or 0) for name, task in self.loaded["tasks"].items()}


def _no_custom_kwargs_hint(record) -> bool:
    """lm-eval warns, for every task with a ``custom_dataset`` loader (the shipped tasks' files beside their
    YAML), that custom kwargs can be passed with ``--metadata``: advice for its own command line, not a
    problem; the record is dropped while tasks load."""
    return "Custom kwargs can be passed to `--metadata`" not in record.getMessage()


def prepare(names: Sequence[str], *, include: Sequence[str] = (), num_fewshot: Optional[int] = None,
            limit: Optional[int] = None, where: str = "command line", key: str = "--tasks",
            include_key: str = "--include-path") -> Prepared:
    """Check and load tasks (see the module docstring)."""
    require_lm_eval(where, key)
    from lm_eval.tasks import TaskManager

    if num_fewshot is not None and num_fewshot < 0:
        raise UserError(f"must be >= 0, got {num_fewshot}", where=where, key="num_fewshot")
    if limit is not None and limit <= 0:
        raise UserError(f"must be a positive number of examples per task, got {limit}", where=where, key="limit")
    paths = include_paths(include, where, include_key)
    check_yaml_files(paths)
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")      # local tasks; a hub dataset fails at once
    # lm-eval's own ~10,000 task files take seconds to index: only when a name is not in the include paths
    manager = TaskManager(include_path=paths, include_defaults=False)
    if not set(names) <= set(manager.all_tasks):
        manager = TaskManager(include_path=paths)
    known = set(manager.all_tasks)
    for name in names:
        if name not in known:
            shipped = sorted(n for n in known if n.startswith("naohai_"))
            raise UserError(f"no task named '{name}'.{did_you_mean(name, sorted(known))} Shipped tasks: "
                            f"{', '.join(shipped)}; lm-eval's own are listed by 'lm-eval ls tasks'; folders of "
                            f"your own YAML files go in with {include_key}", where=where, key=key)
    task_log = logging.getLogger("lm_eval.api.task")
    task_log.addFilter(_no_custom_kwargs_hint)
    try:
        loaded = manager.load(list(names))
    except UserError:
        raise
    except Exception as exc:                                   # FileNotFoundError from datasets, config errors
        text = " ".join(str(exc).split())[:600]
        raise UserError(f"could not load task(s) {', '.join(names)}: {type(exc).__name__}: {text}. A local task "
                        f"needs its data files (dataset_kwargs.data_files, relative to the working directory "
                        f"{os.getcwd()}); a hub dataset needs a local copy (see README, 'Downstream evaluation')",
                        where=where, key=key) from None
    finally:
        task_log.removeFilter(_no_custom_kwargs_hint)
    for task in loaded["tasks"].values():
        if num_fewshot is not None and task.get_config("num_fewshot") != 0:
            task.set_config(key="num_fewshot", value=num_fewshot)
        elif task.get_config("num_fewshot") is None:
            task.set_config(key="num_fewshot", value=0)
        task.set_fewshot_seed(seed=FEWSHOT_SEED)
    return Prepared(list(names), loaded, num_fewshot, limit)


def _hidden_bar(bar, *args, **kwargs):
    """``bar(...)`` with ``disable=True`` whatever the caller passed (lm-eval passes ``disable=False``)."""
    kwargs["disable"] = True
    return bar(*args, **kwargs)


def run(lm, prepared: Prepared, *, log_samples: bool = False, bootstrap_iters: int = 1000,
        progress: bool = True) -> Dict[str, Any]:
    """lm-eval's ``evaluate`` of the prepared tasks with ``lm`` (its results dict).  ``progress=False``
    (the in-loop evaluator, between training log lines) hides lm-eval's progress bars for this call."""
    import functools

    import lm_eval.api.model
    import lm_eval.api.task
    from lm_eval.evaluator import evaluate

    quiet = logging.getLogger("lm-eval"), logging.getLogger("lm_eval")
    levels = [q.level for q in quiet]
    for q in quiet:
        q.setLevel(logging.WARNING)
    # lm-eval draws its bars with the module-level name ``tqdm`` of these two modules (request building,
    # request tokenizing) and offers no switch for them through ``evaluate``
    bars = [(module, module.tqdm) for module in (lm_eval.api.task, lm_eval.api.model)]
    if not progress:
        for module, bar in bars:
            module.tqdm = functools.partial(_hidden_bar, bar)
    try:
        return evaluate(lm=lm, task_dict=prepared.loaded, limit=prepared.limit, log_samples=log_samples,
                        bootstrap_iters=bootstrap_iters, verbosity="WARNING")
    finally:
        for q, level in zip(quiet, levels):
            q.setLevel(level)
        for module, bar in bars:
            module.tqdm = bar


def rows(results: Dict[str, Any], step: Optional[int], prepared: Optional[Prepared] = None) -> List[Dict[str, Any]]:
    """One row per (task, metric, filter): value, stderr (None where lm-eval gives none), n, few-shot, step."""
    out = []
    shots = prepared.shots() if prepared is not None else {}
    for task, metrics in sorted((results.get("results") or {}).items()):
        n = ((results.get("n-samples") or {}).get(task) or {}).get("effective")
        for key, value in sorted(metrics.items()):
            if "," not in key or "_stderr," in key or not isinstance(value, (int, float)):
                continue
            metric, filt = key.split(",", 1)
            err = metrics.get(f"{metric}_stderr,{filt}")
            out.append({"task": task, "metric": metric if filt == "none" else f"{metric} ({filt})",
                        "value": float(value),
                        "stderr": float(err) if isinstance(err, (int, float)) and math.isfinite(err) else None,
                        "n": n, "num_fewshot": shots.get(task, (results.get("n-shot") or {}).get(task)),
                        "step": step})
    return out


def table(rows_: Sequence[Dict[str, Any]]) -> str:
    lines = [f"{'task':<28} {'metric':<26} {'value':>8} {'stderr':>8} {'n':>6} {'shots':>5} {'step':>7}"]
    for r in rows_:
        err = f"{r['stderr']:.4f}" if r["stderr"] is not None else "-"
        lines.append(f"{r['task']:<28} {r['metric']:<26} {r['value']:>8.4f} {err:>8} {r['n'] or '-':>6} "
                     f"{r['num_fewshot'] if r['num_fewshot'] is not None else '-':>5} "
                     f"{r['step'] if r['step'] is not None else '-':>7}")
    return "\n".join(lines)


def results_dir(model_path: str, checkpoint: Optional[str]) -> str:
    """``<run>/downstream`` for a run or one of its checkpoints, ``<model>/downstream`` for an imported model."""
    if checkpoint:
        run_dir = os.path.dirname(os.path.dirname(os.path.abspath(checkpoint)))
        return os.path.join(run_dir, "downstream")
    return os.path.join(os.path.abspath(model_path), "downstream")


def write_results(path: str, rows_: Sequence[Dict[str, Any]], meta: Dict[str, Any],
                  samples: Optional[Dict[str, Any]] = None) -> str:
    """The rows and what produced them as one JSON file, written atomically (tmp file, then rename)."""
    from naohai.data.rundir import atomic_write_text

    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    doc = dict(meta, rows=list(rows_), written=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
    if samples is not None:
        doc["samples"] = samples
    atomic_write_text(path, json.dumps(doc, indent=1, ensure_ascii=False, default=str) + "\n")
    return path


def load_scorer(path: str, *, tokenizer: Optional[str] = None, batch: int = 16, device: Optional[str] = None):
    """(Scorer, tokenizer, step) for a run folder, a checkpoint folder or an imported model folder."""
    import mindspore as ms

    from naohai.data.tokenizer import Tokenizer
    from naohai.downstream.engine import Scorer, greedy_settings, padding_id, text_encoding
    from naohai.checkpoint.weights import load_model
    from naohai.devices import resolve_device

    if not os.path.exists(path):
        raise UserError("no such run, checkpoint or model folder", where=path)
    ms.set_context(mode=ms.PYNATIVE_MODE)
    ms.set_device(resolve_device(device or "auto", where="command line", key="--device"))
    loaded = {}

    def load_tokenizer(found):      # before the weights are read: a wrong tokenizer fails at once
        loaded["tok"] = Tokenizer.load(tokenizer or found.tokenizer_file(),
                                       key="tokenizer" if tokenizer else "data.tokenizer")
    found, model = load_model(path, before_read=load_tokenizer)
    recipe, ckpt, step, tok = found.recipe, found.checkpoint, found.step, loaded["tok"]
    model.set_train(False)
    scorer = Scorer(model, recipe.model, pad_id=padding_id(tok), eod_id=tok.eod_id, stop_ids=tok.stop_ids, batch=batch,
                    **text_encoding(tok, recipe), **greedy_settings(tok))
    scorer.checkpoint = ckpt
    return scorer, tok, step
