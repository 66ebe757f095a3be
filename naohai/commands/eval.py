"""`naohai eval MODEL (--ids FILE.npy | --text FILE | --tasks T1,T2) ...`: loss / perplexity, or downstream tasks.

The model is read by :func:`naohai.checkpoint.weights.load_model`: a run folder (its newest
checkpoint), one checkpoint folder of a run, or an imported model folder
(``naohai ckpt import``).  ``--tasks`` runs lm-evaluation-harness tasks through naohai's
backend (:mod:`naohai.downstream`): ``--num-fewshot``, ``--limit``, ``--include-path`` (folders
of task YAML files; the shipped tasks are always there), a printed table and the results as
JSON in ``<run>/downstream/`` (or ``--out``).

``--out`` is checked before anything is scored: it must be a new file in a folder (or a missing
folder under one), or a results file this command wrote earlier for the same model, which is
replaced; any other existing file, a folder or a symbolic link is refused, so nothing a user wrote
is overwritten.  The ``--tasks`` flags (``--num-fewshot``, ``--limit``, ``--include-path``,
``--log-samples``, ``--out``) are errors with ``--ids`` or ``--text``, not silently ignored.
"""
from __future__ import annotations

import os

from naohai.runfiles import existing_ancestor
from naohai.validate import INT_MAX, cli_int

#: most rows of one forward (--batch): far beyond any device's memory for a real model, small enough that
#: the padded input arrays are allocated rather than overflowing NumPy's shapes
MAX_BATCH = 4096
#: most few-shot examples per prompt (--num-fewshot)
MAX_FEWSHOT = 10_000
#: keys every results JSON written by `naohai eval --tasks` has (naohai.downstream.tasks.write_results)
_RESULTS_KEYS = ("model", "checkpoint", "step", "tasks", "rows", "written")
#: the flags of --tasks mode, as (attribute, flag)
_TASKS_FLAGS = (("num_fewshot", "--num-fewshot"), ("limit", "--limit"), ("include_path", "--include-path"),
                ("log_samples", "--log-samples"), ("out", "--out"))


