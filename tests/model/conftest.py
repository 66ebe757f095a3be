"""Model tests run eagerly on the CPU; a fixture re-asserts the context before every test
(other test directories may switch MindSpore to graph mode)."""
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))  # model_reference


@pytest.fixture(autouse=True)
def _pynative_cpu():
    import mindspore as ms
    ms.set_device("CPU")
    ms.set_context(mode=ms.PYNATIVE_MODE)
    yield
