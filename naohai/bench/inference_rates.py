"""Inference throughput against transformers on the same model: ``naohai data score`` documents/s and
KV-cache generation tokens/s.

:func:`measure` builds one model in two forms (:func:`naohai.bench.hf_pair.build_model`: a random
``tiny-llama`` as a Hugging Face folder and the naohai folder imported from it) and runs two worker
processes (``python -m naohai.bench.inference_rates ROW HF_DIR NAOHAI_DIR``), ``naohai`` and ``hf``
(transformers + PyTorch at its defaults), rounds alternating, each keeping its best:

- **score**: the 79 pydoc topics as documents, tokenized once by the model's ``tokenizer.json``, scored by
  :func:`naohai.data.score.score_ids` (``naohai data score``'s windowing: ``[EOD] + ids + [EOD]`` cut into
  windows of ``seq_length``, batches of :data:`SCORE_BATCH`).  The naohai row's NLL function is the one
  ``naohai data score`` builds (:func:`naohai.evaluate.token_nll_fn` over the loaded model); the peer's is
  the transformers model's logits with PyTorch's ``cross_entropy`` under ``inference_mode``.  The two
  rows' perplexities are compared (largest relative difference).
- **generate**: :data:`GEN_BATCH` prompts of :data:`PROMPT_TOKENS` tokens (the first tokens of the longest
  topics), :data:`NEW_TOKENS` new tokens each, greedy, no stop token: naohai's
  :class:`naohai.generate.CachedDecoder` (what ``naohai generate`` runs) against transformers'
  ``generate(do_sample=False, use_cache=True)``.  The share of equal new tokens is reported (greedy on the
  same weights should agree; near-ties between two fp32 implementations can make them part).

Each worker answers warm-up calls of both kinds (compiles: one score call, two generate calls, since naohai's
decoder compiles its prompt pass on its second call) before the timed rounds.
"""
from __future__ import annotations

import json
import os
import sys
import time
from typing import Any, Callable, Dict, List

import numpy as np

from naohai.bench.hf_pair import build_model
from naohai.bench.process import PREFIX, WorkerProcess

SCORE_BATCH = 8
GEN_BATCH = 4
PROMPT_TOKENS = 16
NEW_TOKENS = 64


def _inputs(tok) -> Dict[str, Any]:
    from naohai.data.corpus import pydoc_documents
    docs = tok.encode_batch(list(pydoc_documents()))
    longest = sorted(range(len(docs)), key=lambda i: -len(docs[i]))[:GEN_BATCH]
    return {"docs": docs, "prompts": [docs[i][:PROMPT_TOKENS] for i in longest]}


def _score_lm(nll, tok, seq_length: int, loss_pad_id):
    from naohai.data.score import LM
    return LM(nll=nll, encode_batch=tok.encode_batch, seq_length=seq_length, eod_id=tok.eod_id,
              pad_id=tok.pad_id if tok.pad_id >= 0 else tok.eod_id, loss_pad_id=loss_pad_id, describe={})


def _naohai(folder: str):
    """(scoring LM, generate(prompts) -> new ids, tokenizer, info) through naohai's own code paths."""
    import mindspore as ms

    from naohai.checkpoint.weights import load_model
    from naohai.data.tokenizer import Tokenizer
    from naohai.evaluate import token_nll_fn
    from naohai.generate import CachedDecoder, SamplingConfig

    ms.set_context(mode=ms.PYNATIVE_MODE)      # as `naohai data score` and `naohai generate` set it
    ms.set_device("CPU")
    found, model = load_model(folder)
    model.set_train(False)
    cfg = found.recipe.model
    tok = Tokenizer.load(found.tokenizer_file())
    lm = _score_lm(token_nll_fn(model), tok, cfg.seq_length, cfg.loss_pad_id)
    decoder = CachedDecoder(model, cfg, pad_id=tok.pad_id)

    def generate(prompts, new_tokens=NEW_TOKENS):
        return decoder.generate_ids(prompts, SamplingConfig(max_new_tokens=new_tokens, temperature=0.0),
                                    tok.vocab_size)
    return lm, generate, tok, {}


def _hf(folder: str, seq_length: int, loss_pad_id):
    import torch
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM

    from naohai.data.tokenizer import Tokenizer

    model = AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32).eval()
    tok = Tokenizer.load(os.path.join(folder, "tokenizer.json"))

    def nll(windows: np.ndarray) -> np.ndarray:
        with torch.inference_mode():
            x = torch.from_numpy(np.asarray(windows, np.int64))
            logits = model(input_ids=x[:, :-1]).logits
            return F.cross_entropy(logits.transpose(1, 2), x[:, 1:], reduction="none").double().numpy()
    lm = _score_lm(nll, tok, seq_length, loss_pad_id)

    def generate(prompts, new_tokens=NEW_TOKENS):
        ids = torch.tensor(prompts, dtype=torch.int64)
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                                 min_new_tokens=new_tokens, do_sample=False, use_cache=True,
                                 pad_token_id=lm.pad_id)
        return out[:, ids.shape[1]:].tolist()
    return lm, generate, tok, {"torch": torch.__version__, "threads": torch.get_num_threads()}


