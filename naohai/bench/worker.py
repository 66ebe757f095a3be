"""One benchmark row in its own process, driven round by round over a pipe.

MindSpore and PyTorch in one process slowed PyTorch by an order of magnitude here (the
tiny eager row after naohai's rounds in the same process: 444 tokens/s with
OMP_WAIT_POLICY=PASSIVE; in a process of its own 7,600-8,000, same load), so each row
(``naohai``, ``eager``, ``compile``) runs in a worker: ``python -m naohai.bench.worker
ROW MODEL PREPARED_DIR WORKDIR PEAK``.  ``sft-full`` and ``sft-lora`` are :mod:`naohai.bench.finetune`'s rows (MODEL: the bench model as JSON).
It builds the row, answers ``@@bench {"ready": ...}``,
then reads one JSON command per line from stdin -- ``{"cmd": "round", "steps": N}`` (answer:
the timed step seconds, the first step's seconds and the worker's peak resident set so far,
``ru_maxrss`` of ``getrusage(RUSAGE_SELF)`` in bytes), ``{"cmd": "allocated"}`` (naohai:
:meth:`NaohaiRun.allocated`), ``{"cmd": "quit"}``.  Answers are the stdout lines starting with
``@@bench ``; anything else there (library chatter) is ignored.  The parent's side is
:class:`naohai.bench.process.Worker`.
"""
from __future__ import annotations

import json
import os
import sys
from typing import Any, Dict

from naohai.bench.process import PREFIX


def peak_rss_bytes() -> int:
    """This process's peak resident set in bytes (``ru_maxrss``: KiB on Linux)."""
    import resource
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def say(obj: Dict[str, Any]) -> None:
    """One answer to the parent: a stdout line, ``PREFIX`` + JSON (also :mod:`naohai.bench.matmul_floor`'s)."""
    sys.stdout.write(PREFIX + json.dumps(obj) + "\n")
    sys.stdout.flush()


def main(argv) -> int:
    row, model, prepared_dir, workdir, peak = argv[0], argv[1], argv[2], argv[3], float(argv[4])
    from naohai.bench.models import bench_models
    if row.startswith("sft-"):          # fine-tuning rows (naohai.bench.finetune): MODEL is a BenchModel's JSON
        from naohai.bench.finetune import VARIANTS, bench_model_from_json
        from naohai.bench.naohai_row import NaohaiRun
        bm = bench_model_from_json(model)
        runner = NaohaiRun(bm, workdir, peak, prepared_dir=prepared_dir, finetune=VARIANTS[row[4:]], tag=row)
    elif row == "naohai":
        bm = bench_models()[model]
        from naohai.bench.naohai_row import NaohaiRun
        runner = NaohaiRun(bm, workdir, peak, prepared_dir=prepared_dir)
    else:
        bm = bench_models()[model]
        from naohai.bench.naohai_row import bench_recipe
        from naohai.bench.torch_row import TorchRun, peer_module
        peer, why = peer_module()
        if peer is None:
            raise SystemExit(why)
        train = bench_recipe(bm, os.path.join(workdir, "unused"), prepared_dir).train
        runner = TorchRun(peer, bm, prepared_dir, train, compiled=row == "compile")
    info: Dict[str, Any] = {"ready": True}
    if row in ("eager", "compile"):
        import torch
        info.update(torch=torch.__version__, threads=torch.get_num_threads())
    say(info)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["cmd"] == "round":
            times = runner.round(int(cmd["steps"]))
            say({"times": times, "first_step_s": runner.first_step_s, "peak_rss": peak_rss_bytes()})
        elif cmd["cmd"] == "allocated":
            say(runner.allocated())
        else:
            say({"bye": True})
            break
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
