"""Compile targets for the simulated-device harness tests.

Each function is called inside an msrun worker after ``set_device("GPU")`` and
``init()``; it sets up the parallel context and returns ``(network, compile_args)``.
"""
from __future__ import annotations

import numpy as np
import mindspore as ms
from mindspore import Parameter, Tensor, nn, ops
from mindspore.parallel.auto_parallel import AutoParallel


class _MatMulNet(nn.Cell):
    def __init__(self, strategy):
        super().__init__()
        self.w = Parameter(Tensor(np.full((64, 128), 0.01, np.float32)), name="w")
        self.mm = ops.MatMul().shard(strategy)
        self.sum = ops.ReduceSum()

    def construct(self, x):
        return self.sum(self.mm(x, self.w))


def matmul_mp(strategy=((1, 1), (1, 2)), batch=16):
    """(a) model-parallel MatMul, forward + backward + Momentum update."""
    net = _MatMulNet(tuple(tuple(s) for s in strategy))
    opt = nn.Momentum(net.trainable_params(), 0.1, 0.9)
    step = nn.TrainOneStepCell(net, opt)
    parallel = AutoParallel(step, parallel_mode="semi_auto")
    return parallel, (Tensor(np.ones((batch, 64), np.float32)),)


def killed_on_rank_1():
    """A worker that dies the way the kernel's out-of-memory killer ends one: SIGKILL, no message."""
    import os
    import signal
    from mindspore.communication import get_rank
    if get_rank() == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    return matmul_mp()


def matmul_too_wide():
    """(c) semantically fine net, but the shard product (4) exceeds 2 devices."""
    return matmul_mp(strategy=((1, 1), (1, 4)))


# ---------------------------------------------------------------------------
# (b) dp2 x mp2 x pp2, tied embedding, optimizer parallel, micro_size 4, recompute
# ---------------------------------------------------------------------------
VOCAB, HIDDEN, FFN, SEQ = 128, 32, 64, 8


class _Embed(nn.Cell):
    def __init__(self, dp, mp):
        super().__init__()
        self.table = Parameter(Tensor(np.random.RandomState(0).normal(0, 0.02, (VOCAB, HIDDEN))
                                      .astype(np.float32)), name="table")
        self.gather = ops.Gather().shard(((1, 1), (dp, 1)))

    def construct(self, ids):
        return self.gather(self.table, ids, 0).reshape((-1, HIDDEN))


class _Block(nn.Cell):
    """Pre-norm MLP block; ``selective`` recomputes only the GeLU primitive."""

    def __init__(self, idx, dp, mp, selective):
        super().__init__()
        rng = np.random.RandomState(idx + 1)
        self.norm = nn.LayerNorm((HIDDEN,))
        self.norm.layer_norm.shard(((dp, 1), (1,), (1,)))
        self.w1 = Parameter(Tensor(rng.normal(0, 0.02, (HIDDEN, FFN)).astype(np.float32)),
                            name=f"w1_{idx}")
        self.w2 = Parameter(Tensor(rng.normal(0, 0.02, (FFN, HIDDEN)).astype(np.float32)),
                            name=f"w2_{idx}")
        self.mm1 = ops.MatMul().shard(((dp, 1), (1, mp)))
        self.act = ops.GeLU().shard(((dp, mp),))
        self.mm2 = ops.MatMul().shard(((dp, mp), (mp, 1)))
        self.add = ops.Add().shard(((dp, 1), (dp, 1)))
        if selective:
            self.act.recompute()

    def construct(self, x):
        h = self.mm1(self.norm(x), self.w1)
        return self.add(x, self.mm2(self.act(h), self.w2))


class _HeadLoss(nn.Cell):
    """Tied LM head (MatMul against the embedding table) + cross entropy, all on the last stage."""

    def __init__(self, table, dp, mp):
        super().__init__()
        self.table = table
        self.mm = ops.MatMul(transpose_b=True).shard(((dp, 1), (mp, 1)))
        self.onehot = ops.OneHot().shard(((dp, 1), (), ()))
        self.ce = ops.SoftmaxCrossEntropyWithLogits().shard(((dp, 1), (dp, 1)))
        self.mean = ops.ReduceMean().shard(((dp,),))
        self.on = Tensor(1.0, ms.float32)
        self.off = Tensor(0.0, ms.float32)

    def construct(self, x, labels):
        logits = self.mm(x, self.table)
        onehot = self.onehot(labels.reshape((-1,)), VOCAB, self.on, self.off)
        loss, _ = self.ce(logits, onehot)
        return self.mean(loss)


