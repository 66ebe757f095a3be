"""Conversion tests run eagerly on the CPU (reference_forward on the import path)."""
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))


@pytest.fixture(autouse=True)
def _pynative_cpu():
    import mindspore as ms
    ms.set_device("CPU")
    ms.set_context(mode=ms.PYNATIVE_MODE)
    yield
