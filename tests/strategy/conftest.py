"""Helpers for strategy tests: write a strategy mapping to a temp file and load it."""
import pytest
import yaml

from naohai.strategy.schema import load_strategy


@pytest.fixture
def write_strategy(tmp_path):
    def _write(raw, name="s.yaml"):
        path = tmp_path / name
        path.write_text(yaml.safe_dump(raw))
        return str(path)
    return _write


@pytest.fixture
def load(write_strategy):
    def _load(raw):
        return load_strategy(write_strategy(raw))
    return _load
