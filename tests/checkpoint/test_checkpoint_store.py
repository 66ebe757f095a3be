"""Checkpoints that survive damage: the corruption matrix, a save that fails part-way, `naohai ckpt`,
and a non-finite loss injected into a step."""
from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import mindspore as ms

from naohai.checkpoint import store
from naohai.cli import main
from naohai.model.stack import per_layer_names
from naohai.strategy.run_plan import plan_run
from naohai.train.adam_all import AdamWeightDecayAll
from naohai.train.callbacks import Callback
from naohai.train.job import start
from tests.conftest import micro_recipe

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def trained(tmp_path_factory, micro_data):
    """A micro run with checkpoints at steps 4 and 8."""
    prepared, tok = micro_data
    out = tmp_path_factory.mktemp("trained") / "run"
    recipe = micro_recipe(out, prepared, tok, steps=8, save_every=4)
    start(plan_run(recipe), log=lambda *_: None, progress=False).run()
    return out, recipe


def _flip_byte(path):
    data = bytearray(Path(path).read_bytes())
    data[len(data) // 2] ^= 0x01
    Path(path).write_bytes(bytes(data))


def _truncate(path):
    data = Path(path).read_bytes()
    Path(path).write_bytes(data[: len(data) // 3])


def _other_recipe(ckpt):
    man = json.loads((Path(ckpt) / store.MANIFEST).read_text())
    man["recipe"]["model"]["hidden_size"] = 64
    (Path(ckpt) / store.MANIFEST).write_text(json.dumps(man))


def _drop_rank_from_manifest(ckpt):
    man = json.loads((Path(ckpt) / store.MANIFEST).read_text())
    del man["files"]["rank_0.ckpt"]
    (Path(ckpt) / store.MANIFEST).write_text(json.dumps(man))


DAMAGE = {
    "truncated file": (lambda c: _truncate(Path(c) / "rank_0.ckpt"), "truncated"),
    "flipped byte": (lambda c: _flip_byte(Path(c) / "rank_0.ckpt"), "SHA-256"),
    "missing manifest": (lambda c: (Path(c) / store.MANIFEST).unlink(), None),
    "missing rank file": (lambda c: (Path(c) / "rank_0.ckpt").unlink(), "missing"),
    "rank absent from the manifest": (_drop_rank_from_manifest, "a rank missing"),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_damaged_latest_checkpoint_is_reported_and_the_previous_used(trained, tmp_path, damage):
    out, recipe = trained
    run = tmp_path / "run"
    shutil.copytree(out, run)
    latest = store.step_dir(str(run), 8)
    hurt, reason = DAMAGE[damage]
    hurt(latest)
    lines = []
    recipe = micro_recipe(run, recipe.data.prepared_dir, recipe.data.tokenizer, steps=8, save_every=4)
    trainer = start(plan_run(recipe), log=lines.append, progress=False)
    assert trainer.resume()
    assert trainer.step == 4, lines
    if reason is None:   # no manifest: the folder is not a published checkpoint at all
        assert store.list_checkpoints(str(run))[-1] == store.step_dir(str(run), 4)
    else:
        skipped = [ln for ln in lines if ln.startswith("skipping checkpoint") and "step_00000008" in ln]
        assert skipped and reason in skipped[0], lines
    # `naohai ckpt verify` (integrity: files against the manifest) fails it too and passes the good one
    if reason is not None:
        assert main(["ckpt", "verify", latest]) == 2
    assert main(["ckpt", "verify", store.step_dir(str(run), 4)]) == 0


def test_resume_from_a_chosen_checkpoint_and_refusing_a_bad_one(trained, tmp_path, capsys):
    out, recipe = trained
    run = tmp_path / "run"
    shutil.copytree(out, run)
    recipe = micro_recipe(run, recipe.data.prepared_dir, recipe.data.tokenizer, steps=8, save_every=4)
    trainer = start(plan_run(recipe), log=lambda *_: None, progress=False)
    assert trainer.resume(store.step_dir(str(run), 4)) and trainer.step == 4
    _flip_byte(Path(store.step_dir(str(run), 4)) / "rank_0.ckpt")
    code = main(["train", str(_write_recipe(tmp_path, recipe)), "--resume-from", store.step_dir(str(run), 4)])
    err = " ".join(capsys.readouterr().err.split())
    assert code == 2 and "--resume-from" in err and "SHA-256" in err and "Traceback" not in err


def _write_recipe(tmp_path, recipe):
    from naohai.config import write_recipe
    return write_recipe(recipe, str(tmp_path / "recipe.yaml"))


FAILING_SAVE = r"""
import resource, signal, sys
sys.path.insert(0, {root!r})
from tests.conftest import micro_recipe
from naohai.strategy.run_plan import plan_run
from naohai.train.callbacks import Callback
from naohai.train.job import start

class LimitFileSize(Callback):
    # after step 4 is saved, any file over 16 KB fails to grow (EFBIG, not a signal)
    def on_step_begin(self, trainer):
        if trainer.step == 5:
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
            resource.setrlimit(resource.RLIMIT_FSIZE, (16 * 1024, resource.RLIM_INFINITY))

recipe = micro_recipe({out!r}, {prepared!r}, {tok!r}, steps=8, save_every=4, log_every=100)
res = start(plan_run(recipe), log=print, progress=False, callbacks=[LimitFileSize()]).run()
print("finished", res.steps_done)
"""


def test_save_that_fails_part_way_keeps_the_previous_checkpoint(tmp_path, micro_data):
    prepared, tok = micro_data
    out = tmp_path / "run"
    script = FAILING_SAVE.format(root=str(ROOT), out=str(out), prepared=str(prepared), tok=str(tok))
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600, cwd=ROOT)
    warning = [ln for ln in res.stdout.splitlines() if "checkpoint at step 8 FAILED" in ln]
    assert warning and "step_00000004 is intact" in warning[0], res.stdout[-2000:]
    # the last step's checkpoint is lost: the run does not look successful, and says what to resume from
    assert res.returncode != 0 and "finished 8" not in res.stdout
    assert "FinalSaveFailed" in res.stderr and "newest good checkpoint is step 4" in res.stderr, res.stderr[-2000:]
    assert store.list_checkpoints(str(out)) == [store.step_dir(str(out), 4)]
    assert store.verify(store.step_dir(str(out), 4)).ok
    assert not os.path.exists(store.step_dir(str(out), 8))


class PoisonOnce(Callback):
    """Sets one weight to +inf before step ``at`` and puts the original back after it."""

    def __init__(self, at):
        self.at, self.saved, self.after = at, None, None

    @staticmethod
    def _param(trainer):
        """Layer 0's query weight, in either form of the model (its slice 0 under the layer loop)."""
        cfg = trainer.built.model.cfg
        return next(p for p in trainer.built.model.get_parameters()
                    if per_layer_names(cfg, p.name)[0] == "layers.0.attention.q_weight")

    def on_step_begin(self, trainer):
        if trainer.step + 1 == self.at:
            p = self._param(trainer)
            self.saved = p.asnumpy().copy()
            poisoned = self.saved.copy()
            poisoned[(0,) * poisoned.ndim] = np.inf
            ms.ops.assign(p, ms.Tensor(poisoned))      # in place: see naohai/model/stack.py

    def on_step(self, trainer, rec):
        if rec["step"] == self.at:
            p = self._param(trainer)
            self.after = p.asnumpy().copy()
            ms.ops.assign(p, ms.Tensor(self.saved))


@pytest.mark.parametrize("reductions", ["mindspore", "fused"])
def test_non_finite_loss_is_skipped_logged_and_training_continues(tmp_path, micro_data, reductions):
    """Also with train.cpu_reductions: fused, whose one AdamW kernel takes the skip decision itself (no branch in
    the graph): the skipped step moves no weight, moment or step counter."""
    prepared, tok = micro_data
    lines = []
    poison = PoisonOnce(at=3)
    recipe = micro_recipe(tmp_path / "run", prepared, tok, steps=6, save_every=100, log_every=1)
    recipe.train.cpu_reductions = reductions
    trainer = start(plan_run(recipe), log=lines.append, progress=False, callbacks=[poison])
    opt = trainer.built.optimizer
    assert isinstance(opt, AdamWeightDecayAll) == (reductions == "fused")
    states = {}

    class Moments(Callback):
        def on_step(self, trainer, rec):
            states[rec["step"]] = ([m.asnumpy().copy() for m in list(opt.moments1) + list(opt.moments2)],
                                   int(opt.global_step.asnumpy()[0]))

    trainer.callbacks.members.append(Moments())
    before = {p.name: p.asnumpy().copy() for p in trainer.built.model.get_parameters()}
    res = trainer.run()
    assert res.skipped == [3]
    assert states[3][1] == states[2][1] == 2 and states[6][1] == 5
    assert all(np.array_equal(a, b) for a, b in zip(states[2][0], states[3][0]))
    assert not all(np.array_equal(a, b) for a, b in zip(states[3][0], states[4][0]))
    assert not math.isfinite(res.losses[3]) and all(math.isfinite(res.losses[s]) for s in (1, 2, 4, 5, 6))
    assert any("step      3 | SKIPPED (non-finite gradient norm)" in ln for ln in lines), lines
    # the skipped step changed nothing but the poisoned entry (the update was not applied)
    corner = (0,) * poison.after.ndim
    assert np.isinf(poison.after[corner])
    after_q = poison.after.copy()
    after_q[corner] = poison.saved[corner]
    np.testing.assert_array_equal(after_q, poison.saved)
    assert res.steps_done == 6 and any(not np.array_equal(before[p.name], p.asnumpy())
                                       for p in trainer.built.model.get_parameters())


def test_ckpt_inspect_merge_export(trained, tmp_path, capsys):
    out, recipe = trained
    ckpt = store.step_dir(str(out), 8)
    assert main(["ckpt", "inspect", str(out)]) == 0
    text = capsys.readouterr().out
    assert "step 8" in text and "rank_0.ckpt" in text and "layers.0.attention.q_weight" in text
    # by default the model's tensors, in the model's order; the optimizer state only with --state
    listed = [line.split()[0] for line in text.splitlines() if line.startswith("    ") and "[" in line]
    assert listed[0] == "embedding.word_embedding" and not any(n.startswith(("adam_", "guard.")) for n in listed)
    assert "optimizer / training state tensors" in text
    assert main(["ckpt", "inspect", str(out), "--state", "--tensors", "0"]) == 0
    listed = [line.split()[0] for line in capsys.readouterr().out.splitlines() if line.startswith("    ")]
    assert "adam_m.embedding.word_embedding" in listed and "global_step" in listed
    assert listed.index("head.final_norm.gamma") < listed.index("adam_m.embedding.word_embedding")
    # merging a full checkpoint gives the same tensors under a new, verified manifest
    assert main(["ckpt", "merge", ckpt, "--out", str(tmp_path / "merged")]) == 0
    assert store.verify(str(tmp_path / "merged")).ok
    a = ms.load_checkpoint(os.path.join(ckpt, "rank_0.ckpt"))
    b = ms.load_checkpoint(str(tmp_path / "merged" / "rank_0.ckpt"))
    assert set(a) == set(b) and all(np.array_equal(a[k].asnumpy(), b[k].asnumpy()) for k in a)
    # export: the model's tensors, read back with MindSpore's safetensors loader
    assert main(["ckpt", "export", ckpt, "--format", "safetensors", "--out", str(tmp_path / "m.safetensors")]) == 0
    exported = ms.load_checkpoint(str(tmp_path / "m.safetensors"), format="safetensors")
    model_names = {k for k in a if not k.startswith(("adam_", "guard.", "beta", "global_step"))}
    assert set(exported) == model_names
    for k in model_names:
        np.testing.assert_array_equal(exported[k].asnumpy(), a[k].asnumpy())
    # nothing already written is overwritten
    assert main(["ckpt", "merge", ckpt, "--out", str(tmp_path / "merged")]) == 2
    # resharding to a data-parallel layout keeps full tensors: --compiled is not read, and the command says so
    capsys.readouterr()
    assert main(["ckpt", "reshard", ckpt, "train.micro_batch_size=2", "--to", str(ROOT / "strategies" / "tiny-dp2.yaml"),
                 "--compiled", str(tmp_path / "no-such-compile"), "--out", str(tmp_path / "dp2")]) == 0
    err = capsys.readouterr().err
    assert "--compiled" in err and "is not read" in err, err
    c = ms.load_checkpoint(str(tmp_path / "dp2" / "rank_0.ckpt"))
    assert all(np.array_equal(a[k].asnumpy(), c[k].asnumpy()) for k in model_names)


class PoisonFrom(Callback):
    """From step ``at`` on, one weight is +inf before every step: every update is skipped."""

    def __init__(self, at):
        self.at = at

    def on_step_begin(self, trainer):
        if trainer.step + 1 >= self.at:
            p = PoisonOnce._param(trainer)
            value = p.asnumpy().copy()
            value[(0,) * value.ndim] = np.inf
            ms.ops.assign(p, ms.Tensor(value))


def test_too_many_skipped_steps_stop_the_run_after_a_checkpoint(tmp_path, micro_data, capsys):
    prepared, tok = micro_data
    recipe = micro_recipe(tmp_path / "run", prepared, tok, steps=20, save_every=100, log_every=1,
                          max_skipped_steps=3)
    from naohai.train.loop import TrainingStopped
    trainer = start(plan_run(recipe), log=lambda *_: None, progress=False, callbacks=[PoisonFrom(4)])
    with pytest.raises(TrainingStopped) as info:
        trainer.run()
    message = " ".join(str(info.value).split())
    assert "3 updates in a row were skipped" in message and "weights are those of step 3" in message
    assert info.value.exit_code == 3 and "train.max_skipped_steps" in message
    [ckpt] = store.list_checkpoints(str(tmp_path / "run"))
    assert store.read_manifest(ckpt)["step"] == 6 and store.verify(ckpt).ok


def test_retention_keeps_the_last_k_and_every_m_th(tmp_path):
    params = [ms.Parameter(ms.Tensor(np.ones((2, 2), np.float32)), name="w")]
    s = store.CheckpointStore(str(tmp_path), keep_last=2, keep_every=4)
    for step in range(1, 11):
        assert s.save(step, params, {"layout": {"ranks_with_files": [0]}}).path
    kept = [store.read_manifest(c)["step"] for c in store.list_checkpoints(str(tmp_path))]
    assert kept == [4, 8, 9, 10]


def test_async_save_gives_the_same_checkpoints_and_exact_resume(tmp_path, micro_data):
    """train.async_save: files written in the background, published at the next save / the end;
    the checkpoints hold the same tensors as synchronous saves and resume exactly."""
    prepared, tok = micro_data
    sync = start(plan_run(micro_recipe(tmp_path / "sync", prepared, tok, steps=8, save_every=2)),
                 log=lambda *_: None, progress=False).run()
    lines = []
    part = micro_recipe(tmp_path / "async", prepared, tok, steps=8, save_every=2, async_save=True, keep_checkpoints=10)
    first = start(plan_run(part), log=lines.append, progress=False, max_steps=5).run()
    assert first.steps_done == 5
    steps = [store.read_manifest(c)["step"] for c in store.list_checkpoints(str(tmp_path / "async"))]
    assert steps == [2, 4, 5]                      # 2 and 4 published in the background, 5 at the end
    assert any("checkpoint published" in ln and "step_00000002" in ln for ln in lines)
    for step in (2, 4):
        a = ms.load_checkpoint(os.path.join(store.step_dir(str(tmp_path / "async"), step), "rank_0.ckpt"))
        b = ms.load_checkpoint(os.path.join(store.step_dir(str(tmp_path / "sync"), step), "rank_0.ckpt")) \
            if os.path.exists(store.step_dir(str(tmp_path / "sync"), step)) else None
        if b is not None:
            assert set(a) == set(b) and all(np.array_equal(a[k].asnumpy(), b[k].asnumpy()) for k in a)
    trainer = start(plan_run(part), log=lambda *_: None, progress=False)
    assert trainer.resume() and trainer.step == 5
    second = trainer.run()
    for step in range(6, 9):
        assert second.losses[step] == sync.losses[step], step


def test_a_checkpoint_from_before_a_model_key_existed_is_the_same_model():
    """Keys added to ModelConfig later (rope_scaling and its factors, 2026-11-30) are missing from earlier
    manifests; compared as missing they made every earlier checkpoint 'another model' after an upgrade, so a
    run could not resume.  A missing key is its default (what the code that wrote it computed)."""
    from naohai.checkpoint.store import identity_difference
    from naohai.config import preset_recipe
    now = preset_recipe("tiny").to_dict()["model"]
    before = {k: v for k, v in now.items() if not k.startswith("rope_") or k in ("rope_base", "rope_style")}
    assert len(before) < len(now)
    assert identity_difference({"recipe": {"model": before}}, {"model": now}) == []
    scaled = dict(now, rope_scaling="linear", rope_factor=4.0)
    assert identity_difference({"recipe": {"model": before}}, {"model": scaled}) == [
        "model.rope_factor: 1.0 in the checkpoint, 4.0 now", "model.rope_scaling: 'none' in the checkpoint, 'linear' now"]
