"""`naohai plot RUN [RUN...] [--out FILE]`: loss, learning rate, throughput and gradient norm of runs."""
from __future__ import annotations

import os


def register(sub) -> None:
    p = sub.add_parser("plot", help="draw runs' metrics.jsonl (loss, learning rate, throughput, gradient norm); "
                                    "several runs are overlaid",
                       description="Draw one or several run folders' metrics.jsonl into one PNG: train and "
                                   "held-out loss, learning rate, tokens/s and gradient norm against the step, "
                                   "one colour per run. One run: RUN/loss.png (what training writes at its end); "
                                   "several: plot.png in the current folder, unless --out.")
    p.add_argument("runs", nargs="+", metavar="RUN", help="run folders (each holds metrics.jsonl)")
    p.add_argument("--out", help="PNG to write (default RUN/loss.png for one run, ./plot.png for several)")
    p.add_argument("--label", action="append", default=None,
                   help="legend name of each run, in order (default: the folder names)")
    p.add_argument("--title", help="figure title (default: the run names)")
    p.set_defaults(run=run)


def run(args) -> int:
    from naohai.errors import UserError
    from naohai.runfiles import existing_ancestor
    from naohai.train.plots import save_metrics_png

    if args.label and len(args.label) != len(args.runs):
        raise UserError(f"{len(args.label)} --label for {len(args.runs)} runs; give one per run or none",
                        where="command line", key="--label")
    for path in args.runs:
        if not os.path.isdir(path):
            raise UserError("is not a folder (naohai plot takes run folders, e.g. runs/tiny)", where=path)
    if args.out is not None and not args.out.strip():
        raise UserError("is empty; give the PNG to write or leave --out out", where="command line", key="--out")
    out = args.out or (os.path.join(args.runs[0], "loss.png") if len(args.runs) == 1 else "plot.png")
    if not out.lower().endswith(".png"):
        raise UserError(f"'{out}' does not end in .png (the figure is written as PNG)", where="command line",
                        key="--out")
    if os.path.isdir(out):
        raise UserError("is a folder; give the PNG file to write", where=out, key="--out")
    parent = existing_ancestor(out)
    if not os.path.isdir(parent):
        raise UserError(f"lies under {parent}, which is a file, not a folder", where=out, key="--out")
    print(f"plot: {save_metrics_png(args.runs, out, args.label, args.title)}")
    return 0
