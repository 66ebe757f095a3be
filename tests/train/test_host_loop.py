"""The host side of a semi-auto run, exercised on CPU: the real Trainer, checkpoint store and
callbacks on 8 simulated ranks (threads) of a data 2 x model 2 x pipeline 2 layout, each with a
stand-in for its compiled step (a sharded step cannot execute on CPU).

What is checked against independent references: which rows each rank feeds (the loader
reading the whole global batch on one rank, sliced by data-parallel index, and MindSpore's
device-matrix rule ``dp = (rank % per_stage) // (per_stage // dp)``), that only rank 0 logs
and writes metrics, the eval and checkpoint cadence of the recipe, one parameter file per
rank in every checkpoint, and that a resumed run continues at the same data position with
each rank's own slices restored.  On SFT data: each rank's rows and loss mask, and the token
weight it sets from the learned tokens of the GLOBAL batch (the masked loss's normalisation).
"""
from __future__ import annotations

import json
import shutil
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import mindspore as ms
from mindspore import Parameter, Tensor

from naohai.checkpoint.store import CheckpointStore, list_checkpoints, read_manifest
from naohai.data.loader import TokenWindowLoader
from naohai.strategy.runtime import Runtime
from naohai.train.builder import StepResult
from naohai.train.callbacks import Callback, ConsoleLog, MetricsFiles, Throughput
from naohai.train.job import run_identity
from naohai.train.loop import Trainer
from tests.conftest import micro_recipe

ROOT = Path(__file__).resolve().parents[2]
WORLD, DP, STAGES, MICRO = 8, 2, 2, 4
PER_STAGE = WORLD // STAGES
MS_LOCK = threading.Lock()


class ThreadComm:
    """HostComm's contract (all_ok / barrier / mean) between threads; mean is the identity, as
    under semi-auto (the compiled step already returns global means)."""

    def __init__(self, world):
        self.world = world
        self._barrier = threading.Barrier(world)
        self._flags = [True] * world
        self.lock = threading.Lock()

    def bind(self, rank):
        comm = self

        class _Rank:
            def all_ok(self, flag):
                comm._flags[rank] = bool(flag)
                comm._barrier.wait()
                result = all(comm._flags)
                comm._barrier.wait()
                return result

            def barrier(self):
                self.all_ok(True)

            def mean(self, value):
                return value
        return _Rank()


class StandInSteps:
    """What the loop calls on a compiled step; records the rows it was fed."""

    model = None                 # no shared cells whose training mode CompiledSteps._mode would set

    def __init__(self, rank, rows, eval_rows, seq, params):
        self.rank, self.rows, self.eval_rows, self.seq_length = rank, rows, eval_rows, seq
        self.notes = ["stand-in step"]
        self.fed, self.evals, self.compiled = [], 0, 0
        self.params = params
        self.train_step = self   # the loop / checkpoint code reads its parameter layout
        self.parameter_layout_dict = {p.name: None for p in params if p.name != "global_step"}

    def compile(self):
        self.compiled += 1

    def train(self, batch):
        self.fed.append(np.array(batch))
        with MS_LOCK:           # one rank at a time inside MindSpore's Python code (see _warm_up)
            for p in self.params:   # a deterministic "update" of this rank's slices
                p.set_data(Tensor(p.asnumpy() + 1.0))
        step = len(self.fed)
        return StepResult(loss=10.0 / step, grad_norm=1.0, applied=True, loss_scale=1.0)

    def evaluate(self, batch):
        self.evals += 1
        assert batch.shape[0] == self.eval_rows
        return 3.0


class StandInBuilt:
    def __init__(self, runtime, comm, steps, params):
        self.runtime, self.comm, self.steps, self.params = runtime, comm, steps, params

    def saved_params(self):
        return self.params

    def model_params(self):        # the stand-in's parameters are all model weights
        return self.params

    @staticmethod
    def optional_in_checkpoint(name):
        return False

    def loss_scale(self):
        return 1.0

    def learning_rate(self, recipe):
        return 1e-3


