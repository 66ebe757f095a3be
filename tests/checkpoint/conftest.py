"""A checkpoint of the micro model (2 steps, saved at step 2) that the checkpoint tests read and copy."""
from __future__ import annotations

from pathlib import Path

import pytest

from naohai.checkpoint import store
from naohai.strategy.run_plan import plan_run
from naohai.train.job import start
from tests.conftest import micro_recipe


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory, micro_data):
    prepared, tok = micro_data
    out = tmp_path_factory.mktemp("micro_ckpt") / "run"
    start(plan_run(micro_recipe(out, prepared, tok, steps=2, save_every=2, eval_every=2, eval_batches=1)),
          log=lambda *_: None, progress=False).run()
    return Path(store.step_dir(str(out), 2))