class TiedLM(nn.Cell):
    def __init__(self, dp, mp, selective=True, full_recompute_last=True, tied=True):
        super().__init__()
        self.embed = _Embed(dp, mp)
        self.block0 = _Block(0, dp, mp, selective)
        self.block1 = _Block(1, dp, mp, selective)
        if full_recompute_last:
            self.block1.recompute()
        head_table = self.embed.table if tied else Parameter(
            Tensor(np.zeros((VOCAB, HIDDEN), np.float32)), name="head_table")
        self.head = _HeadLoss(head_table, dp, mp)

    def construct(self, ids, labels):
        x = self.embed(ids)
        x = self.block1(self.block0(x))
        return self.head(x, labels)


STAGE_CONFIG = {"embed": 0, "block0": 0, "block1": 1, "head": 1}


def _custom_pipeline_reducer(params):
    """The 2.10 PipelineGradReducer(opt_shard=False) branch, without its NameError."""
    from mindspore.parallel.nn.parallel_grad_reducer import grad_scale

    class _Reducer(nn.Cell):
        def __init__(self):
            super().__init__(auto_prefix=False)
            self.accu_grads = params.clone(prefix="accu_grads", init="zeros")
            self.degree = Tensor(1.0, ms.float32)
            self.hyper_map = ops.HyperMap()

        def construct(self, grads):
            return self.hyper_map(ops.partial(grad_scale, self.degree), grads, self.accu_grads)
    return _Reducer()


def tied_pipeline(dp=2, mp=2, stages=2, micro=4, batch=8, reducer="opt_shard_true",
                  optimizer_level="level1", hsdp=True, tie="add_stage", stage_api="pipeline",
                  selective=True, preset_context=False, table_opt_shard=True, grad_accu_shard=None):
    """(b) tied-embedding 2-stage pipeline train step; options select the wiring variant."""
    from mindspore.parallel.nn import Pipeline, PipelineGradReducer
    ms.set_seed(0)
    if grad_accu_shard is not None:
        # AutoParallel never resets this flag (its reset default is True) and level1 keeps it
        ms.set_auto_parallel_context(parallel_optimizer_config={"gradient_accumulation_shard": grad_accu_shard})
    net = TiedLM(dp, mp, selective=selective, tied=(tie != "untied"))
    if not table_opt_shard:
        net.embed.table.parallel_optimizer = False
    if tie == "add_stage":
        net.embed.table.add_pipeline_stage(0)
        net.embed.table.add_pipeline_stage(stages - 1)
    if stage_api == "pipeline":
        net_pp = Pipeline(net, micro, stage_config=STAGE_CONFIG)
    else:  # per-cell pipeline_stage + old PipelineCell
        for name, st in STAGE_CONFIG.items():
            getattr(net, name).pipeline_stage = st
        net_pp = nn.PipelineCell(net, micro)
    if preset_context:
        # nn.Optimizer and PipelineGradReducer read the parallel-optimizer flag when built,
        # but AutoParallel only applies hsdp() at compile time: announce it up front.
        ms.set_auto_parallel_context(parallel_mode="semi_auto_parallel", pipeline_stages=stages,
                                     enable_parallel_optimizer=hsdp)
    opt = nn.AdamWeightDecay(net.trainable_params(), 1e-3)
    if reducer == "opt_shard_true":
        pgr = PipelineGradReducer(opt.parameters, opt_shard=True)
    elif reducer == "opt_shard_false":
        pgr = PipelineGradReducer(opt.parameters, opt_shard=False)
    elif reducer == "opt_shard_none":
        pgr = PipelineGradReducer(opt.parameters)
    elif reducer == "none":
        pgr = None
    else:
        pgr = _custom_pipeline_reducer(opt.parameters)
    grad_fn = ops.value_and_grad(net_pp, None, opt.parameters)

    @ms.jit
    def train_step(ids, labels):
        loss, grads = grad_fn(ids, labels)
        if pgr is not None:
            grads = pgr(grads)
        opt(grads)
        return loss

    parallel = AutoParallel(train_step, parallel_mode="semi_auto")
    parallel.pipeline(stages=stages, scheduler="1f1b")
    if hsdp:
        parallel.hsdp(optimizer_level=optimizer_level, threshold=0)
    ids = Tensor(np.zeros((batch, SEQ), np.int32))
    return parallel, (ids, Tensor(np.zeros((batch, SEQ), np.int32)))


