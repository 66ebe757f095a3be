"""Downstream scoring throughput: lm-eval ``loglikelihood`` requests per second, naohai's backend against
lm-eval's ``hf`` model (transformers + PyTorch) on the same model and machine.

:func:`measure` builds one model (:func:`naohai.bench.hf_pair.build_model`: a random ``tiny-llama`` as a
Hugging Face folder and as the naohai model folder imported from it), so both backends read the same
weights and the same ``tokenizer.json``.  The requests are those of the shipped task
``naohai_pydoc_cont`` (context + each choice, 800 requests).  Each backend runs in a worker process
of its own (``python -m naohai.bench.lm_eval_rate ROW MODEL_DIR``), which loads the model, answers one
warm-up call (compiles), then times ``rounds`` calls of all requests; rounds alternate between the
two workers and each keeps its best.  Both use batches of 16: naohai's packed rows of ``seq_length``,
lm-eval's ``hf`` its own length-sorted, right-padded batches.
"""
from __future__ import annotations

import json
import os
import sys
import time
from typing import Any, Callable, Dict, List

from naohai.bench.hf_pair import build_model
from naohai.bench.process import PREFIX, WorkerProcess

BATCH = 16


def _requests():
    from lm_eval.api.instance import Instance

    from naohai.downstream.tasks import SHIPPED

    out = []
    with open(os.path.join(SHIPPED, "naohai_pydoc_cont.jsonl"), encoding="utf-8") as fh:
        for i, line in enumerate(fh):
            doc = json.loads(line)
            for choice in doc["choices"]:
                out.append(Instance(request_type="loglikelihood", doc=doc, arguments=(doc["context"], " " + choice),
                                    idx=i))
    return out


def _backend(row: str, folder: str, seq_length: int):
    if row == "naohai":
        from naohai.downstream.backend import NaohaiEvalLM
        return NaohaiEvalLM(path=folder, batch_size=BATCH)
    from lm_eval.models.huggingface import HFLM
    return HFLM(pretrained=folder, dtype="float32", batch_size=BATCH, device="cpu", max_length=seq_length)


def worker(argv: List[str]) -> int:
    """``ROW FOLDER SEQ_LENGTH``: answer ``@@bench {"ready"}``, then one timed call per stdin line."""
    row, folder, seq = argv[0], argv[1], int(argv[2])
    lm = _backend(row, folder, seq)
    requests = _requests()
    lm.loglikelihood(requests[:BATCH * 2], disable_tqdm=True)       # compile / warm up
    info: Dict[str, Any] = {"ready": True, "requests": len(requests)}
    if row == "hf":
        import torch
        info.update(torch=torch.__version__, threads=torch.get_num_threads())
    sys.stdout.write(PREFIX + json.dumps(info) + "\n")
    sys.stdout.flush()
    for line in sys.stdin:
        if json.loads(line).get("cmd") != "round":
            break
        t0 = time.perf_counter()
        lm.loglikelihood(requests, disable_tqdm=True)
        sys.stdout.write(PREFIX + json.dumps({"seconds": time.perf_counter() - t0}) + "\n")
        sys.stdout.flush()
    return 0


def _worker(row: str, folder: str, seq: int, log_path: str) -> WorkerProcess:
    return WorkerProcess(f"lm-eval rate worker {row}", ["naohai.bench.lm_eval_rate", row, folder, str(seq)], log_path)


def measure(workdir: str, rounds: int = 3, log: Callable[[str], None] = print) -> Dict[str, Any]:
    """{"naohai": req/s, "hf": req/s, "ratio": naohai / hf, ...}; ``{"note": why}`` when it cannot run."""
    try:
        import lm_eval  # noqa: F401
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError as exc:
        return {"note": f"not measured: {exc.name} is not installed (pip install -e \".[eval,test]\")"}
    models = build_model(workdir)
    procs: Dict[str, WorkerProcess] = {}
    best: Dict[str, float] = {}
    try:
        for row in ("naohai", "hf"):
            procs[row] = _worker(row, models[row], models["seq_length"], os.path.join(workdir, f"lm-eval-{row}.log"))
        n = int(procs["naohai"].ready["requests"])
        for r in range(rounds):
            for row, proc in procs.items():
                seconds = float(proc.request(cmd="round")["seconds"])
                best[row] = min(best.get(row, float("inf")), seconds)
                log(f"lm-eval loglikelihood round {r + 1}/{rounds}: {row} {n / seconds:,.1f} requests/s")
    finally:
        for proc in procs.values():
            proc.close()
    rate = {row: n / s for row, s in best.items()}
    return {"requests": n, "batch": BATCH, "model": "tiny-llama (random weights)", "seq_length": models["seq_length"],
            "naohai": rate["naohai"], "hf": rate["hf"], "ratio": rate["naohai"] / rate["hf"],
            "torch_threads": procs["hf"].ready.get("threads"), "rounds": rounds}


if __name__ == "__main__":
    sys.exit(worker(sys.argv[1:]))
