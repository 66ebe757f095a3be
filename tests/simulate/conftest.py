"""Registers the ``slow`` marker used by the multi-process simulate tests."""


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: multi-process msrun test (still runs in CI)")
