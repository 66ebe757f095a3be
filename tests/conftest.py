"""Shared fixtures: the CPU device named once per worker, a small prepared corpus and recipes built on it,
the session's simulated-device compiles (``compiled_layout``); how the tests are split between the two workers of the README's test command
(pytest-xdist) and the lock that keeps two 8-rank compiles from running at once."""
from __future__ import annotations

import contextlib
import fcntl
import os

import pytest


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: multi-process (msrun) test; still runs in CI")
    config.addinivalue_line("markers", "xdist_group(name): pytest-xdist runs the group's tests in one worker")


#: the group of the tests that share ``compiled_layout``'s compiles (one worker holds them all)
COMPILED_GROUP = "compiled-layouts"
#: groups that start first under pytest-xdist: the longest units (20-30 and 16 minutes alone on 2 cores)
FIRST = (COMPILED_GROUP, "tests/test_readme.py")


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """For ``pytest -n 2 --dist loadgroup`` (the README's test command): a test module is one unit of
    work (its module fixtures are built once), except the tests that use ``compiled_layout``, which are
    one unit together (its session cache then compiles each layout once); the two longest units go
    first, so that the workers end together.  Without pytest-xdist the marks do nothing.

    ``tryfirst``: pytest-xdist's worker reads the marks in its own hook of this name (it appends the group to
    each test's id, which is what keeps a group on one worker), and plugins registered after this file run
    first; without it the marks came too late and every test was a unit of its own (both workers compiled the
    same layouts and built the same module fixtures)."""
    for item in items:
        group = COMPILED_GROUP if "compiled_layout" in getattr(item, "fixturenames", ()) else \
            item.nodeid.split("::", 1)[0]
        item.add_marker(pytest.mark.xdist_group(group))
    rank = {name: i for i, name in enumerate(FIRST)}
    items.sort(key=lambda item: rank.get(item.get_closest_marker("xdist_group").args[0], len(rank)))


@contextlib.contextmanager
def simulated_compile_slot(tmp_path_factory):
    """Held while an 8-rank simulated-device compile runs (about 8-10 GB): under pytest-xdist the other
    worker waits for its own, so two never run at once.  A lock file in the folder the workers' temporary
    folders share."""
    root = tmp_path_factory.getbasetemp()
    root = root.parent if root.name.startswith("popen-gw") else root
    with open(root / "simulated-compile.lock", "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


@pytest.fixture(scope="session")
def compile_slot(tmp_path_factory):
    """``with compile_slot(): ...`` around a command that compiles on 8 simulated devices."""
    return lambda: simulated_compile_slot(tmp_path_factory)


@pytest.fixture(scope="session", autouse=True)
def _cpu_device():
    """MindSpore runs tests in-process on the CPU, and it refuses ``set_device`` once any kernel has run in
    the process (``RuntimeError: The runtime has been initialized``).  Which modules share a pytest-xdist
    worker changes from run to run, so a test whose first kernel runs without naming the device (an
    ``astype`` in tests/test_ckpt_format.py) broke every later ``set_device`` of its worker: 40
    failures and 155 errors in one CI run.  Naming the device once per worker, before any test, removes
    that dependence on order.  Commands that set it again with the same device are unaffected."""
    import mindspore as ms
    ms.set_device("CPU")
    yield


@pytest.fixture(scope="session", autouse=True)
def _own_cache_dir(tmp_path_factory):
    """The tests' per-machine cache (the CPU matmul peak) is theirs, not the user's ~/.cache/naohai."""
    os.environ["NAOHAI_CACHE_DIR"] = str(tmp_path_factory.mktemp("naohai_cache"))
    yield

from naohai.config import recipe_from_dict

MICRO_MODEL = dict(preset="tiny", vocab_size=320, vocab_pad_multiple=64, hidden_size=32, num_layers=2,
                   num_heads=4, ffn_hidden_size=64, seq_length=32)


def micro_recipe(output_dir, prepared_dir=None, tokenizer=None, **train):
    base = dict(steps=8, global_batch_size=4, micro_batch_size=4, lr=3e-3, min_lr=3e-4, warmup_steps=2,
                log_every=2, eval_every=4, eval_batches=2, save_every=4, output_dir=str(output_dir))
    base.update(train)
    data = {"corpus": ["builtin:pydoc"], "holdout_fraction": 0.05}
    if prepared_dir:
        data["prepared_dir"] = str(prepared_dir)
    if tokenizer:
        data["tokenizer"] = str(tokenizer)
    return recipe_from_dict({"name": "micro", "model": dict(MICRO_MODEL), "data": data, "train": base},
                            where="test recipe")


def folder_locked(folder) -> bool:
    """Whether someone holds ``folder``'s run lock: a new open file of it cannot take the flock (this
    process's own hold counts too: a flock belongs to the open file, not to the process)."""
    fd = os.open(os.path.join(str(folder), ".naohai.lock"), os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)


@pytest.fixture(scope="session")
def micro_data(tmp_path_factory):
    """(prepared_dir, tokenizer_path) for the micro model, prepared once per test session."""
    from naohai.data.pipeline import ensure_prepared

    root = tmp_path_factory.mktemp("micro_data")
    recipe = micro_recipe(root)
    prepared, tok = ensure_prepared(recipe, progress=False)
    return prepared, os.path.join(str(root), "tokenizer.model")


@pytest.fixture(scope="session")
def compiled_layout(tmp_path_factory, compile_slot):
    """``get(argv) -> (exit code, workdir, stdout)`` of ``naohai check ARGV --compile --save-slices``,
    compiled once per test session (the compile tests and the resharding tests share them).

    A run where some rank's worker left no verdict at all (killed from outside, e.g. by the
    out-of-memory killer of a loaded CI machine, or hung past the timeout) is run once more; the first
    run's failure stays at the top of the returned output.  A compile error is never retried."""
    import io
    import json

    cache = {}

    def run(argv):
        from naohai.cli import main
        workdir = tmp_path_factory.mktemp("compiled")
        out = io.StringIO()
        with compile_slot(), contextlib.redirect_stdout(out):
            rc = main(["check", *argv, "--compile", "--save-slices", "--workdir", str(workdir),
                       "--timeout", "600"])
        summary = workdir / "summary.json"
        lost = rc != 0 and summary.exists() and any(
            r["result"] is None for r in json.loads(summary.read_text())["per_rank"])
        return rc, workdir, out.getvalue(), lost

    def get(argv):
        key = tuple(argv)
        if key not in cache:
            rc, workdir, out, lost = run(argv)
            if lost:
                first = "\n".join(line for line in out.splitlines() if "no result.json" in line)
                rc, workdir, out, _ = run(argv)
                out = f"(first run lost a rank, run again: {first})\n" + out
            cache[key] = (rc, workdir, out)
        return cache[key]
    return get
