"""train.cpu_affinity: MindSpore's thread binding on the process's cores, once per process, on CPU only."""
from __future__ import annotations

import os
from pathlib import Path

import mindspore as ms
import pytest

from naohai.config import load_recipe
from naohai.errors import UserError
from naohai.train import job

TINY = str(Path(__file__).resolve().parents[2] / "recipes/tiny.yaml")


def test_set_context_binds_main_and_runtime_on_the_process_cores_once(monkeypatch, tmp_path):
    calls = []

    def record(enable, affinity_cpu_list=None, module_to_cpu_dict=None, bind_file=None):
        calls.append((enable, affinity_cpu_list, module_to_cpu_dict, bind_file))

    monkeypatch.setattr(ms.runtime, "set_cpu_affinity", record)
    monkeypatch.setitem(job._BOUND, "done", False)
    recipe = load_recipe(TINY, [f"train.output_dir={tmp_path}"])
    assert recipe.train.cpu_affinity is True
    job.set_context(recipe, "CPU")
    job.set_context(recipe, "CPU")                    # a second build in the same process: bound already
    cores = sorted(os.sched_getaffinity(0))
    assert calls == [(True, None, {"main": cores, "runtime": cores}, None)]

    calls.clear()
    monkeypatch.setitem(job._BOUND, "done", False)
    job.set_context(load_recipe(TINY, [f"train.output_dir={tmp_path}", "train.cpu_affinity=false"]), "CPU")
    assert calls == []

    def refuse(*args, **kwargs):
        raise RuntimeError("The 'mindspore.runtime.set_cpu_affinity' cannot be set repeatedly.")

    monkeypatch.setattr(ms.runtime, "set_cpu_affinity", refuse)
    job.set_context(recipe, "CPU")                    # bound by someone else (msrun's bind file): left as it is
    assert job._BOUND["done"]


def test_a_value_that_is_not_a_boolean_is_refused_naming_the_key():
    with pytest.raises(UserError) as e:
        load_recipe(TINY, ["train.cpu_affinity=sometimes"])
    assert "train.cpu_affinity" in str(e.value) and "must be true or false" in str(e.value)
