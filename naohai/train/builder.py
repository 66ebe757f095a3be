"""Builds what a training run compiles: model with strategy applied, optimizer, train and eval steps.

``naohai train`` and the simulated compile check (``naohai check --compile``) both
build a :class:`naohai.strategy.run_plan.Run` through :func:`build`, so the graphs checked on a laptop are the graphs
trained.  :class:`CompiledSteps` is what the training loop calls: ``train(batch)`` runs one
optimizer step on this rank's rows (one compiled call, or micro-batches accumulated
on the host for one device / plain data parallel) and ``evaluate(batch)`` the
held-out loss; both return global means, identical on every rank.  Under semi-auto with
``train.eval.tasks`` it also holds the downstream scoring graph (``score_forward``).  :func:`layer_loop`
decides the model's form (one cell per layer, or the layers as one loop over stacked
weights); :meth:`TrainSetup.saved_params` names the state as checkpoint files do in either form.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, Callable, List, Optional, Tuple

import numpy as np
import mindspore as ms
from mindspore import Tensor, nn

from naohai.config import Recipe
from naohai.errors import UserError
from naohai.model import cpu_kernels
from naohai.model.finetune import apply_finetune
from naohai.model.layers import fused_gradient_kernels, fused_reductions
from naohai.model.params import param_shapes
from naohai.model.stack import per_layer_names, stacked_count
from naohai.model.transformer import NaohaiLM
from naohai.strategy.annotate import apply_strategy, layer_loop_refusal
from naohai.strategy.lora import refuse_unsharded_method
from naohai.strategy.autoparallel import compile_inputs, compile_parallel, save_strategy_file
from naohai.strategy.gradients import step_parts
from naohai.strategy.host_collectives import HostComm
from naohai.strategy.resolve import ResolvedStrategy
from naohai.strategy.run_plan import Run
from naohai.strategy.runtime import Runtime, plan_runtime
from naohai.strategy.scoring import score_inputs, score_rows, score_step
from naohai.train.adam_all import AdamWeightDecayAll
from naohai.train.schedule import learning_rate
from naohai.checkpoint.entries import file_view
from naohai.train.step import AccumulateStep, ApplyStep, EvalStep, StepGuard, TrainStep, make_buffers


@dataclass
class StepResult:
    loss: float           # global mean loss of the step's rows
    grad_norm: float      # global gradient norm (after unscaling, before clipping)
    applied: bool         # False: skipped (non-finite or spike)
    loss_scale: float     # the scale this step used


def make_optimizer(model: NaohaiLM, recipe: Recipe, adam_kernel=None) -> nn.Optimizer:
    """AdamW; as in both references, every parameter decays except norm gains/shifts and biases
    (spec ``no_decay``), embedding tables included.  ``adam_kernel`` (:class:`naohai.model.layers.GradientKernels`'
    ``adam_all``, ``train.cpu_reductions: fused``): the update of all parameters by that one kernel
    (:class:`naohai.train.adam_all.AdamWeightDecayAll`)."""
    no_decay = {p.name for p in param_shapes(recipe.model) if p.no_decay}
    params = list(model.trainable_params())
    skips = [per_layer_names(recipe.model, p.name)[0] in no_decay for p in params]
    decay = [p for p, skip in zip(params, skips) if not skip]
    plain = [p for p, skip in zip(params, skips) if skip]
    t, opt = recipe.train, recipe.train.optimizer
    groups = [{"params": decay, "weight_decay": opt.weight_decay}, {"params": plain, "weight_decay": 0.0}]
    groups = [g for g in groups if g["params"]]
    # The schedule is a table indexed in-graph by the optimizer's global_step (saved in
    # checkpoints), so resumed runs see exactly the same rates and skipped steps do not
    # advance it.
    table = np.array([learning_rate(t, i) for i in range(t.steps + 1)], np.float32)
    kwargs = dict(learning_rate=Tensor(table), beta1=opt.adam_beta1, beta2=opt.adam_beta2, eps=opt.adam_eps)
    if adam_kernel is not None:
        return AdamWeightDecayAll(groups, adam_kernel, **kwargs)
    return nn.AdamWeightDecay(groups, **kwargs)


def host_accumulation(resolved: ResolvedStrategy, runtime: Runtime) -> int:
    """Micro-batches the host loops over per step (one device / plain data parallel): the global batch
    over data x micro-batch size, as the strategy was resolved (its divisibility checked there)."""
    if runtime.mode == "semi_auto":
        return 1
    return int(resolved.micro_batches) * int(resolved.gradient_accumulation)


def _split(batch: np.ndarray) -> Tuple[Tensor, Tensor]:
    batch = batch.astype(np.int32)
    return Tensor(batch[:, :-1]), Tensor(batch[:, 1:])


def _masked_split(batch, token_weight, factor: int) -> Tuple[Tensor, Tensor]:
    """Inputs and labels of an SFT batch; sets ``token_weight`` to ``factor / N``, N the learned tokens
    of the GLOBAL batch (``batch.learned`` of a :class:`naohai.data.sft.SFTBatch`; a plain ``(tokens,
    mask)`` pair is a whole global batch) and ``factor`` what the step divides the weighted loss by
    afterwards (see :mod:`naohai.train.step`).  N = 0: the step learns nothing."""
    from naohai.data.sft import masked_labels

    if token_weight is None:
        raise ValueError("an SFT batch (tokens, mask) needs steps built with masked_loss=True")
    ids, labels = masked_labels(batch)
    learned = batch.learned if hasattr(batch, "learned") else int(np.count_nonzero(np.asarray(batch[1])[:, 1:]))
    token_weight.set_data(Tensor(np.float32(factor / learned if learned else 0.0)))
    return Tensor(ids), Tensor(labels)


#: name of the masked loss's weight Parameter (the IR checks look for it)
TOKEN_WEIGHT = "sft.token_weight"


def token_weight_factors(parts, host_micro: int) -> Tuple[int, int]:
    """(train, eval) ``f`` of the masked loss's weight ``f / N`` (N the global batch's learned tokens) for a
    layout's :class:`naohai.strategy.gradients.StepParts`: what the steps divide the summed NLL by afterwards
    -- the host micro-batches (``host_micro`` > 1) or the micro-batches summed inside the network, times
    the data-parallel ranks averaged outside the graph (plain data parallel)."""
    train = host_micro if host_micro > 1 else parts.micro
    return train * parts.averaged, parts.eval_micro * parts.averaged


TRAINING_GRAPHS = ("train", "accumulate")     # the graphs compiled in training mode (dropout on)


@dataclass
class CompiledSteps:
    """The compiled steps of one rank and how the loop calls them."""

    rows: int                          # sequences this rank feeds per optimizer step
    eval_rows: int                     # sequences this rank feeds per eval call
    seq_length: int
    train_step: Any = None             # one call per step (semi-auto: AutoParallel-wrapped)
    accumulate_step: Any = None        # host accumulation: one call per micro-batch ...
    apply_step: Any = None             # ... then one apply
    micro_batch: int = 0
    eval_step: Any = None
    notes: List[str] = field(default_factory=list)
    token_weight: Any = None           # masked loss: the Parameter the host sets per step (see step.py) ...
    weight_factor: int = 1             # ... to weight_factor / N before a train step ...
    eval_weight_factor: int = 1        # ... and to this / N for an eval call (applied on the host)
    score_step: Any = None             # semi-auto with train.eval.tasks: the downstream scoring graph ...
    score_rows: int = 0                # ... the rows this rank feeds it per call ...
    score_global_rows: int = 0         # ... the rows of one call over the whole job ...
    dp_rank: int = 0                   # ... and which of them are this rank's (its data-parallel index)
    model: Any = None                  # the cells every graph shares (their training flag, see _mode)

    def _mode(self, training: bool) -> None:
        """Put the shared cells in training (dropout on) or inference mode before a graph is called.

        The train and eval graphs share one model, and a cell's ``training`` flag is read when a graph is
        compiled, which happens on its first call (or in :meth:`compile`).  Each call therefore sets the mode
        its graph needs; once compiled, a graph keeps the mode it was compiled in."""
        if self.model is not None and self.model.training != training:
            self.model.set_train(training)

    def train(self, batch) -> StepResult:
        """One optimizer step on ``batch``: ``[rows, seq + 1]`` token windows, or an SFT batch
        ``(tokens, mask)`` (steps built with ``masked_loss``)."""
        if isinstance(batch, tuple):
            ids, labels = _masked_split(batch, self.token_weight, self.weight_factor)
        else:
            ids, labels = _split(batch)
        self._mode(True)
        if self.train_step is not None:
            loss, norm, applied, scale = self.train_step(ids, labels)
            loss = float(loss.asnumpy())
        else:
            mb = self.micro_batch
            k = self.rows // mb
            total = 0.0
            for i in range(k):
                total += float(self.accumulate_step(ids[i * mb:(i + 1) * mb], labels[i * mb:(i + 1) * mb]).asnumpy())
            loss = total / k
            norm, applied, scale = self.apply_step()
        return StepResult(loss, float(norm.asnumpy()), bool(applied.asnumpy()), float(scale.asnumpy()))

    def evaluate(self, batch) -> float:
        """Held-out loss of ``batch`` (an SFT batch: the mean NLL of its learned tokens)."""
        self._mode(False)
        if not isinstance(batch, tuple):
            return float(self.eval_step(*_split(batch)).asnumpy())
        ids, labels = _masked_split(batch, self.token_weight, self.eval_weight_factor)
        return float(self.eval_step(ids, labels).asnumpy()) * float(self.token_weight.asnumpy())

    def score_forward(self):
        """The semi-auto scoring graph as :class:`naohai.downstream.engine.Scorer` calls it, or None (other
        layouts score with the model's own packed graph): ``forward(inputs [n, S], labels [n, S]) -> (nll
        [n, S], argmax [n, S])`` for the ``n`` = :attr:`score_global_rows` rows of one call, which every
        rank passes whole; a rank feeds its data-parallel group's share with one-hot row places and gets
        every row's result back (see :mod:`naohai.strategy.scoring`).  ``forward.rows`` is ``n``."""
        if self.score_step is None:
            return None
        r, n, mine = self.score_rows, self.score_global_rows, self.dp_rank * self.score_rows
        places = np.zeros((r, n), np.float32)
        places[np.arange(r), mine + np.arange(r)] = 1.0
        places = Tensor(places)

        def forward(inputs, labels):
            inputs, labels = np.asarray(inputs, np.int32), np.asarray(labels, np.int32)
            if inputs.shape != (n, self.seq_length):
                raise ValueError(f"the scoring graph takes [{n}, {self.seq_length}] rows, got {list(inputs.shape)}")
            self._mode(False)
            out = self.score_step(Tensor(inputs[mine:mine + r]), Tensor(labels[mine:mine + r]), places)
            out = out.asnumpy().reshape(n, self.seq_length, 2)
            return out[..., 0].astype(np.float64), np.rint(out[..., 1]).astype(np.int64)
        forward.rows = n
        forward.sharded = True
        return forward

    def compile(self) -> None:
        """Compile every graph without running it (semi-auto: parameters are sliced by the compile)."""
        for _, cell, args, prepare in self.compile_targets():
            if hasattr(cell, "compile") and args:
                prepare()
                cell.compile(*args)

    def compile_targets(self) -> List[Tuple[str, Any, Tuple[Any, ...], Callable[[], None]]]:
        """(name, cell, zero inputs, prepare) of every graph this rank compiles, in the order they run;
        ``prepare()`` puts the shared model in the graph's mode (see :meth:`_mode`): call it right before
        compiling that graph."""
        s = self.seq_length
        ids = lambda rows: compile_inputs(rows, s)  # noqa: E731
        if self.train_step is not None:
            out = [("train", self.train_step, ids(self.rows))]
        else:
            out = [("accumulate", self.accumulate_step, ids(self.micro_batch)), ("apply", self.apply_step, ())]
        out.append(("eval", self.eval_step, ids(self.eval_rows)))
        if self.score_step is not None:
            out.append(("score", self.score_step, score_inputs(self.score_rows, self.score_global_rows, s)))
        return [(name, cell, args, functools.partial(self._mode, name in TRAINING_GRAPHS)) for name, cell, args in out]


