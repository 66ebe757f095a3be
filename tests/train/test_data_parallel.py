"""Data parallel over msrun on CPU, for real: 2 workers == 1 process with the same global batch."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest
import yaml

from naohai.checkpoint.store import list_checkpoints
from naohai.strategy.run_plan import plan_run
from naohai.train.job import start
from tests.conftest import MICRO_MODEL

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _recipe_file(tmp_path, name, prepared, tok, **train):
    base = dict(steps=6, global_batch_size=8, micro_batch_size=4, lr=3e-3, min_lr=3e-4, warmup_steps=2,
                log_every=1, eval_every=3, eval_batches=2, save_every=3, output_dir=str(tmp_path / name))
    base.update(train)
    recipe = {"name": name, "model": dict(MICRO_MODEL),
              "data": {"corpus": ["builtin:pydoc"], "prepared_dir": prepared, "tokenizer": tok},
              "train": base}
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(recipe), encoding="utf-8")
    return str(path)


def _strategy_file(tmp_path):
    path = tmp_path / "dp2.yaml"
    path.write_text("name: micro-dp2\nmesh: {data: 2, model: 1, pipeline: 1}\nmicro_batches: 1\n"
                    "optimizer_parallel: {enabled: false}\nrules: {batch: data}\n", encoding="utf-8")
    return str(path)


def _metrics(output_dir):
    with open(os.path.join(output_dir, "metrics.jsonl"), encoding="utf-8") as fh:
        return [json.loads(line) for line in fh]


def _launch(recipe, strategy, tmp_path, *extra):
    cmd = [sys.executable, "-m", "naohai.cli", "launch", recipe, "--strategy", strategy,
           "--master-port", str(_free_port()), "--log-dir", str(tmp_path / "logs"), *extra]
    return subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


@pytest.mark.slow
def test_two_workers_match_one_process(tmp_path, micro_data):
    prepared, tok = micro_data
    dp_recipe = _recipe_file(tmp_path, "dp", prepared, tok)
    proc = _launch(dp_recipe, _strategy_file(tmp_path), tmp_path)
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out[-3000:]

    from naohai.config import load_recipe
    single = load_recipe(_recipe_file(tmp_path, "single", prepared, tok, micro_batch_size=8))
    ref = start(plan_run(single), log=lambda *_: None, progress=False).run()

    got = _metrics(str(tmp_path / "dp"))
    train = {r["step"]: r["loss"] for r in got if r["split"] == "train"}
    valid = {r["step"]: r["loss"] for r in got if r["split"] == "valid"}
    assert sorted(train) == list(range(1, 7))
    for step, loss in train.items():
        assert abs(loss - ref.losses[step]) <= 1e-5, (step, loss, ref.losses[step])
    for step, loss in valid.items():
        assert abs(loss - ref.evals[step]) <= 1e-5, (step, loss, ref.evals[step])
    # one checkpoint set (rank 0 writes), at steps 3 and 6
    ckpts = list_checkpoints(str(tmp_path / "dp"))
    assert [os.path.basename(c) for c in ckpts] == ["step_00000003", "step_00000006"]
    assert sorted(os.listdir(ckpts[-1])) == ["manifest.json", "rank_0.ckpt", "rank_0.json"]
    # per-rank logs are gathered in the log folder
    logs = sorted(os.listdir(tmp_path / "logs"))
    assert "worker_0.log" in logs and "worker_1.log" in logs


def _rank_pids(rank: int):
    pids = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/environ", "rb") as fh:
                env = dict(item.split(b"=", 1) for item in fh.read().split(b"\0") if b"=" in item)
        except OSError:
            continue
        if env.get(b"MS_ROLE") == b"MS_WORKER" and env.get(b"RANK_ID") == str(rank).encode() \
                and env.get(b"NAOHAI_TEST_KILL") == b"1":
            pids.append(int(pid))
    return pids


@pytest.mark.slow
def test_killed_worker_fails_the_job_and_is_named(tmp_path, micro_data, monkeypatch):
    prepared, tok = micro_data
    recipe = _recipe_file(tmp_path, "kill", prepared, tok, steps=100000, eval_every=100000, save_every=100000)
    monkeypatch.setenv("NAOHAI_TEST_KILL", "1")
    proc = _launch(recipe, _strategy_file(tmp_path), tmp_path, "--node-time-out", "5")
    metrics = tmp_path / "kill" / "metrics.jsonl"
    deadline = time.time() + 300
    try:
        while time.time() < deadline and not (metrics.exists() and metrics.read_text().count('"train"') >= 2):
            time.sleep(1)
        assert metrics.exists(), "training never started"
        victims = _rank_pids(1)
        assert victims, "rank 1 worker not found"
        for pid in victims:
            os.kill(pid, signal.SIGKILL)
        killed_at = time.time()
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode != 0
    assert time.time() - killed_at < 5 + 30
    assert "rank 1" in out and "SIGKILL" in out, out[-3000:]
