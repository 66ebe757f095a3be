"""MindSpore 2.10 traps on the pipeline + optimizer-parallel path, pinned by compiling them.

naohai's own pipeline step (``AccumulatedGrads`` in naohai/strategy/gradients.py) avoids both: it
uses no PipelineGradReducer; it reads the ``accu_grads`` buffers MindSpore's pipeline pass
fills and, with optimizer parallel, the returned reduce-scattered gradients while clearing
the buffers (as MindFormers' ``MFPipelineWithLossScaleCell`` does).  If a MindSpore upgrade
fixes a trap, its test here fails and the workaround can be revisited.  Both cases run on 4 simulated
ranks (data 2 x pipeline 2) with the toy tied-embedding pipeline of targets.py.
"""
import pytest

from naohai.simulate.harness import run_compile

TARGET = "tests.simulate.targets:tied_pipeline"
SMALL = {"dp": 2, "mp": 1, "stages": 2, "micro": 4, "batch": 8}


@pytest.mark.slow
def test_pipeline_grad_reducer_opt_shard_false_is_a_name_error(tmp_path):
    rep = run_compile(TARGET, 4, tmp_path, timeout=600, sys_path=[_root()],
                      kwargs=dict(SMALL, reducer="opt_shard_false", hsdp=False))
    assert not rep.ok and rep.failed_ranks == [0, 1, 2, 3]
    err = rep.rank(0).error
    assert err["type"] == "NameError" and "grads" in err["message"], err


@pytest.mark.slow
def test_accumulation_buffers_with_optimizer_sharding_mismatch_shapes(tmp_path):
    rep = run_compile(TARGET, 4, tmp_path, timeout=600, sys_path=[_root()],
                      kwargs=dict(SMALL, reducer="opt_shard_true", hsdp=True))
    assert not rep.ok
    messages = " ".join(str(rep.rank(r).error) for r in rep.failed_ranks)
    assert "AssignAdd" in messages and "must have the same shape" in messages, messages


def _root():
    import os
    return os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