def _rank_params(rank):
    # this rank's slices: different per stage and model-parallel position, replicated over data
    stage, local = rank // PER_STAGE, rank % PER_STAGE
    w = Parameter(Tensor(np.full((2, 3), 100.0 * stage + local % (PER_STAGE // DP), np.float32)),
                  name=f"layers.{stage}.w")
    return [w, Parameter(Tensor(np.zeros((1,), np.float32)), name="global_step")]


def _warm_up(tmp):
    """First uses of MindSpore's Python paths in the main thread: CPython 3.11's ast parser is not
    thread-safe ("AST constructor recursion depth mismatch"), and real ranks are separate processes."""
    p = Parameter(Tensor(np.zeros((2,), np.float32)), name="warm")
    p.set_data(Tensor(p.asnumpy() + 1.0))
    path = str(Path(tmp) / "warm.ckpt")
    ms.save_checkpoint([{"name": "warm", "data": p}], path)
    ms.load_checkpoint(path)


def _on_every_rank(comm, body, timeout):
    """Run ``body(rank)`` on one thread per simulated rank; any rank's exception fails the test (the
    barrier is aborted so the other ranks do not wait forever)."""
    errors = []

    def guarded(rank):
        try:
            body(rank)
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            errors.append((rank, repr(exc)))
            comm._barrier.abort()

    threads = [threading.Thread(target=guarded, args=(r,)) for r in range(WORLD)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout)
    assert not errors, errors


def _run_ranks(recipe, prepared, max_steps, resume, extra=None):
    """``extra(rank, steps, built) -> [callbacks]`` adds callbacks per rank (and may equip its steps)."""
    _warm_up(Path(recipe.train.output_dir).parent)
    comm = ThreadComm(WORLD)
    logs = {r: [] for r in range(WORLD)}
    trainers = {}
    t = recipe.train
    for rank in range(WORLD):
        dp_rank = (rank % PER_STAGE) // (PER_STAGE // DP)
        runtime = Runtime("semi_auto", rank, WORLD, dp_rank, DP, STAGES, MICRO)
        params = _rank_params(rank)
        steps = StandInSteps(rank, t.global_batch_size // DP, t.global_batch_size // DP,
                             recipe.model.seq_length, params)
        rank_comm = comm.bind(rank)
        built = StandInBuilt(runtime, rank_comm, steps, params)
        store = CheckpointStore(t.output_dir, rank, WORLD, writes=True, all_ok=rank_comm.all_ok,
                                keep_last=10)
        manifest = {"recipe": recipe.to_dict(), "seed": t.seed, "identity": run_identity(recipe, prepared),
                    "layout": {"signature": "sharded-test", "describe": "stand-in dp2 x mp2 x pp2",
                               "ranks_with_files": list(range(WORLD))}}
        log = logs[rank].append
        trainers[rank] = Trainer(recipe, built, prepared, store=store, manifest=manifest, log=log,
                                 callbacks=[Throughput(t.global_batch_size * recipe.model.seq_length, 1.0, 0.0,
                                                       WORLD, t.logging.log_every),
                                            ConsoleLog(log), MetricsFiles(t.output_dir),
                                            *(extra(rank, steps, built) if extra else [])], max_steps=max_steps)

    def body(rank):
        if resume:
            trainers[rank].resume()
        trainers[rank].run()

    _on_every_rank(comm, body, timeout=120)
    return trainers, logs


def test_semi_auto_host_loop_on_eight_simulated_ranks(tmp_path, micro_data):
    prepared, tok = micro_data
    ms.set_context(mode=ms.PYNATIVE_MODE)
    recipe = micro_recipe(tmp_path / "run", prepared, tok, steps=6, global_batch_size=4, micro_batch_size=1,
                          log_every=2, eval_every=3, eval_batches=2, save_every=4)
    trainers, logs = _run_ranks(recipe, prepared, max_steps=4, resume=False)

    # who logs: rank 0 only; metrics written once
    assert logs[0] and all(not logs[r] for r in range(1, WORLD))
    assert any("layout: stand-in dp2 x mp2 x pp2" in line for line in logs[0])
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if r["split"] == "train"] == [2, 4]      # log_every 2, written once
    assert [r["step"] for r in rows if r["split"] == "valid"] == [0, 3]

    # which rows: the global batch read on one rank, sliced by data-parallel index
    reference = TokenWindowLoader(prepared, "train", 4, 0, 1, seed=recipe.data.shuffle_seed)
    global_batches = [reference.next_batch() for _ in range(6)]
    for rank, tr in trainers.items():
        d = (rank % PER_STAGE) // (PER_STAGE // DP)
        assert len(tr.steps.fed) == 4
        for i, batch in enumerate(tr.steps.fed):
            np.testing.assert_array_equal(batch, global_batches[i][2 * d:2 * d + 2])
    # model-parallel peers and both stages of a data-parallel group feed the same rows
    for a, b in [(0, 1), (0, 4), (0, 5), (2, 3), (2, 7)]:
        np.testing.assert_array_equal(trainers[a].steps.fed[0], trainers[b].steps.fed[0])
    assert not np.array_equal(trainers[0].steps.fed[0], trainers[2].steps.fed[0])

    # eval cadence: steps 0 and 3, eval_batches each, on every rank
    assert all(tr.steps.evals == 2 * 2 for tr in trainers.values())

    # checkpoint cadence: save_every 4 -> step 4 (= end of this invocation); one file per rank
    [ckpt] = list_checkpoints(str(tmp_path / "run"))
    man = read_manifest(ckpt)
    assert man["step"] == 4 and sorted(man["files"]) == sorted(
        [f"rank_{r}.ckpt" for r in range(WORLD)] + [f"rank_{r}.json" for r in range(WORLD)])
    for rank in range(WORLD):
        saved = ms.load_checkpoint(str(Path(ckpt) / f"rank_{rank}.ckpt"))
        expected = _rank_params(rank)[0].asnumpy() + 4.0
        np.testing.assert_array_equal(saved[f"layers.{rank // PER_STAGE}.w"].asnumpy(), expected)

    # resume: every rank compiles first, loads its own file, continues at the data position
    resumed, logs2 = _run_ranks(recipe, prepared, max_steps=None, resume=True)
    assert any("resumed from" in line for line in logs2[0])
    for rank, tr in resumed.items():
        d = (rank % PER_STAGE) // (PER_STAGE // DP)
        assert tr.steps.compiled == 1 and len(tr.steps.fed) == 2 and tr.step == 6
        for i, batch in enumerate(tr.steps.fed):
            np.testing.assert_array_equal(batch, global_batches[4 + i][2 * d:2 * d + 2])
        np.testing.assert_array_equal(tr.built.params[0].asnumpy(), _rank_params(rank)[0].asnumpy() + 6.0)
    assert [read_manifest(c)["step"] for c in list_checkpoints(str(tmp_path / "run"))] == [4, 6]


def _pipeline_checkpoint(tmp_path, micro_data, compiled_layout):
    """A checkpoint of the tiny model under dp2 x mp2 x pp2 at step 2 (its weights: the slices of
    MindSpore's simulated compile, with that compile's strategy files) and a micro run recipe for the
    same model: ``(checkpoint folder, recipe, layout record, {rank: slices}, tiny recipe)``."""
    from naohai.checkpoint.files import sha256_file, write_json
    from naohai.config import load_recipe
    from naohai.strategy.run_plan import plan_run
    from naohai.train.job import planned_checkpoint_layout

    prepared, tok = micro_data
    strategy = ROOT / "strategies" / "tiny-dp2-mp2-pp2.yaml"
    rc, workdir, out = compiled_layout(["tiny", str(strategy), "train.micro_batch_size=2"])
    assert rc == 0, out[-2000:]
    tiny = load_recipe(str(ROOT / "recipes" / "tiny.yaml"), ["train.micro_batch_size=2"])
    layout = planned_checkpoint_layout(plan_run(tiny, str(strategy)).strategy)
    slices = {r: ms.load_checkpoint(str(workdir / f"rank_{r}" / "slices.ckpt")) for r in range(WORLD)}

    sharded = tmp_path / "sharded"
    (sharded / "strategy").mkdir(parents=True)
    files = {}
    for r in range(WORLD):
        ms.save_checkpoint([{"name": k, "data": v} for k, v in slices[r].items()], str(sharded / f"rank_{r}.ckpt"))
        shutil.copyfile(workdir / f"rank_{r}" / "strategy.ckpt", sharded / "strategy" / f"rank_{r}.ckpt")
        for name in (f"rank_{r}.ckpt", f"strategy/rank_{r}.ckpt"):
            files[name] = {"sha256": sha256_file(str(sharded / name)), "bytes": (sharded / name).stat().st_size}
    run = tmp_path / "run"
    recipe = micro_recipe(run, prepared, tok, steps=6, global_batch_size=4, micro_batch_size=1, save_every=100)
    recipe.model = tiny.model            # the checkpoint's model
    loader_state = TokenWindowLoader(prepared, "train", 4, 0, 1, seed=recipe.data.shuffle_seed).state_dict()
    loader_state["sample"] = 8
    write_json(str(sharded / "manifest.json"), {"format": "naohai-checkpoint/1", "step": 2, "recipe": recipe.to_dict(),
                                                 "layout": dict(layout, ranks_with_files=list(range(WORLD))),
                                                 "files": files, "data": {"loader": loader_state}})
    return sharded, recipe, layout, slices, workdir


@pytest.mark.slow
def test_resume_reshards_a_full_checkpoint_for_a_pipeline_layout(tmp_path, micro_data, compiled_layout):
    """A run under dp2 x mp2 x pp2 finds a full checkpoint (another layout): rank 0 reshards it with
    the strategy files of this run's compile (here: MindSpore's simulated compile of that layout),
    every rank loads its slices.  Reference: MindSpore's own compile-time slices of the same weights."""

    from naohai.checkpoint.reshard import reshard_checkpoint

    prepared, _ = micro_data
    sharded, recipe, layout, slices, workdir = _pipeline_checkpoint(tmp_path, micro_data, compiled_layout)
    # a full checkpoint of the same weights: the compile's slices merged by MindSpore's transform
    run = Path(recipe.train.output_dir)
    reshard_checkpoint(str(sharded), str(run / "checkpoints" / "step_00000002"))   # -> full tensors

    # this run's compile wrote its strategy files where the trainer keeps them
    (run / "strategy").mkdir(parents=True)
    for r in range(WORLD):
        shutil.copyfile(workdir / f"rank_{r}" / "strategy.ckpt", run / "strategy" / f"rank_{r}.ckpt")

    def params_of(rank):
        return [Parameter(Tensor(np.zeros(v.shape, v.asnumpy().dtype)), name=k) for k, v in slices[rank].items()]

    comm = ThreadComm(WORLD)
    trainers, logs = {}, {r: [] for r in range(WORLD)}
    for rank in range(WORLD):
        dp_rank = (rank % PER_STAGE) // (PER_STAGE // DP)
        runtime = Runtime("semi_auto", rank, WORLD, dp_rank, DP, STAGES, MICRO)
        params = params_of(rank)
        steps = StandInSteps(rank, 2, 2, 32, params)
        rank_comm = comm.bind(rank)
        built = StandInBuilt(runtime, rank_comm, steps, params)
        store = CheckpointStore(str(run), rank, WORLD, all_ok=rank_comm.all_ok)
        manifest = {"recipe": recipe.to_dict(), "seed": 0, "layout": layout,
                    "identity": run_identity(recipe, prepared)}
        trainers[rank] = Trainer(recipe, built, prepared, store=store, manifest=manifest, log=logs[rank].append)

    def body(rank):
        assert trainers[rank].resume()

    _warm_up(tmp_path)
    _on_every_rank(comm, body, timeout=300)
    assert any("resharding it for" in line for line in logs[0]), logs[0]
    for rank, tr in trainers.items():
        assert tr.step == 2 and tr.loader.sample == 8
        for p in tr.built.params:
            np.testing.assert_array_equal(p.asnumpy(), slices[rank][p.name].asnumpy(), err_msg=f"rank {rank} {p.name}")


class _OneRank:
    """HostComm's contract for a world of one."""

    def all_ok(self, flag):
        return bool(flag)

    def barrier(self):
        pass

    def mean(self, value):
        return value


@pytest.mark.slow
def test_init_from_a_pipeline_checkpoint_on_one_device(tmp_path, micro_data, compiled_layout):
    """train.init_from a dp2 x mp2 x pp2 checkpoint (another layout) on one device: rank 0 merges it
    (resume's resharding path) and loads the model weights only, at step 0 and the data's start.
    Reference: the host model of the same seed, whose slices the simulated compile wrote."""
    from naohai.model.transformer import NaohaiLM
    prepared, _ = micro_data
    sharded, recipe, layout, slices, _ = _pipeline_checkpoint(tmp_path, micro_data, compiled_layout)
    from naohai.config import load_recipe
    tiny_seed = load_recipe(str(ROOT / "recipes" / "tiny.yaml")).train.seed   # the compile's model seed
    host = {p.name: p.asnumpy() for p in NaohaiLM(recipe.model, seed=tiny_seed).get_parameters()}
    params = [Parameter(Tensor(np.zeros_like(v)), name=k) for k, v in host.items()]
    moment = Parameter(Tensor(np.full((3,), 5.0, np.float32)), name="adam_m.layers.0.attention.q_weight")
    runtime = Runtime("standalone", 0, 1, 0, 1, 1, 1)
    steps = StandInSteps(0, 4, 4, recipe.model.seq_length, params + [moment])
    built = StandInBuilt(runtime, _OneRank(), steps, params + [moment])
    run = Path(recipe.train.output_dir)
    store = CheckpointStore(str(run), 0, 1)
    one = {"signature": "full", "describe": "one device", "ranks_with_files": [0], "world": 1, "stages": 1}
    logs = []
    trainer = Trainer(recipe, built, prepared, store=store, manifest={"recipe": recipe.to_dict(), "seed": 0,
                                                                        "layout": one}, log=logs.append)
    trainer.init_from(str(sharded))
    assert trainer.step == 0 and trainer.loader.sample == 0 and steps.compiled == 1
    for p in params:
        np.testing.assert_array_equal(p.asnumpy(), host[p.name], err_msg=p.name)
    np.testing.assert_array_equal(moment.asnumpy(), np.full((3,), 5.0, np.float32))   # optimizer state fresh
    assert any("resharding it for one device" in line for line in logs), logs
    assert any(line.startswith("initialised from checkpoint") and "resharded for this layout" in line
               for line in logs), logs


class ScoreGraphStandIn:
    """The semi-auto downstream scoring graph of all 8 ranks (naohai.strategy.scoring), as MindSpore defines a
    semi-auto graph: a function of the GLOBAL batch, whose rows are the data-parallel groups' inputs in group
    order.  Each rank's call posts what it fed and waits; once all 8 have, the function is computed once on
    the whole weights (the row-scoring net on one device) and every rank gets it back (the graph's
    all-reduce over data parallel and the pipeline's output broadcast).  Ranks of one data-parallel group
    (model-parallel peers, both stages) must feed the same rows, as the compiled graph requires."""

    def __init__(self, model):
        from naohai.model.transformer import RowScoreNet
        self.net = RowScoreNet(model)
        self.fed, self.calls, self.problems = {}, 0, []
        self.barrier = threading.Barrier(WORLD, action=self._compute)

    def bind(self, rank):
        def step(ids, labels, places):
            self.fed[rank] = (ids.asnumpy(), labels.asnumpy(), places.asnumpy())
            self.barrier.wait(60)
            return Tensor(self.result)
        return step

    def _compute(self):
        groups = {}
        for rank, fed in sorted(self.fed.items()):
            d = (rank % PER_STAGE) // (PER_STAGE // DP)
            if d not in groups:
                groups[d] = fed
            elif not all(np.array_equal(a, b) for a, b in zip(groups[d], fed)):
                self.problems.append(f"call {self.calls}: rank {rank} fed other rows than its data-parallel group")
        ids, labels, places = (np.concatenate([groups[d][k] for d in range(DP)]) for k in range(3))
        self.result = self.net(Tensor(ids), Tensor(labels), Tensor(places)).asnumpy()
        self.calls += 1


class Collect(Callback):
    """Keeps the downstream rows a rank's callbacks are handed."""

    def __init__(self):
        self.rows = []

    def on_downstream(self, trainer, step, rows):
        self.rows.append((step, rows))


def test_in_loop_downstream_eval_agrees_on_every_rank(tmp_path, micro_data):
    """train.eval under dp2 x mp2 x pp2: every rank's DownstreamEval feeds its data-parallel share of each
    scoring call through CompiledSteps.score_forward and gets every result back; all 8 ranks hand the same
    rows to their callbacks, equal to scoring the same weights on one device with the packed graph and
    the key/value-cache decoder, and rank 0 writes them once."""
    from naohai.downstream import tasks as dt
    from naohai.downstream.backend import NaohaiEvalLM
    from naohai.downstream.engine import Scorer, padding_id
    from naohai.data.tokenizer import Tokenizer
    from naohai.model.transformer import NaohaiLM
    from naohai.strategy.scoring import score_rows
    from naohai.train.builder import CompiledSteps
    from naohai.train.downstream import DownstreamEval
    from tests.downstream.test_tasks import GEN_YAML, MC_ROWS, MC_YAML, write_task

    prepared, tok_path = micro_data
    ms.set_context(mode=ms.PYNATIVE_MODE)
    folder = tmp_path / "tasks"
    write_task(folder, "mc_probe", MC_YAML, MC_ROWS * 3)
    write_task(folder, "gen_probe", GEN_YAML, [{"context": r["context"], "answer": "the"} for r in MC_ROWS])
    recipe = micro_recipe(tmp_path / "run", prepared, tok_path, steps=4, global_batch_size=4, micro_batch_size=1,
                          log_every=2, eval_every=100, save_every=100,
                          eval={"tasks": ["mc_probe", "gen_probe"], "every": 2, "include_path": [str(folder)],
                                "batch": 5})
    model = NaohaiLM(recipe.model, seed=7)
    model.set_train(False)
    graph = ScoreGraphStandIn(model)
    rows, n = score_rows(5, Runtime("semi_auto", 0, WORLD, 0, DP, STAGES, MICRO))
    assert (rows, n) == (4, 8)          # 5 requests asked: 2 groups x 4 micro-batches x 1 row
    evals, seen = {}, {}

    def extra(rank, steps, built):
        steps.score_step, steps.score_rows, steps.score_global_rows = graph.bind(rank), rows, n
        steps.dp_rank = built.runtime.dp_rank
        built.model = model
        evals[rank] = DownstreamEval(recipe, log=lambda *_: None)
        evals[rank].check()              # lm-eval loads its tasks in the main thread
        seen[rank] = Collect()
        return [evals[rank], seen[rank]]

    StandInSteps.score_forward = CompiledSteps.score_forward      # the real adapter on the stand-in step
    StandInSteps._mode = CompiledSteps._mode                      # ... which sets the model's mode (none here)
    try:
        with MS_LOCK:
            graph.net(Tensor(np.zeros((n, recipe.model.seq_length), np.int32)),
                      Tensor(np.zeros((n, recipe.model.seq_length), np.int32)),
                      Tensor(np.eye(n, dtype=np.float32)))        # first use in the main thread (see _warm_up)
        trainers, logs = _run_ranks(recipe, prepared, max_steps=None, resume=False, extra=extra)
    finally:
        del StandInSteps.score_forward
    assert not graph.problems, graph.problems[:3]
    assert graph.calls > 0

    # every rank: evaluations at steps 0, 2, 4 with the same rows
    for rank in range(WORLD):
        assert [step for step, _ in seen[rank].rows] == [0, 2, 4]
        strip = lambda rs: [{k: v for k, v in r.items() if "seconds" not in k} for r in rs]  # noqa: E731
        assert [strip(r) for _, r in seen[rank].rows] == [strip(r) for _, r in seen[0].rows], rank
    assert all(evals[r].lm.scorer.shapes == {(n, recipe.model.seq_length)} for r in range(WORLD))

    # equal to one device: the same weights through the packed graph and the cached decoder
    tok = Tokenizer.load(tok_path)
    one = Scorer(model, recipe.model, pad_id=padding_id(tok), eod_id=tok.eod_id, batch=4)
    prepared_tasks = dt.prepare(["mc_probe", "gen_probe"], include=[str(folder)])
    reference = {(r["task"], r["metric"]): r["value"]
                 for r in dt.rows(dt.run(NaohaiEvalLM(scorer=one, tok=tok, step=0), prepared_tasks), 0)}
    for _, step_rows in seen[0].rows:
        got = {(r["task"], m): r[m] for r in step_rows for m in ("acc", "acc_norm", "exact_match") if m in r}
        assert got == pytest.approx(reference, abs=1e-6) and len(got) == 3
    # the greedy generations themselves, not only their exact-match score
    prompts = [tok.encode(r["context"]) for r in MC_ROWS]
    want = one.generate(prompts, 4)
    got = {}
    comm = ThreadComm(WORLD)
    _on_every_rank(comm, lambda rank: got.__setitem__(rank, evals[rank].lm.scorer.generate(prompts, 4)), 60)
    assert all(got[r] == want for r in range(WORLD)), (got[0], want)

    # rank 0 writes the downstream rows once
    metrics = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["task"]) for r in metrics if r["split"] == "downstream"] == [
        (s, t) for s in (0, 2, 4) for t in ("gen_probe", "mc_probe")]


