"""The benchmark's outputs: ``bench.json`` (every figure) and ``bench.md`` (tables).

``results`` is the dict :func:`naohai.bench.suite.run_suite` returns; :func:`render_markdown`
turns it into text and :func:`write_report` writes both files.  Missing figures (a row not
measured, a failed compile) print as an em dash.
"""
from __future__ import annotations

import json
import os
import statistics
from typing import Any, Dict, List, Optional

from naohai.bench.arith import ratio

DASH = "\u2014"
MIB = 1024.0 ** 2


def fmt_int(x: Optional[float]) -> str:
    return DASH if x is None else f"{x:,.0f}"


def fmt_pct(x: Optional[float]) -> str:
    return DASH if x is None else f"{100 * x:.1f}%"


def fmt_ratio(x: Optional[float], digits: int = 2) -> str:
    return DASH if x is None else f"{x:.{digits}f}"


def fmt_s(x: Optional[float]) -> str:
    return DASH if x is None else f"{x:.1f} s"


def fmt_mib(x: Optional[float]) -> str:
    return DASH if x is None else f"{x / MIB:,.1f} MiB"


def _table(head: List[str], rows: List[List[str]]) -> List[str]:
    return ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)] + ["| " + " | ".join(r) + " |" for r in rows]


def fmt_gib(x: Optional[float]) -> str:
    return DASH if x is None else f"{x / 1024.0 ** 3:.2f} GiB"


def median_round(row: Dict[str, Any]) -> Optional[float]:
    """The median of a row's rounds (tokens/s); None when it has none."""
    rounds = [r for r in (row.get("rounds_tokens_per_s") or []) if r is not None]
    return float(statistics.median(rounds)) if rounds else None


def median_ratio(t: Dict[str, Any], peer: str) -> Optional[float]:
    """naohai's median round over ``peer``'s."""
    a, b = median_round(t["naohai"]), median_round(t[peer])
    return a / b if a is not None and b else None


def throughput_rows(results: Dict[str, Any]) -> List[List[str]]:
    rows = []
    for m in results.get("models", []):
        t = m["throughput"]
        rows.append([f"{m['name']} ({m['params'] / 1e6:.2f}M, {m['batch']} x {m['seq']})",
                     fmt_int(t["naohai"]["tokens_per_s"]), fmt_pct(t["naohai"]["mfu"]),
                     fmt_int(t["eager"]["tokens_per_s"]), fmt_pct(t["eager"]["mfu"]),
                     fmt_int(t["compile"]["tokens_per_s"]), fmt_pct(t["compile"]["mfu"]),
                     fmt_ratio(m["ratios"]["naohai_over_eager"]), fmt_ratio(m["ratios"]["naohai_over_compile"]),
                     fmt_ratio(median_ratio(t, "eager")), fmt_ratio(median_ratio(t, "compile"))])
    return rows


def fmt_sec(x: Optional[float]) -> str:
    return DASH if x is None else f"{x:.3f}"


def floor_rows(results: Dict[str, Any]) -> List[List[str]]:
    """Per model with a measured matmul floor: median seconds of each step and of its side's matmuls alone,
    and the difference (the step's time outside its matmuls)."""
    rows = []
    for m in results.get("models", []):
        f = m.get("matmul_floor")
        if not f:
            continue
        med, out = f["median_s"], f["outside_s"]
        rows.append([m["name"], f"{f['count']} ({f['gflop']:.1f}); {f.get('helpers', 0)}", fmt_sec(med.get("naohai")),
                     fmt_sec(med.get("mindspore products")), fmt_sec(out.get("naohai")), fmt_sec(med.get("eager")),
                     fmt_sec(med.get("torch products")), fmt_sec(out.get("eager")), fmt_sec(med.get("compile")),
                     fmt_sec(out.get("compile"))])
    return rows


FLOOR_NOTE = ("The matmuls are the model's products in naohai's compiled train step, read from the kernel graph "
              "MindSpore compiled (`MatMul` and `BatchMatMul`, their shapes and transposes: the layers' projections "
              "and attention forward and backward, the head), run back to back and nothing else, each side in a "
              "worker of its own in the same alternating rounds: one compiled MindSpore graph, and `torch.matmul` on "
              "the same shapes (`naohai/bench/matmul_floor.py`). *Helpers* are the step's other products (a constant "
              "operand or a size of 1: the norms' row means, the softmax's row sums, broadcasts back, RoPE's "
              "rotation), which PyTorch's step does not have; they count in naohai's *outside*. Seconds are medians "
              "of every timed step over the rounds; *outside* is a step's median less its side's matmuls' median: "
              "the time the step spends on everything else (elementwise ops, reductions, the optimizer, the host "
              "loop).")


