"""Whether a run on this machine's CPU fits in the machine's memory, told before anything is prepared.

``naohai train`` (one process) and ``naohai launch`` (its msrun CPU workers on one node, which share
the machine's memory) call :func:`check_host_memory` once the run is planned, before the run folder
is taken or the data prepared.  A recipe too wide for the machine (``model.hidden_size=65536``, a
huge ``model.seq_length`` or ``model.vocab_size``) used to prepare the data and then die building
the model, with a MemoryError traceback or the kernel's out-of-memory kill.  Whether the device is
the CPU is asked only of a run that would not fit (the caller's ``on_cpu``,
:func:`naohai.devices.runs_on_cpu`, which may import MindSpore to resolve ``auto``), so a run that
fits takes its folder before MindSpore is imported, as before.

The figure compared is a lower bound of what the run holds, from the planner's model
(:mod:`naohai.strategy.memory`) for the processes on this machine:

* the float32 weights, gradients and Adam moments (16 bytes per trained parameter, 4 per frozen
  one, + 4 for gradient accumulation), which a CPU run allocates as the planner counts them;
* half of the planner's activations (with the loss's float32 logits).  On CPU they ran above the
  peak resident set of the runs measured (``naohai train tiny ... --max-steps 1..3`` under
  ``/usr/bin/time``, one process, float32, 2026-11-29): planned / peak GB for seq 1024 x batch 16
  3.62 / 3.21, seq 1536 x 16 7.29 / 5.55, seq 2048 x 4 3.07 / 2.89, seq 2048 x 8 6.12 / 4.80 --
  each further GB planned held 0.63-0.64 GB, as the planner counts the attention's masks and
  dropped probabilities at dropout 0.  On the runs with small activations the planner is below the
  peak (MindSpore's own ~0.5 GB, kernels' index tables): tiny (seq 128) 0.19 / 0.82; the bench's
  27m (hidden 512, 8 layers, ffn 1408, seq 256, batch 8) 1.48 / 1.99.  The lower bound of every
  one of these runs is under its peak (tiny 0.10, 27m 0.94, seq 2048 x 8 3.07).

The run is refused (exit 2) when that lower bound exceeds the machine's ``MemTotal``
(:func:`naohai.devices.machine_memory`; unreadable, nothing is checked): such a run cannot fit in
the machine's memory however idle it is (swap aside), while a run the check lets through may still not fit beside other
work (the check does not guess what else the machine runs).  The message names the part that
weighs most (the decoder layers' or the embedding's model states, the attention scores, the loss's
logits, the other activations) and the recipe keys that size it.  ``GB`` is 1024^3 bytes, as in
the plan.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Tuple

from naohai import devices
from naohai.errors import UserError
from naohai.strategy.lora import planned_adapters
from naohai.strategy.memory import (adapter_placements, in_flight, layer_activation_bytes, loss_buffers, place_params,
                                    saved_tensors, stage_activations, stage_states)
from naohai.strategy.run_plan import Run

GB = 1024.0 ** 3
#: the share of the planner's activations counted as surely held on CPU (measured: 0.63 of each further GB)
ACTIVATION_SHARE = 0.5


@dataclass(frozen=True)
class Part:
    what: str
    bytes: float                   # counted in the lower bound (activations at ACTIVATION_SHARE)
    keys: Tuple[str, ...]          # the recipe keys that size it, the first the one most to blame


@dataclass(frozen=True)
class HostNeed:
    processes: int
    states: float                  # float32 weights, gradients and Adam moments of the processes
    activations: float             # the planner's activations of the processes (loss logits included)
    parts: Tuple[Part, ...]        # the lower bound by what holds it, largest first

    @property
    def floor(self) -> float:
        """The bytes the processes hold at the least (see the module docstring)."""
        return self.states + ACTIVATION_SHARE * self.activations

    @property
    def estimate(self) -> float:
        """The planner's whole figure for the processes."""
        return self.states + self.activations