@dataclass
class TrainSetup:
    """What :func:`build` makes for one rank: the model, its optimizer and step guard, the runtime, the
    compiled steps and the host collectives; the state a checkpoint holds and the current rates."""

    model: NaohaiLM
    optimizer: nn.Optimizer
    guard: StepGuard
    runtime: Runtime
    steps: CompiledSteps
    comm: HostComm
    frozen: frozenset = frozenset()    # model parameters a fine-tuning run does not train (its base)

    def state_params(self) -> List[ms.Parameter]:
        """Everything a checkpoint must hold for exact resume (not the LR table or buffers); a fine-tuning
        run's frozen base is not part of it (its checkpoints name the base, naohai.checkpoint.adapters)."""
        seen, out = set(self.frozen), []
        for p in list(self.model.get_parameters()) + list(self.optimizer.get_parameters()) \
                + list(self.guard.get_parameters()):
            if p.name in seen or p.name == "learning_rate":
                continue
            seen.add(p.name)
            out.append(p)
        return out

    def saved_params(self) -> List[Any]:
        """What this rank writes to a checkpoint, by the names files use (a stacked layer-loop tensor as
        one entry per layer, see :mod:`naohai.checkpoint.entries`): under semi-auto only what the compiled step
        gave this rank (its slices; other stages' tensors are left out), plus the replicated scalars."""
        return self._on_this_rank(self.state_params())

    def model_params(self) -> List[Any]:
        """The model's own parameters, frozen base included, as :meth:`saved_params` names them
        (``train.init_from`` loads them)."""
        return self._on_this_rank(list(self.model.get_parameters()))

    def _on_this_rank(self, params: List[ms.Parameter]) -> List[Any]:
        if self.runtime.mode != "semi_auto":
            return file_view(self.model.cfg, params)
        layout = self.steps.train_step.parameter_layout_dict or {}
        return [p for p in params if p.name in layout or int(np.prod(p.shape)) <= 1]

    def optional_in_checkpoint(self, name: str) -> bool:
        """Tensors a loaded checkpoint may lack: none for the same layout; after a reshard into a
        pipeline layout, the tied word embedding on the last stage (MindSpore's transform writes
        the shared table for the stage that owns it; the compiled step sends it across)."""
        return (self.runtime.stages > 1 and self.runtime.stage == self.runtime.stages - 1
                and name == "embedding.word_embedding")

    def loss_scale(self) -> float:
        return float(self.guard.loss_scale.asnumpy())

    def learning_rate(self, recipe: Recipe) -> float:
        """The rate the optimizer uses at its next update (its own step counter)."""
        return learning_rate(recipe.train, int(self.optimizer.global_step.asnumpy().reshape(-1)[0]))


