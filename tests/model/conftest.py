"""Model tests run eagerly on the CPU; a fixture re-asserts the context before every test
(other test directories may switch MindSpore to graph mode)."""
import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))  # model_reference


def _warm_up_pynative():
    """MindSpore 2.10's extension is built against NumPy 1.x; with NumPy 2 installed, the very first
    PyNative op taking a tuple argument (Reshape, ...) raises SystemError ("Numpy init failed") and
    every later call works.  Absorb that one failure here, once per process."""
    from mindspore import Tensor, ops
    x = Tensor(np.ones((2, 2), np.float32))
    try:
        ops.reshape(x, (4,))
    except SystemError:
        pass
    assert ops.reshape(x, (4,)).shape == (4,)


@pytest.fixture(autouse=True)
def _pynative_cpu():
    import mindspore as ms
    ms.set_device("CPU")
    ms.set_context(mode=ms.PYNATIVE_MODE)
    _warm_up_pynative()
    yield
