"""Downstream tests run on the CPU; the device is set before any kernel of a test runs (a later
``set_device`` after kernels ran is refused by MindSpore)."""
import pytest


@pytest.fixture(autouse=True)
def _cpu():
    import mindspore as ms
    ms.set_device("CPU")
    yield