class SFTStandInSteps(StandInSteps):
    """The stand-in for a masked-loss step: records each SFT batch and the weight the real
    :func:`naohai.train.builder._masked_split` sets on this rank (``MICRO`` micro-batches summed inside
    the network, as the semi-auto step's factor)."""

    def __init__(self, *args):
        super().__init__(*args)
        self.weights, self.eval_fed = [], []
        self.token_weight = Parameter(Tensor(1.0, ms.float32), name="sft.token_weight", requires_grad=False)

    def train(self, batch):
        from naohai.train.builder import _masked_split
        with MS_LOCK:
            _masked_split(batch, self.token_weight, MICRO)
            self.weights.append(float(self.token_weight.asnumpy()))
            for p in self.params:
                p.set_data(Tensor(p.asnumpy() + 1.0))
        self.fed.append(batch)
        return StepResult(loss=10.0 / len(self.fed), grad_norm=1.0, applied=True, loss_scale=1.0)

    def evaluate(self, batch):
        self.evals += 1
        self.eval_fed.append(batch)
        assert batch.tokens.shape[0] == self.eval_rows
        return 3.0


def _sft_folder(tok_path, root):
    """Packed SFT windows of the micro model's tokenizer, learned tokens unequal between rows."""
    from naohai.data.sft import prepare_sft
    from naohai.data.tokenizer import Tokenizer

    lines = []
    for i in range(60):
        turns = [{"role": "user", "content": f"q{i} " * (1 + i % 3)},
                 {"role": "assistant", "content": f"a{i} " * (1 + i % 5)}]
        lines.append(json.dumps({"messages": turns}))
    (root / "c.jsonl").write_text("\n".join(lines))
    prepare_sft([str(root / "c.jsonl")], Tokenizer.load(tok_path), str(root / "sft"), 32, holdout_fraction=0.2,
                seed=0, truncation="truncate")
    return str(root / "sft")