def host_need(run: Run, processes: int = 1) -> HostNeed:
    """What ``processes`` ranks of ``run`` on one machine hold (the whole layout's bytes x processes /
    devices: every rank of a one-node layout, each with its stage's share)."""
    recipe, r = run.recipe, run.strategy
    cfg = recipe.model
    share = processes / r.device_num
    placements = place_params(cfg, r)
    adapters = [] if recipe.finetune is None else adapter_placements(r, planned_adapters(recipe, r))
    trainable = None if recipe.finetune is None else {a.name for a in adapters}

    def states_of(chosen) -> float:
        return share * r.devices_per_stage * sum(s.total for s in stage_states(cfg, r, chosen, trainable))

    states = states_of(placements + adapters)
    embedding = states_of([p for p in placements if not p.name.startswith("layers.")])
    acts = stage_activations(cfg, r)
    activations = share * r.devices_per_stage * sum(a.total for a in acts)
    scores_only = [t for t in saved_tensors(cfg) if t[2] == "scores"]
    loss = loss_buffers(cfg, r)
    scores = logits = 0.0
    for k, a in enumerate(acts):
        layers = [i for i, st in enumerate(r.stage_of_layer) if st == k]
        scores += in_flight(r, k) * sum(layer_activation_bytes(cfg, r, i, tensors=scores_only) for i in layers)
        if k == r.stages - 1:
            logits += loss.kept * a.in_flight + (a.loss_transient if a.loss_transient >= a.working_set else 0.0)
    scores, logits = (share * r.devices_per_stage * x for x in (scores, logits))
    mlp = sum(p.per_device for p in placements if ".mlp." in p.name)
    attention = sum(p.per_device for p in placements if p.name.startswith("layers.") and ".mlp." not in p.name)
    widths = ("model.ffn_hidden_size", "model.hidden_size") if mlp >= attention else \
        ("model.hidden_size", "model.ffn_hidden_size")
    batch = "train.micro_batch_size"
    parts = [Part("the decoder layers' float32 weights (with gradients and Adam moments where they train)",
                  states - embedding,
                  widths + ("model.num_layers",)),
             Part("the embedding (and output head) weights (with gradients and Adam moments where they train)",
                  embedding, ("model.vocab_size", "model.hidden_size")),
             Part("the attention scores (heads x seq_length x seq_length per sequence, every layer)",
                  ACTIVATION_SHARE * scores, ("model.seq_length", "model.num_heads", batch)),
             Part("the loss's float32 logits (seq_length x vocabulary per sequence)", ACTIVATION_SHARE * logits,
                  ("model.vocab_size", "model.seq_length", batch)),
             Part("the layers' other activations (seq_length x hidden / FFN width per sequence, every layer)",
                  ACTIVATION_SHARE * max(0.0, activations - scores - logits),
                  ("model.seq_length", batch) + widths + ("model.num_layers",))]
    return HostNeed(processes, states, activations, tuple(sorted(parts, key=lambda p: -p.bytes)))


def _gb(x: float) -> str:
    return f"{x / GB:,.1f} GB" if x >= 0.1 * GB else f"{x / GB:.2f} GB"


def _value(run: Run, key: str):
    section, name = key.split(".", 1)
    return getattr(run.recipe.model if section == "model" else run.recipe.train, name)


def check_host_memory(run: Run, processes: int = 1, on_cpu: Callable[[], bool] = lambda: True,
                      total: Optional[int] = None) -> Optional[HostNeed]:
    """Refuse (UserError, exit 2) ``processes`` ranks of ``run`` on this machine when they cannot fit in its
    memory (``total`` bytes, default :func:`naohai.devices.machine_memory`) and ``on_cpu()`` says their device
    is its CPU (asked only then); the need, or None when the machine's memory cannot be read."""
    if total is None:
        total = devices.machine_memory()
    if not total:
        return None
    need = host_need(run, processes)
    if need.floor <= total or not on_cpu():
        return need
    big = [p for p in need.parts if p.bytes >= need.floor / 3] or [need.parts[0]]
    told = "; ".join(f"{p.what}, {_gb(p.bytes)} ({', '.join(f'{k} {_value(run, k)}' for k in p.keys)})" for p in big)
    who = "1 process" if processes == 1 else f"{processes} processes"
    raise UserError(
        f"this run cannot fit in this machine's memory: on its CPU ({who}) it needs at least {_gb(need.floor)} -- "
        f"float32 weights, gradients and Adam moments {_gb(need.states)} and half of the planned activations "
        f"{_gb(ACTIVATION_SHARE * need.activations)} (the planner's whole estimate is {_gb(need.estimate)}; on CPU "
        f"its activations ran up to 1.6 times what was measured, so half is counted) -- and the machine has "
        f"{_gb(total)} (MemTotal). Most of it is {told}. Lower those keys, or train where there is more memory (an "
        f"accelerator, or more machines); nothing was prepared or written", where=run.recipe.source or "recipe",
        key=big[0].keys[0], rule="the planned bytes of the run's processes on this machine <= its MemTotal")
