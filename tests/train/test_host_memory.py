"""A run too big for this machine's CPU is refused before any data is prepared or folder written
(naohai.strategy.host_memory); the shipped CPU runs plan as fitting.  A probe found `naohai train tiny
model.hidden_size=65536 model.ffn_hidden_size=262144` prepared the data, then died building the model
(MemoryError traceback).  The machine's memory is given to the check, so the tests do not depend on the
machine they run on; nothing here imports MindSpore or trains."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from naohai import devices
from naohai.cli import main
from naohai.config import load_recipe
from naohai.errors import UserError
from naohai.strategy.host_memory import GB, check_host_memory, host_need
from naohai.strategy.run_plan import plan_run

#: the bench's 27m model (naohai.bench.models) as overrides of the tiny recipe
M27 = ["model.hidden_size=512", "model.num_layers=8", "model.num_heads=8", "model.ffn_hidden_size=1408",
       "model.seq_length=256", "train.global_batch_size=8", "train.micro_batch_size=8"]
#: peak resident set (GiB) of `naohai train tiny [M27] --max-steps 3` under /usr/bin/time, 2026-11-29 (2-core VM)
MEASURED_PEAK = {"tiny": 0.82, "27m": 1.99}
WIDE = ["model.hidden_size=65536", "model.ffn_hidden_size=262144"]
DP2 = str(Path(__file__).resolve().parents[2] / "strategies" / "tiny-dp2.yaml")


def _tiny_llama_params(h: int, f: int, layers: int = 4, vocab: int = 2048) -> int:
    """The tiny preset's parameters counted by hand (LayerNorm with bias, q/k/v/out and MLP biases, SwiGLU,
    tied embedding; 4 heads, no GQA): per layer 4h^2 + 4h (attention) + 3hf + 2f + h (MLP) + 4h (two norms)."""
    per_layer = 4 * h * h + 4 * h + 3 * h * f + 2 * f + h + 4 * h
    return layers * per_layer + vocab * h + 2 * h


@pytest.fixture
def machine(monkeypatch):
    """``machine(gib)``: this machine's MemTotal as the check reads it."""
    def set_memory(gib):
        monkeypatch.setattr(devices, "machine_memory", lambda *a, **k: None if gib is None else int(gib * GB))
    return set_memory


@pytest.mark.parametrize("overrides, key, culprit", [
    (WIDE, "model.ffn_hidden_size", "decoder layers' float32 weights"),
    (["model.seq_length=1048576"], "model.seq_length", "attention scores"),
    (["model.vocab_size=1000000000"], "model.vocab_size", "loss's float32 logits"),
])
def test_a_run_too_big_for_the_machine_is_refused_before_data_or_folder(machine, tmp_path, capsys, overrides, key,
                                                                         culprit):
    machine(64)
    out, data = tmp_path / "run", tmp_path / "prepared"
    code = main(["train", "tiny", *overrides, "--device", "CPU", "--output-dir", str(out),
                 f"data.prepared_dir={data}"])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err, err
    assert f"key '{key}'" in err and culprit in err and "the machine has 64.0 GB (MemTotal)" in err, err
    for override in overrides:               # the keys that size it, with their values
        assert override.replace("=", " ") in err, err
    assert not out.exists() and not data.exists()


def test_the_refusal_states_the_weights_as_counted_by_hand(machine, capsys):
    """The figure the message gives for hidden 65536 / FFN 262144 is 16 bytes (float32 weight, gradient, Adam
    m and v) per parameter counted by hand, within 1%."""
    machine(64)
    with pytest.raises(UserError) as e:
        check_host_memory(plan_run(load_recipe("tiny", WIDE)))
    stated = float(re.search(r"Adam moments ([\d,.]+) GB", str(e.value)).group(1).replace(",", ""))
    by_hand = 16 * _tiny_llama_params(65536, 262144) / GB
    assert abs(stated - by_hand) / by_hand < 0.01, (stated, by_hand)
    assert e.value.rule == "the planned bytes of the run's processes on this machine <= its MemTotal"


@pytest.mark.parametrize("name, overrides", [("tiny", []), ("27m", M27)])
def test_the_shipped_cpu_runs_plan_as_fitting_below_their_measured_peak(machine, name, overrides):
    """The lower bound the check compares stays below the peak these runs were measured at (so a machine
    that ran them is never told they cannot fit), and they pass the check on a 2 GiB machine."""
    need = host_need(plan_run(load_recipe("tiny", overrides)))
    assert need.floor / GB < MEASURED_PEAK[name]
    assert need.states <= need.floor <= need.estimate
    assert check_host_memory(plan_run(load_recipe("tiny", overrides)), total=2 * GB) is not None
    machine(2)
    assert check_host_memory(plan_run(load_recipe("tiny", overrides))).floor == need.floor


def test_launch_counts_every_cpu_worker_on_the_node(machine, tmp_path, capsys):
    """Two data-parallel CPU workers hold two copies: a run that fits once but not twice is refused by
    `naohai launch` before its folder is taken (one process of it is let through)."""
    overrides = ["model.hidden_size=4096", "model.num_heads=32", "model.ffn_hidden_size=11008",
                 "model.num_layers=2", "train.micro_batch_size=8"]
    run = plan_run(load_recipe("tiny", overrides), DP2)
    one, two = host_need(run, 1).floor, host_need(run, 2).floor
    assert two == pytest.approx(2 * one)
    gib = (one + two) / 2 / GB
    assert check_host_memory(run, 1, total=int(gib * GB)) is not None
    machine(gib)
    out = tmp_path / "run"
    code = main(["launch", "tiny", *overrides, "--strategy", DP2, "--device", "CPU",
                 f"train.output_dir={out}"])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err and "(2 processes)" in err, err
    assert not out.exists()


def test_the_device_is_asked_only_of_a_run_that_does_not_fit(machine):
    """A run that fits never asks (so `naohai train` takes its folder before MindSpore is imported); a run
    that does not fit on a GPU or Ascend is not refused for the host's memory; unreadable memory: no check."""
    def never():
        raise AssertionError("asked")
    assert check_host_memory(plan_run(load_recipe("tiny")), on_cpu=never, total=2 * GB) is not None
    wide = plan_run(load_recipe("tiny", WIDE))
    assert check_host_memory(wide, on_cpu=lambda: False, total=64 * int(GB)).floor > 64 * GB
    machine(None)
    assert check_host_memory(wide) is None


def test_machine_memory_reads_memtotal(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemFree:  1000 kB\nMemTotal:       24576000 kB\nMemAvailable: 2000 kB\n")
    assert devices.machine_memory(str(meminfo)) == 24576000 * 1024
    meminfo.write_text("MemTotal: lots\n")
    assert devices.machine_memory(str(meminfo)) is None
    assert devices.machine_memory(str(tmp_path / "absent")) is None


def test_runs_on_cpu_without_mindspore(monkeypatch):
    monkeypatch.setattr(devices, "_runtime_present", lambda device: False)
    monkeypatch.setattr(devices, "resolve_device", lambda *a, **k: pytest.fail("MindSpore was asked"))
    assert devices.runs_on_cpu("CPU") and devices.runs_on_cpu("auto") and devices.runs_on_cpu(None)
    assert not devices.runs_on_cpu("GPU") and not devices.runs_on_cpu("Ascend")
    monkeypatch.setattr(devices, "_runtime_present", lambda device: device == "GPU")
    monkeypatch.setattr(devices, "resolve_device", lambda requested, **k: "GPU")
    assert not devices.runs_on_cpu("auto")
