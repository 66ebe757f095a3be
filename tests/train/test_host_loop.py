"""The host side of a semi-auto run, exercised on CPU: the real Trainer, checkpoint store and
callbacks on 8 simulated ranks (threads) of a data 2 x model 2 x pipeline 2 layout, each with a
stand-in for its compiled step (a sharded step cannot execute on CPU).

What is checked against independent references: which rows each rank feeds (the loader
reading the whole global batch on one rank, sliced by data-parallel index, and MindSpore's
device-matrix rule ``dp = (rank % per_stage) // (per_stage // dp)``), that only rank 0 logs
and writes metrics, the eval and checkpoint cadence of the recipe, one parameter file per
rank in every checkpoint, and that a resumed run continues at the same data position with
each rank's own slices restored.
"""
from __future__ import annotations

import json
import shutil
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
from naohai.train.callbacks import ConsoleLog, MetricsFiles, Throughput
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


def _run_ranks(recipe, prepared, max_steps, resume):
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
                                            ConsoleLog(log), MetricsFiles(t.output_dir)], max_steps=max_steps)

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