def rss_rows(results: Dict[str, Any]) -> List[List[str]]:
    rows = []
    for m in results.get("models", []):
        t, r = m["throughput"], m["ratios"]
        rows.append([m["name"]] + [fmt_gib(t[k].get("peak_rss")) for k in ("naohai", "eager", "compile")]
                    + [fmt_ratio(r.get("rss_naohai_over_eager")), fmt_ratio(r.get("rss_naohai_over_compile"))])
    return rows


def peak_lines(peak: Dict[str, Any]) -> List[str]:
    src = peak.get("sources") or {}
    names = {"mindspore": "MindSpore compiled MatMul", "numpy": "NumPy BLAS (child, thread variables cleared)",
             "pytorch": "PyTorch matmul (child, defaults)"}
    parts = [f"{names.get(k, k)} {v:.3f}" if v else f"{names.get(k, k)} failed" for k, v in src.items()]
    out = [f"Measured fp32 matmul peak ({peak['n']}^3, best of {peak['repeats']} calls each): "
           f"**{peak['tflops']:.3f} TFLOP/s**, the best of " + (", ".join(parts) if parts else DASH)
           + " TFLOP/s -- the MFU denominator; model FLOPs per token from `naohai/model/flops.py` for every row."]
    if peak.get("before"):
        out[0] += (f" Measured before the training rows ({peak['before']:.3f}) and after them "
                   f"({peak['after']:.3f})" if peak.get("after") else
                   f" Measured before the training rows ({peak['before']:.3f}; after them it failed)") + \
            ": the best of the two, since this machine's matmul rate drifts between minutes."
    if peak.get("blas_env_cleared"):
        out[0] += f" Cleared for NumPy: {', '.join(peak['blas_env_cleared'])}."
    th = peak.get("theoretical")
    if th and th.get("tflops"):
        out += ["", f"Theoretical fp32 peak of this CPU ({th.get('cpu', '')}): **{th['tflops']:.3f} TFLOP/s** = "
                f"{th['assumptions']} (rule and sources: `naohai/bench/peak.py`); the measured peak is "
                f"{100 * peak['tflops'] / th['tflops']:.0f}% of it"
                + (" -- above the bound: the cores ran faster than the clock the bound assumes (boost, which a "
                   "VM's cpu MHz does not show)." if peak["tflops"] > th["tflops"] else ".")]
    return out


def finetune_lines(ft: Optional[Dict[str, Any]]) -> List[str]:
    """The fine-tuning section (:mod:`naohai.bench.finetune`), or nothing when it did not run."""
    if not ft:
        return []
    rows = []
    for key, label in (("full", "full SFT (every parameter)"), ("lora", "LoRA (base frozen)")):
        r = ft["rows"][key]
        rows.append([label, fmt_int(r["trainable_params"]), fmt_mib(r["optimizer_state_bytes"]),
                     fmt_int(r["tokens_per_s"]), fmt_int(r["learned_tokens_per_s"]), fmt_gib(r.get("peak_rss"))])
    q = ft["ratios"]
    rows.append(["LoRA / full", fmt_ratio(ratio(ft["rows"]["lora"]["trainable_params"],
                                                      ft["rows"]["full"]["trainable_params"]), 3),
                 fmt_ratio(q["lora_over_full_optimizer_state"], 3), fmt_ratio(q["lora_over_full_tokens_per_s"]),
                 fmt_ratio(q["lora_over_full_tokens_per_s"]), fmt_ratio(q["lora_over_full_peak_rss"])])
    lora = ft["lora"]
    return ["## Fine-tuning: full SFT against LoRA (tokens/s, optimizer state, peak RSS)", ""] + _table(
        ["variant", "trained parameters", "optimizer state (Adam moments)", "all tokens/s", "learned tokens/s",
         "peak RSS"], rows) + [
        "", f"{ft['model']} ({ft['params'] / 1e6:.2f}M parameters, random-initialised), batch {ft['batch']} x "
        f"{ft['seq']}, the masked SFT loss on random conversations (prompt 8-31 tokens, response 8-31 learned, "
        f"packed; {100 * ft['learned_fraction']:.1f}% of the labels learned), the same windows in the same order for "
        f"both; LoRA rank {lora['rank']}, alpha {lora['alpha']:g} on `{lora['targets']}` (the sft-tiny recipe's). "
        f"All tokens/s counts every token of the batches, learned tokens/s the loss-mask ones (all tokens/s x the "
        f"learned fraction); best of {ft['rounds']} alternating rounds of {ft['steps_per_round']} timed steps. The "
        "optimizer state is the bytes of AdamWeightDecay's moment tensors as built (fp32, two per trained "
        "parameter); peak RSS is each variant's worker process's `ru_maxrss` (each in a process of its own).", ""]