# ``layer_loop: auto`` loops from this many looped layers on.  Below it one cell per layer compiles
# in a few seconds on CPU (shared graphs, probe width: 2.4 s at 4 layers, 6.1 s at 16).  The loop's
# steps get slower with depth -- its weight gradients are dense [layers, ...] tensors summed once per
# iteration -- (tiny's width, loop / cells per step: 0.92-1.27 at 4 layers, 1.00-1.09 at 16,
# 1.06-1.16 at 32 over several runs; README, benchmark section), while its compile time stays
# constant (1.3-1.5 s at 4, 16 or 64 layers) and its resident memory is about half.  A judgement,
# not a measured crossover.
AUTO_LOOP_MIN_LAYERS = 12


def layer_loop(recipe: Recipe, resolved: ResolvedStrategy, runtime: Runtime) -> Tuple[bool, Optional[str]]:
    """(run the equal layers as one loop, a note for the log) from ``train.layer_loop``: ``auto`` loops
    on CPU where the layout allows (one device, data parallel) and at least
    :data:`AUTO_LOOP_MIN_LAYERS` layers are looped; ``always`` wherever the layout allows, else
    refuses; ``never`` keeps one cell per layer."""
    wanted = recipe.train.layer_loop
    if wanted == "never":
        return False, None
    if wanted == "auto" and stacked_count(recipe.model) < AUTO_LOOP_MIN_LAYERS:
        return False, None
    refusal = layer_loop_refusal(recipe.model, resolved, runtime)
    if refusal and wanted == "always":
        raise UserError(f"train.layer_loop is 'always' but {refusal}; use 'auto' or 'never'", where=recipe.source,
                        key="train.layer_loop",
                        rule="the layer loop needs one device or data parallel, and no recompute in the strategy")
    if wanted == "auto" and ms.get_context("device_target") != "CPU":
        return False, None
    if refusal:
        return False, f"layers compiled one by one: {refusal}"
    return True, None