def register(sub) -> None:
    p = sub.add_parser("eval", help="mean loss / perplexity on token ids or text, or lm-eval downstream tasks")
    p.add_argument("model", help="a run folder (its latest checkpoint), a checkpoint folder, or an imported "
                                 "model folder (see `naohai ckpt import`)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--ids", help=".npy of token ids: a 1-D stream or [n, seq_length + 1] windows")
    src.add_argument("--text", help="UTF-8 text file, encoded with the model's tokenizer")
    src.add_argument("--tasks", help="comma-separated lm-eval task names (shipped: naohai_pydoc_cont, "
                                     "naohai_fortunes_zh_cont, naohai_chid_idiom, naohai_pydoc_word; needs "
                                     "pip install -e \".[eval]\")")
    p.add_argument("--num-fewshot", type=cli_int(0, MAX_FEWSHOT), default=None,
                   help="few-shot examples per prompt (--tasks)")
    p.add_argument("--limit", type=cli_int(1, INT_MAX), default=None,
                   help="at most this many examples per task (--tasks)")
    p.add_argument("--include-path", action="append", default=[], metavar="DIR",
                   help="a folder of your own task YAML files (--tasks; repeatable)")
    p.add_argument("--log-samples", action="store_true", help="keep every example's requests and answers in the "
                                                              "results JSON (--tasks)")
    p.add_argument("--out", help="results JSON (--tasks; default <run>/downstream/step_N.json): a new file, or "
                                 "one this command wrote for the same model (replaced); nothing else is "
                                 "overwritten")
    p.add_argument("--batch", type=cli_int(1, MAX_BATCH), default=None,
                   help="rows per forward (default 8; --tasks: rows of the one compiled scoring graph, default 16)")
    p.add_argument("--device", choices=("auto", "CPU", "GPU", "Ascend"), default="auto",
                   help="device (default auto = Ascend, else GPU, else CPU)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(run=run)


def _is_own_results(path, model) -> bool:
    """``path`` is a results JSON written by ``naohai eval --tasks`` for ``model`` (same folder; any model when
    ``model`` is None)."""
    import json

    try:
        with open(path, encoding="utf-8") as fh:
            doc = json.load(fh)
    except (OSError, UnicodeDecodeError, ValueError, RecursionError):
        return False
    if not isinstance(doc, dict) or not all(k in doc for k in _RESULTS_KEYS):
        return False
    if not isinstance(doc["rows"], list) or not isinstance(doc["tasks"], list) or not isinstance(doc["model"], str):
        return False
    return model is None or os.path.realpath(doc["model"]) == os.path.realpath(model)


def check_out(out, model, key="--out") -> None:
    """Refuse an ``--out`` that cannot be written or would overwrite something that is not this command's own
    earlier results for ``model`` (checked before scoring, and again just before writing).  ``model`` None: any
    earlier results of this command (the default ``<run>/downstream/step_N.json``, whichever spelling of the
    model, run or checkpoint folder, wrote it)."""
    from naohai.errors import UserError

    rule = "a new .json file, or a results file `naohai eval --tasks` wrote for the same model"
    if not out:
        raise UserError("is empty; give the results JSON file to write", where="command line", key=key, rule=rule)
    if out.endswith(("/", os.sep)) or os.path.basename(out) in (".", ".."):
        raise UserError("names a folder; give a file name for the results JSON", where=out, key=key, rule=rule)
    if os.path.islink(out):
        raise UserError("is a symbolic link; give a new file (the link is not replaced)", where=out, key=key,
                        rule=rule)
    if os.path.isdir(out):
        raise UserError("is a folder; give a file name for the results JSON (e.g. a file inside it)", where=out,
                        key=key, rule=rule)
    if os.path.lexists(out):
        if not os.path.isfile(out) or not _is_own_results(out, model):
            whose = os.path.abspath(model) if model else "this model"
            raise UserError(f"already exists and is not a results file of `naohai eval --tasks` for {whose}; "
                            f"choose a new path (nothing is overwritten)", where=out, key=key, rule=rule)
        return
    parent = existing_ancestor(out)
    if not os.path.isdir(parent):
        raise UserError(f"lies under {parent}, which is a file, not a folder", where=out, key=key, rule=rule)
    if not os.access(parent, os.W_OK | os.X_OK):
        raise UserError(f"cannot be written: the folder {parent} is not writable", where=out, key=key, rule=rule)


def _check_flags(args) -> None:
    """Before anything is loaded: empty paths, and --tasks flags given without --tasks."""
    from naohai.errors import UserError

    for key, value in (("--ids", args.ids), ("--text", args.text), ("--tasks", args.tasks)):
        if value is not None and not value.strip():
            raise UserError("is empty; give " + {"--ids": "a .npy file of token ids", "--text": "a UTF-8 text file",
                                                 "--tasks": "comma-separated task names"}[key],
                            where="command line", key=key)
    if args.tasks is None:
        for attr, flag in _TASKS_FLAGS:
            value = getattr(args, attr)
            if value not in (None, False, []):
                raise UserError(f"belongs to --tasks and does nothing with {'--ids' if args.ids else '--text'}; "
                                f"drop it, or evaluate downstream tasks with --tasks", where="command line",
                                key=flag)
    if args.out is not None:
        check_out(args.out, args.model)


def _ids_from_text(path, tokenizer_file, recipe):
    """The file's text as one document, encoded as the model's documents were: its tokens, or as
    ``tokenizer(text)`` encodes it (:func:`naohai.data.pipeline.encodes_special_tokens`)."""
    import numpy as np

    from naohai.data.pipeline import encodes_special_tokens
    from naohai.data.tokenizer import Tokenizer
    from naohai.errors import UserError

    if not os.path.exists(tokenizer_file):
        raise UserError(f"--text needs the model's tokenizer, and {tokenizer_file} does not exist (set the "
                        f"recipe's data.tokenizer, or give --ids)", where=path)
    try:
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError(f"cannot be read as UTF-8 text ({exc})", where=path) from None
    tok = Tokenizer.load(tokenizer_file)
    ids = tok.encode_documents([text])[0] if encodes_special_tokens(recipe, tok) else tok.encode(text)
    return np.asarray(ids, np.int64)


def _read_ids(path):
    import numpy as np

    from naohai.errors import UserError

    try:
        return np.load(path)
    except (OSError, ValueError) as exc:
        raise UserError(f"is not a readable .npy array ({exc})", where=path) from None


def run(args) -> int:
    import json

    import mindspore as ms

    from naohai.errors import UserError
    from naohai.evaluate import evaluate, windows_of
    from naohai.checkpoint.weights import load_model
    from naohai.devices import resolve_device

    if args.batch is not None and not 1 <= args.batch <= MAX_BATCH:
        raise UserError(f"must be an integer in [1, {MAX_BATCH}]", where="command line", key="--batch")
    _check_flags(args)
    if args.tasks is not None:
        return run_tasks(args)
    ids = _read_ids(args.ids) if args.ids else None
    ms.set_context(mode=ms.PYNATIVE_MODE)
    ms.set_device(resolve_device(args.device, where="command line", key="--device"))
    read = {"ids": ids}

    def text_and_windows(found):    # the text encoded and cut into windows before the weights are read
        if read["ids"] is None:
            read["ids"] = _ids_from_text(args.text, found.tokenizer_file(), found.recipe)
        read["windows"] = windows_of(read["ids"], found.recipe.model, args.ids or args.text)
    found, model = load_model(args.model, before_read=text_and_windows)
    recipe, windows = found.recipe, read["windows"]
    model.set_train(False)
    result = evaluate(model, recipe.model, windows, args.batch or 8)
    if args.json:
        print(json.dumps(result.to_dict()))
    else:
        print(f"loss {result.loss:.6f}  perplexity {result.perplexity:.4f}  "
              f"({result.tokens} tokens in {result.windows} windows)")
    return 0


def run_tasks(args) -> int:
    """``--tasks``: check and load the tasks first (errors before the model is read), then score."""
    import json
    import time

    from naohai.downstream import tasks as dt

    names = dt.split_names(args.tasks, "command line", "--tasks")
    prepared = dt.prepare(names, include=args.include_path, num_fewshot=args.num_fewshot, limit=args.limit)
    from naohai.downstream.backend import NaohaiEvalLM
    scorer, tok, step = dt.load_scorer(args.model, batch=args.batch or 16, device=args.device)
    lm = NaohaiEvalLM(scorer=scorer, tok=tok, step=step)
    out = args.out or os.path.join(dt.results_dir(args.model, scorer.checkpoint),
                                   f"step_{step}.json" if step is not None else "results.json")
    own = args.model if args.out is not None else None
    if args.out is None:                     # a given --out was checked before anything was loaded
        check_out(out, own, key="--out")
    t0 = time.time()
    results = dt.run(lm, prepared, log_samples=args.log_samples)
    seconds = time.time() - t0
    rows = dt.rows(results, step, prepared)
    check_out(out, own, key="--out")        # something written there while scoring is not replaced either
    meta = {"model": os.path.abspath(args.model), "checkpoint": scorer.checkpoint, "step": step,
            "tasks": names, "num_fewshot": args.num_fewshot, "limit": args.limit, "seconds": round(seconds, 3),
            "graph_seconds": round(scorer.graph_seconds, 3),
            "truncated": scorer.truncated.to_dict(), "seq_length": scorer.max_length}
    dt.write_results(out, rows, meta, results.get("samples") if args.log_samples else None)
    if args.json:
        print(json.dumps(dict(meta, rows=rows, results_file=out)))
        return 0
    print(dt.table(rows))
    trunc = scorer.truncated
    if trunc.total():
        print(f"truncated from the left to the model's {scorer.max_length} tokens: {trunc.loglikelihood} "
              f"loglikelihood and {trunc.generate} generation request(s) (e.g. {'; '.join(trunc.examples)})")
    print(f"{seconds:.1f} s ({scorer.graph_seconds:.1f} s in the compiled scoring graph); results: {out}")
    return 0