def worker(argv: List[str]) -> int:
    """``ROW HF_DIR NAOHAI_DIR SEQ_LENGTH LOSS_PAD_ID``: answer ``@@bench {"ready"}``, then one timed call per
    stdin line (``{"cmd": "score"}`` or ``{"cmd": "generate"}``)."""
    row, hf_dir, nao_dir, seq = argv[0], argv[1], argv[2], int(argv[3])
    loss_pad = None if argv[4] == "none" else int(argv[4])
    from naohai.data.score import perplexities, score_ids
    lm, generate, tok, info = _naohai(nao_dir) if row == "naohai" else _hf(hf_dir, seq, loss_pad)

    def score(docs):                                   # `naohai data score`'s arithmetic, either model's NLL
        return perplexities(score_ids(docs, lm, SCORE_BATCH))
    data = _inputs(tok)
    score(data["docs"][:4])                           # compile / warm up both paths
    generate(data["prompts"], 4)
    generate(data["prompts"], 4)                      # naohai's second call compiles its prompt pass
    info.update(ready=True, documents=len(data["docs"]), tokens=int(sum(len(d) for d in data["docs"])))
    sys.stdout.write(PREFIX + json.dumps(info) + "\n")
    sys.stdout.flush()
    for line in sys.stdin:
        cmd = json.loads(line).get("cmd")
        if cmd not in ("score", "generate"):
            break
        t0 = time.perf_counter()
        result = score(data["docs"]) if cmd == "score" else generate(data["prompts"])
        seconds = time.perf_counter() - t0
        value = [float(x) for x in result] if cmd == "score" else [list(map(int, r)) for r in result]
        sys.stdout.write(PREFIX + json.dumps({"seconds": seconds, "result": value}) + "\n")
        sys.stdout.flush()
    return 0


def _same_tokens(a: List[List[int]], b: List[List[int]]) -> float:
    pairs = [(x, y) for ra, rb in zip(a, b) for x, y in zip(ra, rb)]
    return sum(x == y for x, y in pairs) / max(1, len(pairs))


def measure(workdir: str, rounds: int = 3, log: Callable[[str], None] = print) -> Dict[str, Any]:
    """``{"score": {...}, "generate": {...}, ...}`` with each row's best rate and naohai / hf; ``{"note": why}``
    when transformers or PyTorch is missing."""
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError as exc:
        return {"note": f"not measured: {exc.name} is not installed (pip install -e \".[test]\")"}
    models = build_model(workdir)
    procs: Dict[str, WorkerProcess] = {}
    best: Dict[str, Dict[str, float]] = {"score": {}, "generate": {}}
    last: Dict[str, Dict[str, Any]] = {"score": {}, "generate": {}}
    try:
        for row in ("naohai", "hf"):
            args = [row, models["hf"], models["naohai"], str(models["seq_length"]),
                    "none" if models["loss_pad_id"] is None else str(models["loss_pad_id"])]
            procs[row] = WorkerProcess(f"inference worker {row}", ["naohai.bench.inference_rates", *args],
                                       os.path.join(workdir, f"inference-{row}.log"))
        for r in range(rounds):
            for kind in ("score", "generate"):
                for row, proc in procs.items():
                    ans = proc.request(cmd=kind)
                    best[kind][row] = min(best[kind].get(row, float("inf")), float(ans["seconds"]))
                    last[kind][row] = ans["result"]
                    log(f"inference round {r + 1}/{rounds}: {kind} {row} {ans['seconds']:.2f} s")
    finally:
        for proc in procs.values():
            proc.close()
    docs = int(procs["naohai"].ready["documents"])
    tokens = int(procs["naohai"].ready["tokens"])
    gen_tokens = GEN_BATCH * NEW_TOKENS
    ppl = {row: np.asarray(v, np.float64) for row, v in last["score"].items()}
    both = np.isfinite(ppl["naohai"]) & np.isfinite(ppl["hf"])
    rel = float(np.max(np.abs(ppl["naohai"][both] - ppl["hf"][both]) / ppl["hf"][both])) if both.any() else None
    score = {row: docs / s for row, s in best["score"].items()}
    gen = {row: gen_tokens / s for row, s in best["generate"].items()}
    return {"model": "tiny-llama (random weights)", "seq_length": models["seq_length"], "rounds": rounds,
            "torch_threads": procs["hf"].ready.get("threads"),
            "score": {"documents": docs, "tokens": tokens, "batch": SCORE_BATCH, "naohai": score["naohai"],
                      "hf": score["hf"], "ratio": score["naohai"] / score["hf"], "perplexity_max_rel_diff": rel},
            "generate": {"batch": GEN_BATCH, "prompt_tokens": PROMPT_TOKENS, "new_tokens": NEW_TOKENS,
                         "naohai": gen["naohai"], "hf": gen["hf"], "ratio": gen["naohai"] / gen["hf"],
                         "same_tokens": _same_tokens(last["generate"]["naohai"], last["generate"]["hf"])}}


if __name__ == "__main__":
    sys.exit(worker(sys.argv[1:]))
