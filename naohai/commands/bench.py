"""`naohai bench`: measure naohai on this machine against PyTorch in the same run.

  naohai bench [--out DIR] [--quick] [--models tiny,27m,42m] [--rounds 3] [--steps N]
               [--compile-layers 4,16,64] [--compile-forms loop,shared,separate] [--no-torch-compile]
               [--torch-threads N] [--no-lm-eval] [--no-inference] [--no-finetune] [--no-matmul-floor]

Writes DIR/bench.md, DIR/bench.json and PNG charts (see :mod:`naohai.bench`).  PyTorch is
an optional extra (``pip install -e ".[bench]"``); without it only naohai's rows are measured.
``--quick``: the tiny model, one round of 6 steps, compile times for 4 and 16 layers of the
default layer loop only, no torch.compile variants (a smoke run of a few minutes).  The downstream
scoring row (lm-eval loglikelihood requests/s of naohai's backend against lm-eval's ``hf`` model on
one tiny LLaMA-layout model, :mod:`naohai.bench.lm_eval_rate`) needs ``.[eval,test]``; ``--no-lm-eval``
skips it.  The inference rows (``naohai data score`` documents/s and KV-cache generation tokens/s against
transformers on the same model, :mod:`naohai.bench.inference_rates`) need ``.[test]``; ``--no-inference``
skips them.  The fine-tuning rows (full SFT against the sft-tiny recipe's LoRA on the first model,
:mod:`naohai.bench.finetune`) run unless ``--no-finetune``.  Beside each model's rows, the train step's
matmuls alone on MindSpore and on PyTorch (:mod:`naohai.bench.matmul_floor`), unless ``--quick`` or
``--no-matmul-floor``.
"""
from __future__ import annotations

import os

from naohai.config import CPU_REDUCTIONS
from naohai.errors import UserError
from naohai.validate import cli_int


def register(sub) -> None:
    p = sub.add_parser("bench", help="measure training throughput / MFU against PyTorch, compile time, loader, "
                                     "memory on this machine")
    p.add_argument("--out", default="runs/bench", help="folder for bench.md, bench.json and the charts "
                                                       "(default runs/bench)")
    p.add_argument("--quick", action="store_true", help="a short smoke run (tiny model, 1 round, 4/16-layer compile)")
    p.add_argument("--models", help="comma-separated: tiny, 27m, 42m (default all three; --quick: tiny)")
    p.add_argument("--rounds", type=cli_int(1, 100), help="rounds per row, best kept (default 3; --quick 1)")
    p.add_argument("--steps", type=cli_int(2, 100000), help="timed steps per round (default tiny 20, 27m and 42m 6)")
    p.add_argument("--compile-layers", help="layer counts for the compile-time probe (default 4,16,64; "
                                            "'none' skips it)")
    p.add_argument("--compile-forms", help="comma-separated layer forms for the compile probe: loop, shared, "
                                           "separate (see train.layer_loop; default all three; --quick: loop)")
    p.add_argument("--no-torch-compile", action="store_true", help="skip the torch.compile rows")
    p.add_argument("--no-lm-eval", action="store_true", help="skip the downstream scoring row (lm-eval "
                                                             "loglikelihood requests/s, naohai against hf)")
    p.add_argument("--no-inference", action="store_true", help="skip the inference rows (data score documents/s "
                                                                "and generation tokens/s, naohai against transformers)")
    p.add_argument("--no-finetune", action="store_true", help="skip the fine-tuning rows (full SFT against LoRA "
                                                              "on the first model: tokens/s, optimizer state, peak RSS)")
    p.add_argument("--no-matmul-floor", action="store_true", help="skip the train steps' matmuls alone "
                                                                  "(MindSpore's and PyTorch's, beside each model's rows)")
    p.add_argument("--torch-threads", type=cli_int(1, 4096), help="torch.set_num_threads (default: PyTorch's)")
    p.add_argument("--cpu-reductions", choices=CPU_REDUCTIONS, default="fused",
                   help="naohai's train.cpu_reductions in its training rows (default fused, its fastest; "
                        "mindspore: MindSpore's own summation order, bit for bit the composed graph)")
    p.set_defaults(run=run)


def parse_layers(text: str):
    """'4,16,64' -> (4, 16, 64); 'none' -> ()."""
    if text.strip().lower() == "none":
        return ()
    out = []
    for part in text.split(","):
        try:
            n = int(part.strip())
        except ValueError:
            n = 0
        if not 1 <= n <= 512:
            raise UserError(f"'{text}' is not a comma-separated list of layer counts in [1, 512] (or 'none')",
                            where="command line", key="--compile-layers")
        if n in out:
            raise UserError(f"layer count {n} is listed twice", where="command line", key="--compile-layers")
        out.append(n)
    return tuple(out)


def parse_forms(text, quick: bool):
    """'loop,shared' -> ('loop', 'shared'); None -> all forms (--quick: loop only)."""
    from naohai.bench.compile_time import FORMS
    if text is None:
        return ("loop",) if quick else tuple(FORMS)
    out = tuple(part.strip() for part in text.split(","))
    for form in out:
        if form not in FORMS:
            raise UserError(f"'{form}' is not one of {', '.join(FORMS)}", where="command line", key="--compile-forms")
    if len(set(out)) != len(out):
        raise UserError(f"'{text}' lists a form twice", where="command line", key="--compile-forms")
    return out


def options(args):
    """The :class:`naohai.bench.suite.Options` of the parsed flags (every check before any work)."""
    from naohai.bench.models import parse_models
    from naohai.bench.suite import Options
    quick = bool(args.quick)
    models = parse_models(args.models or ("tiny" if quick else "tiny,27m,42m"))
    layers = parse_layers(args.compile_layers) if args.compile_layers else ((4, 16) if quick else (4, 16, 64))
    out = os.path.abspath(args.out)
    if os.path.exists(out) and not os.path.isdir(out):
        raise UserError("exists and is not a folder", where=out, key="--out")
    return Options(models=models, rounds=args.rounds or (1 if quick else 3), steps=args.steps or (6 if quick else None),
                   compile_layers=layers, compile_forms=parse_forms(args.compile_forms, quick),
                   torch_compile=not (quick or args.no_torch_compile), torch_threads=args.torch_threads,
                   cpu_reductions=args.cpu_reductions, lm_eval=not args.no_lm_eval, inference=not args.no_inference,
                   finetune=not args.no_finetune, matmul_floor=not (quick or args.no_matmul_floor))


def run(args) -> int:
    opts = options(args)
    from naohai.bench.charts import write_charts
    from naohai.bench.report import render_markdown, write_report
    from naohai.bench.suite import run_suite

    results = run_suite(opts, log=lambda line: print(line, flush=True))
    out = os.path.abspath(args.out)
    paths = write_report(results, out)
    charts = write_charts(results, out)
    print()
    print(render_markdown(results))
    print(f"wrote {paths['markdown']}, {paths['json']}" + (f", {', '.join(charts)}" if charts else ""))
    return 0