def tied_pipeline_legacy(dp=2, mp=2, stages=2, micro=4, batch=8, opt_shard=True,
                         optimizer_level="level1", tied=True):
    """(b') same net through the older global-context API that MindSpore's own pipeline +
    optimizer-shard unit tests use: set_auto_parallel_context + nn.PipelineCell + the
    pipeline train-step cell that ``Model`` builds (``_TrainGradAccuStepCell``)."""
    from mindspore.nn.wrap.cell_wrapper import _TrainGradAccuStepCell
    ms.set_seed(0)
    ms.set_auto_parallel_context(
        parallel_mode="semi_auto_parallel", pipeline_stages=stages,
        enable_parallel_optimizer=opt_shard,
        **({"parallel_optimizer_config": {"parallel_optimizer_threshold": 0,
                                          "optimizer_level": optimizer_level}} if opt_shard else {}))
    net = TiedLM(dp, mp, tied=tied)
    if tied:
        net.embed.table.add_pipeline_stage(0)
        net.embed.table.add_pipeline_stage(stages - 1)
    for name, st in STAGE_CONFIG.items():
        getattr(net, name).pipeline_stage = st
    net_pp = nn.PipelineCell(net, micro)
    opt = nn.AdamWeightDecay(net.trainable_params(), 1e-3)
    step = _TrainGradAccuStepCell(net_pp, opt)
    step.set_train()
    ids = Tensor(np.zeros((batch, SEQ), np.int32))
    return step, (ids, Tensor(np.zeros((batch, SEQ), np.int32)))


_scale_grad = ops.MultitypeFuncGraph("old_naohai_scale_grad")


@_scale_grad.register("Tensor", "Tensor")
def _scale_one(factor, grad):
    return grad * ops.cast(factor, ops.dtype(grad))


def naohai_value_and_grad_pipeline(recipe_path, strategy_path, overrides=()):
    """The pipeline step naohai shipped before the MindFormers-style step (kept to prove the
    IR checks catch it): naohai's model with the strategy applied, ``Pipeline`` differentiated
    by ``ops.value_and_grad`` inside ``@jit``, gradients / micro, AdamWeightDecay."""
    from mindspore.ops import functional as F
    from mindspore.parallel.nn import Pipeline
    from naohai.strategy.annotate import apply_strategy
    from naohai.strategy.run_plan import plan_run
    from naohai.strategy.runtime import init_runtime
    from naohai.train.builder import make_optimizer
    from naohai.model.transformer import NaohaiLM

    run = plan_run(recipe_path, strategy_path, overrides)
    recipe, resolved = run.recipe, run.strategy
    init_runtime(resolved, "GPU")
    model = NaohaiLM(recipe.model, seed=0)
    apply_strategy(model, resolved)
    # the old step kept the tied table optimizer-sharded (today's step keeps it whole; the old
    # wiring without accumulation buffers fails to compile with a whole table: grad_accu is null)
    model.embedding.word_embedding.parallel_optimizer = True
    optimizer = make_optimizer(model, recipe)
    micro = int(resolved.micro_batches)
    grad_fn = ops.value_and_grad(Pipeline(model, micro), None, optimizer.parameters)
    factor = Tensor(1.0 / micro, ms.float32)
    hyper_map = ops.HyperMap()

    @ms.jit
    def pipeline_train_step(input_ids, labels):
        loss, grads = grad_fn(input_ids, labels)
        grads = hyper_map(F.partial(_scale_grad, factor), grads)
        return F.depend(loss, optimizer(grads))

    parallel = AutoParallel(pipeline_train_step, parallel_mode="semi_auto")
    parallel.pipeline(stages=int(resolved.stages), scheduler=str(resolved.scheduler))
    parallel.hsdp(shard_size=-1, threshold=0, optimizer_level="level1")
    rows = resolved.micro_batch_size * micro * int(resolved.data)
    ids = Tensor(np.zeros((rows, recipe.model.seq_length), np.int32))
    return [("train", parallel, (ids, Tensor(np.zeros((rows, recipe.model.seq_length), np.int32))))]
