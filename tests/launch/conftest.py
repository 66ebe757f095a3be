"""Shared fixtures for the launch tests; registers the `slow` marker."""
import pytest


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: multi-process test (still run in CI)")