def render_markdown(results: Dict[str, Any]) -> str:
    env = results["environment"]
    per_round = ", ".join(f"{m['name']} {m['steps_per_round']}" for m in results.get("models", []))
    quiet = env.get("quiet") or {}
    out = ["# naohai bench", ""]
    if quiet.get("warning"):
        out += [f"**{quiet['warning']}**", ""]
    other = quiet.get("other_cpu_share")
    out += [f"{env['date']} on {env['machine']} ({env['cpus']} CPUs; load average {env['load_before']} before, "
            f"{env['load_after']} after"
            + (f"; other processes used {100 * other:.1f}% of the cores during the run" if other is not None else "")
            + f"); MindSpore {env['mindspore']} (naohai's `train.cpu_reductions: "
            f"{env.get('cpu_reductions') or 'mindspore'}`), PyTorch {env.get('torch') or DASH} "
            f"({env.get('torch_threads') or DASH} threads, OMP_WAIT_POLICY={env.get('omp_wait_policy') or DASH}); "
            f"best of {results['rounds']} alternating rounds; timed steps per round: {per_round} "
            f"(each round's first step is not timed).", ""]
    out += peak_lines(results["peak"]) + [""]
    if results.get("torch_note"):
        out += [f"PyTorch rows: {results['torch_note']}", ""]
    out += ["## Training throughput (tokens/s, MFU)", ""]
    out += _table(["model", "naohai", "MFU", "PyTorch eager", "MFU", "torch.compile", "MFU", "naohai / eager",
                   "naohai / compile", "median rounds: / eager", "/ compile"], throughput_rows(results))
    out += ["", "Tokens/s, MFU and the first two ratios are each row's best round; the last two are the ratios of the "
            "rows' median rounds (this machine's rounds can vary by a quarter for any row). "
            "naohai runs through its trainer (data loader, `TrainStep` with clip 1.0 and the finite/loss-scale "
            "guard, learning-rate read, console and metrics-file logging); PyTorch trains the same architecture "
            "(`run/bench/torch_peer.py`) on the same batches: fp32, AdamW with the same decay groups, clip 1.0, "
            "tied head, dropout 0.", ""]
    floors = floor_rows(results)
    if floors:
        out += ["## Where a step's time goes: its matmuls alone (seconds a step)", ""]
        out += _table(["model", "matmuls (GFLOP); helpers", "naohai step", "MindSpore, matmuls alone", "naohai outside",
                       "PyTorch eager step", "PyTorch, matmuls alone", "eager outside", "torch.compile step",
                       "compile outside"], floors)
        out += ["", FLOOR_NOTE, ""]
    if any(m["throughput"]["naohai"].get("peak_rss") for m in results.get("models", [])):
        out += ["## Peak resident memory of each row", ""]
        out += _table(["model", "naohai", "PyTorch eager", "torch.compile", "naohai / eager", "naohai / compile"],
                      rss_rows(results))
        out += ["", "Each row trains in a worker process of its own; the figure is that process's `ru_maxrss` "
                "(getrusage) after its last round: the library, the built model, optimizer state, compiled graphs "
                "(naohai: the train and the eval step), activations and allocator pools.", ""]
    out += finetune_lines(results.get("finetune"))
    comp = results.get("compile")
    if comp:
        out += ["## Train-step compile time (one CPU device, graph mode; hidden 64, seq 32)", ""]
        rows = []
        base = {}
        for r in comp["runs"]:
            if r["layers"] == min(x["layers"] for x in comp["runs"]) and r.get("compile_s"):
                base[r["form"]] = r["compile_s"]
        for r in comp["runs"]:
            b = base.get(r["form"])
            rel = r["compile_s"] / b if b and r.get("compile_s") else None
            ph = r.get("phases") or {}
            rows.append([str(r["layers"]), r["form"],
                         fmt_s(r.get("compile_s")), fmt_ratio(rel)]
                        + [fmt_s(ph.get(k)) for k in ("type_inference", "graph_passes", "kernel_build")]
                        + [r.get("error", "")])
        out += _table(["layers", "decoder layers", "compile", f"x {min(x['layers'] for x in comp['runs'])} layers",
                       "type inference", "graph passes", "kernel build", "note"], rows)
        out += ["", comp.get("note", ""), ""]
    lm = results.get("lm_eval")
    if lm:
        out += ["## Downstream scoring: lm-eval loglikelihood requests/s (naohai backend against lm-eval's hf)", ""]
        if lm.get("note"):
            out += [lm["note"], ""]
        else:
            out += _table(["model", "requests", "naohai", "hf (transformers, PyTorch)", "naohai / hf"],
                          [[lm["model"], str(lm["requests"]), f"{lm['naohai']:,.1f}", f"{lm['hf']:,.1f}",
                            fmt_ratio(lm["ratio"])]])
            out += ["", f"The shipped task naohai_pydoc_cont's requests (context + each choice), batch {lm['batch']}, "
                    f"seq_length {lm['seq_length']}; each backend in a process of its own (PyTorch "
                    f"{lm.get('torch_threads')} threads), best of {lm['rounds']} alternating rounds.", ""]
    inf = results.get("inference")
    if inf:
        out += ["## Inference: data score and generation (naohai against transformers on the same model)", ""]
        if inf.get("note"):
            out += [inf["note"], ""]
        else:
            sc, gen = inf["score"], inf["generate"]
            out += _table(["row", "unit", "naohai", "transformers (PyTorch)", "naohai / transformers", "agreement"],
                          [["data score", "documents/s", f"{sc['naohai']:,.1f}", f"{sc['hf']:,.1f}",
                            fmt_ratio(sc["ratio"]), f"perplexity max rel. diff {sc['perplexity_max_rel_diff']:.1e}"
                            if sc.get("perplexity_max_rel_diff") is not None else "-"],
                           ["generation", "new tokens/s", f"{gen['naohai']:,.1f}", f"{gen['hf']:,.1f}",
                            fmt_ratio(gen["ratio"]), f"{gen['same_tokens']:.1%} of greedy tokens equal"]])
            out += ["", f"{inf['model']}, seq_length {inf['seq_length']}. Data score: {sc['documents']} pydoc topics "
                    f"({sc['tokens']:,} tokens) through `naohai data score`'s windowing, batches of {sc['batch']}; "
                    f"the peer's NLL is the transformers model's logits with PyTorch's cross_entropy. Generation: "
                    f"{gen['batch']} prompts of {gen['prompt_tokens']} tokens, {gen['new_tokens']} new tokens each, "
                    f"greedy, KV cache on both sides (naohai's CachedDecoder, transformers' generate). Each side in a "
                    f"process of its own (PyTorch {inf.get('torch_threads')} threads), best of {inf['rounds']} "
                    f"alternating rounds.", ""]
    if results.get("loader"):
        out += ["## Data loader against training", ""]
        out += _table(["model", "loader tokens/s", "naohai training tokens/s", "loader / training"],
                      [[r["model"], fmt_int(r["loader_tokens_per_s"]), fmt_int(r["train_tokens_per_s"]),
                        fmt_ratio(r["ratio"], 0)] for r in results["loader"]])
        out += [""]
    if results.get("memory"):
        out += ["## Model-state memory: planner (one device) against the built run", ""]
        rows = []
        for r in results["memory"]:
            p, a = r["planned"], r["allocated"]
            rows.append([r["model"], fmt_mib(p["parameters"]), fmt_mib(a["parameters"]),
                         fmt_mib(p["optimizer_state"]), fmt_mib(a["optimizer_state"]), fmt_mib(p["gradients"]),
                         fmt_mib(p["activations"]), fmt_mib(a["rss_after_build"] - a["rss_before_build"]),
                         fmt_mib(a["rss_after_first_round"] - a["rss_before_build"])])
        out += _table(["model", "params planned", "params allocated", "Adam planned", "Adam allocated",
                       "grads planned", "activations planned", "RSS growth: build", "RSS growth: build + steps"],
                      rows)
        out += ["", "Allocated = bytes of the built step's trainable parameters and AdamWeightDecay's moment "
                "tensors; RSS growth includes the compiled graphs, gradients, activations and MindSpore's "
                "memory pool.", ""]
    return "\n".join(out).rstrip() + "\n"


def write_report(results: Dict[str, Any], out_dir: str) -> Dict[str, str]:
    os.makedirs(out_dir, exist_ok=True)
    paths = {"json": os.path.join(out_dir, "bench.json"), "markdown": os.path.join(out_dir, "bench.md")}
    with open(paths["json"], "w", encoding="utf-8") as fh:
        json.dump(results, fh, indent=1, sort_keys=True)
    with open(paths["markdown"], "w", encoding="utf-8") as fh:
        fh.write(render_markdown(results))
    return paths