def test_sft_host_loop_weights_every_rank_by_the_global_batch(tmp_path, micro_data, monkeypatch):
    """SFT data under dp2 x mp2 x pp2: each rank feeds its data-parallel group's rows of the global batch
    (tokens and loss mask) and sets its token weight to MICRO / N with N the learned tokens of the GLOBAL
    batch (read on one rank as a reference), the same N on all 8 ranks, so the data-parallel groups'
    weighted sums add up to the global mean; the held-out batches likewise."""
    from naohai.data.sft import SFTLoader

    _, tok_path = micro_data
    sft = _sft_folder(tok_path, tmp_path)
    ms.set_context(mode=ms.PYNATIVE_MODE)
    recipe = micro_recipe(tmp_path / "run", sft, tok_path, steps=4, global_batch_size=8, micro_batch_size=1,
                          log_every=2, eval_every=2, eval_batches=1, save_every=100)
    monkeypatch.setattr(sys.modules[__name__], "StandInSteps", SFTStandInSteps)
    trainers, _ = _run_ranks(recipe, sft, max_steps=None, resume=False)

    reference = SFTLoader(sft, "train", 8, 0, 1, seed=recipe.data.shuffle_seed)
    global_batches = [reference.next_batch() for _ in range(4)]
    held = SFTLoader(sft, "valid", 8, 0, 1, seed=0, shuffle=False).next_batch()
    rows = 8 // DP
    learned = [int(np.count_nonzero(b.mask[:, 1:])) for b in global_batches]
    per_row = [b.mask[:, 1:].sum(axis=1) for b in global_batches]
    assert all(len(set(r.tolist())) > 1 for r in per_row)         # rows differ: a local count would be wrong
    for rank, tr in trainers.items():
        d = tr.runtime.dp_rank
        assert d == (rank % PER_STAGE) // (PER_STAGE // DP)
        assert len(tr.steps.fed) == 4
        for i, batch in enumerate(tr.steps.fed):
            np.testing.assert_array_equal(batch.tokens, global_batches[i].tokens[rows * d:rows * (d + 1)])
            np.testing.assert_array_equal(batch.mask, global_batches[i].mask[rows * d:rows * (d + 1)])
            assert batch.learned == learned[i]
        np.testing.assert_allclose(tr.steps.weights, [MICRO / n for n in learned], rtol=1e-6)
        for batch in tr.steps.eval_fed:                             # steps 0, 2, 4: the same held-out batch
            np.testing.assert_array_equal(batch.mask, held.mask[rows * d:rows * (d + 1)])
            assert batch.learned == int(np.count_nonzero(held.mask[:, 1:]))
    # a NLL of 1 per learned token: the groups' weighted sums (each / MICRO, as the step divides) add up to 1
    for i in range(4):
        total = sum(trainers[r].steps.weights[i] * per_row[i][rows * d:rows * (d + 1)].sum() / MICRO
                    for d, r in enumerate((0, 2)))
        assert total == pytest.approx(1.0, rel=1e-6)