def cpu_reductions(wanted: str, trained) -> Tuple[Optional[object], Optional[str]]:
    """(the fused gradient kernels (:class:`naohai.model.layers.GradientKernels`) or None, a note for the log) for
    ``train.cpu_reductions``.
    ``fused`` takes effect on the CPU backend with naohai's compiled kernels built (the norms' cells were
    built inside :func:`naohai.model.layers.fused_reductions`) and float32 trained parameters; elsewhere the
    note says that MindSpore's ops sum, as with ``mindspore``."""
    if wanted != "fused":
        return None, None
    kernel = fused_gradient_kernels()
    if ms.get_context("device_target") != "CPU":
        why = "it applies to the CPU backend only"
    elif kernel is None:
        why = f"naohai's compiled CPU kernels are not in use ({cpu_kernels.why_not()})"
    elif any(p.dtype != ms.float32 for p in trained):
        why = "its kernels take float32 parameters only"
        kernel = None
    else:
        return kernel, ("norms, attention softmax, SwiGLU activation, cross entropy, global gradient norm, clip "
                        "and AdamW update by naohai's fused kernels (train.cpu_reductions)")
    return None, f"train.cpu_reductions is 'fused' but {why}: MindSpore's ops sum, as with 'mindspore'"


def build(run: Run, runtime: Optional[Runtime] = None, strategy_file: Optional[str] = None,
          masked_loss: bool = False) -> TrainSetup:
    """Build model, optimizer and the steps of ``run`` for this rank.  ``runtime`` comes from
    ``init_runtime`` (left out: one device, :func:`naohai.strategy.runtime.plan_runtime`); under
    semi-auto MindSpore writes the step's parameter strategy file to ``strategy_file``.
    ``masked_loss``: the steps take SFT batches and normalise by the global batch's learned tokens."""
    recipe, resolved = run.recipe, run.strategy
    runtime = runtime or plan_runtime(resolved)
    t = recipe.train
    token_weight = None
    if masked_loss:
        token_weight = ms.Parameter(Tensor(1.0, ms.float32), name=TOKEN_WEIGHT, requires_grad=False)
    loop, loop_note = layer_loop(recipe, resolved, runtime)
    if recipe.finetune is not None and t.layer_loop == "auto":
        loop, loop_note = False, None          # LoRA wraps the ops of each layer's own cell
    fused = t.cpu_reductions == "fused"
    with fused_reductions(fused):
        model = NaohaiLM(recipe.model, seed=t.seed, layer_loop=loop, masked_loss=masked_loss)
    reuse = t.reuse_layer_graphs
    if recipe.finetune is not None:
        refuse_unsharded_method(recipe, resolved, runtime.world)
        apply_finetune(model, recipe.finetune, t.seed, recipe.source or "recipe")
        reuse = False        # adapted and plain layers differ: one graph per layer
    apply_strategy(model, resolved, reuse)
    fused_gradients, note = cpu_reductions(t.cpu_reductions, model.trainable_params())
    optimizer = make_optimizer(model, recipe, fused_gradients.adam_all if fused_gradients is not None else None)
    guard = StepGuard(t.guard)
    parts = step_parts(model, optimizer.parameters, resolved, runtime)
    rows = t.global_batch_size // runtime.dp_size
    seq = recipe.model.seq_length
    eval_rows = rows if runtime.mode == "semi_auto" else t.micro_batch_size
    steps = CompiledSteps(rows, eval_rows, seq, notes=list(parts.notes) + ([loop_note] if loop_note else []),
                  token_weight=token_weight, model=model)
    k = host_accumulation(resolved, runtime)
    steps.weight_factor, steps.eval_weight_factor = token_weight_factors(parts, k)
    steps.notes += [note] if note else []
    if k == 1:
        step = TrainStep(parts.network, optimizer, guard, t.optimizer.grad_clip, parts.micro, parts.collect, parts.reduce_loss,
                         token_weight, fused_gradients)
        step.set_train()
        steps.train_step = compile_parallel(step, resolved, runtime, train=True)
        if strategy_file and runtime.mode == "semi_auto":
            save_strategy_file(steps.train_step, strategy_file)
    else:
        buffers = make_buffers(optimizer.parameters)
        steps.accumulate_step = AccumulateStep(parts.network, optimizer.parameters, buffers, guard, token_weight)
        steps.accumulate_step.set_train()
        steps.apply_step = ApplyStep(optimizer, buffers, guard, t.optimizer.grad_clip, k, parts.collect,
                                     fused_gradients)
        steps.micro_batch = t.micro_batch_size
    evaluator = EvalStep(parts.eval_network, parts.eval_reduce_loss)
    evaluator.set_train(False)
    steps.eval_step = compile_parallel(evaluator, resolved, runtime, train=False)
    if runtime.mode == "semi_auto" and t.eval.tasks:
        steps.score_rows, steps.score_global_rows = score_rows(t.eval.batch, runtime)
        steps.dp_rank = runtime.dp_rank
        steps.score_step = score_step(model, resolved, runtime)
        steps.notes.append(f"downstream scoring graph: {steps.score_global_rows} requests per call, "
                           f"{steps.score_rows} on each data-parallel group, results on every rank")
    frozen = frozenset(p.name for p in model.get_parameters() if not p.requires_grad) if recipe.finetune else frozenset()
    return TrainSetup(model, optimizer, guard, runtime, steps, HostComm(runtime), frozen)
