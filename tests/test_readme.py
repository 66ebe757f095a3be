"""Every command in README.md's ```bash blocks, run on a fresh clone in a temporary folder, in order.

A command runs as the README writes it (continuation lines joined, the trailing comment dropped,
``a && b`` as its parts, an ``[optional]`` argument left out) with the clone's code first on the path (``PYTHONPATH`` and a ``naohai``
on ``PATH`` that runs ``python -m naohai.cli``), and must exit 0; a few outputs are checked as well (:data:`CHECKS`: the
2-worker launch prints fewer than 30 lines, eval's JSON, the overlay plot, generate's headers, the
upload list of submit's dry run).  The few the README itself says
cannot run here are listed in :data:`NOT_RUN` with the reason; the inputs the README says are the
user's own (raw documents, a second cleaned source, a MindFormers YAML) are made by
:data:`USER_FILES` just before the command that reads them.  Every rule must match a command, so a
README edit that drops or rewrites one is noticed here.  A command that fails as written today is in
:data:`KNOWN_FAILING` and must keep failing (so its fix also removes it from the list).
"""
from __future__ import annotations

import contextlib
import gzip
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

#: commands not run, by a regular expression on the command, and why
NOT_RUN = {
    r"^pip install ": "installs into the environment these tests run in; the clone is imported through "
                     "PYTHONPATH instead (CI's .ci/run installs the checkout first)",
    r"^apt-get ": "system packages: CI's .ci/run installs them before the tests",
    r"^python -m pytest -q -n 2 --dist loadgroup --no-loadscope-reorder tests$": "the test suite this test is part of",
    r"^naohai ckpt import pangu\.ckpt ": "needs the published PanGu-alpha checkpoint (not downloadable here; "
                                         "tests/convert/ imports synthetic files in its layout)",
    r"^naohai ckpt export pangu26 ": "exports what the import above would have made",
    r"^naohai bench --out runs/bench$": "the 25-minute benchmark (its parts are tested in tests/bench/)",
    r"^naohai check pengcheng-mind-200b strategies/naohai-200b-3456p\.yaml --compile --ranks first,last$":
        "two ranks of the real 3,456-card layout at their real depth: about 5 minutes and 5.8 GB by the "
        "README's figures, too long for every CI run (tests/simulate/test_rank_of_n.py runs the same path "
        "on smaller layouts, rank 37 of 64 included)",
}

#: commands that fail as the README writes them today, by expression, and how: they are run and must
#: still fail, so the line that fixes one also removes it from here (strict, like an xfail)
KNOWN_FAILING: dict = {}   # none today (the `naohai lm-eval --model ...` line was mended in f1fd4f6)


def _pydoc_documents():
    from pydoc_data.topics import topics
    return [text for _, text in sorted(topics.items()) if len(text.split()) > 80]


def _raw_documents(clone):
    """The user's raw web documents (`raw/*.jsonl.gz`) and a second source cleaned into clean/books."""
    docs = _pydoc_documents()                    # 69 of CPython's pydoc topics: two thirds web, one third books
    web, books = [d for i, d in enumerate(docs) if i % 3], docs[::3]
    os.makedirs(os.path.join(clone, "raw"), exist_ok=True)
    for part in range(2):
        with gzip.open(os.path.join(clone, "raw", f"web-{part}.jsonl.gz"), "wt", encoding="utf-8") as fh:
            for text in web[part::2]:
                fh.write(json.dumps({"text": text}) + "\n")
    os.makedirs(os.path.join(clone, "raw_books"), exist_ok=True)
    with open(os.path.join(clone, "raw_books", "books.jsonl"), "w", encoding="utf-8") as fh:
        for text in books:
            fh.write(json.dumps({"text": text}) + "\n")
    return [["naohai", "data", "clean", "raw_books/books.jsonl", "--out", "clean/books"]]


def _hf_llama_folder(clone):
    """A Hugging Face Llama folder (config.json, safetensors, tokenizer.json): the tiny random one the HF
    tests build with transformers (tests/convert/hf_models.py)."""
    sys.path.insert(0, os.path.join(clone, "tests", "convert"))
    try:
        import hf_models
        hf_models.build("llama", os.path.join(clone, "path", "to", "Llama-folder"))
    finally:
        sys.path.pop(0)
    return []


def _mindformers_yaml(clone):
    shutil.copy(os.path.join(clone, "tests", "strategy", "fixtures_mindformers.yaml"),
                os.path.join(clone, "their_config.yaml"))
    return []


#: files the README presumes the user has, made before the first command matching the expression
#: (a maker may return commands to run as well, e.g. to clean the second source)
USER_FILES = {
    r"^naohai data clean raw/\*\.jsonl\.gz ": _raw_documents,
    r"^naohai plan --import-mindformers their_config\.yaml ": _mindformers_yaml,
    r"^naohai ckpt import path/to/Llama-folder --from hf ": _hf_llama_folder,
}


def _quiet_launch(out: str, clone: str) -> str:
    lines = out.splitlines()
    if len(lines) >= 30:
        return f"a 2-worker launch printed {len(lines)} lines (fewer than 30 expected)"
    if not any(line.startswith("[rank 0] done:") for line in lines):
        return "no '[rank 0] done:' line"
    if not os.path.isfile(os.path.join(clone, "runs", "tiny-dp2", "msrun_logs", "worker_1.log")):
        return "no runs/tiny-dp2/msrun_logs/worker_1.log"
    return ""


def _json_loss(out: str, clone: str) -> str:
    try:
        result = json.loads(out.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return "the last line is not JSON"
    return "" if result.get("loss", 0) > 0 and result.get("tokens", 0) > 0 else f"unexpected result {result}"


#: what a command's output must show besides exit 0 (a message, or '' when it is right), by expression
CHECKS = {
    r"^naohai launch tiny --strategy strategies/tiny-dp2\.yaml ": _quiet_launch,
    r"^naohai eval runs/tiny --text held_out\.txt --json$": _json_loss,
    r"^naohai plot runs/tiny runs/tiny-lr ": lambda out, clone: "" if os.path.getsize(
        os.path.join(clone, "runs", "tiny-vs-lr.png")) > 10_000 else "no runs/tiny-vs-lr.png",
    r"^naohai generate runs/tiny --prompt \"a\" --prompt \"b\"": lambda out, clone: "" if "=== prompt 2 of 2: 'b' ===" in out
    else "no header for the second prompt",
    r"^naohai generate runs/sft-tiny --chat ": lambda out, clone: "" if out.startswith("Repeated: ")
    else "the fine-tuned run did not answer in its trained form ('Repeated: ...')",
    r"^printf .* \| naohai generate runs/sft-tiny --chat ": lambda out, clone: "" if [
        line.split(":")[0] for line in out.splitlines() if line.startswith(("Reversed:", "Repeated:"))] == [
        "Reversed", "Repeated"] and "started over" in out else "the conversation did not answer its two turns in turn",
    r"^naohai submit ": lambda out, clone: "" if "files that would be uploaded:\n  .ci/run (" in out
    else "no list of files to upload",
}


def _strip_comment(line: str) -> str:
    """``line`` without a ``#`` comment outside quotes."""
    quote = None
    for i, ch in enumerate(line):
        if quote:
            if ch == quote:
                quote = None
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i].rstrip()
    return line.rstrip()


def readme_commands(text: str):
    """The commands of the ```bash blocks, in order."""
    commands = []
    for block in re.findall(r"^```bash\n(.*?)^```", text, flags=re.S | re.M):
        pending = ""
        for raw in block.splitlines():
            line = _strip_comment(raw) if not raw.rstrip().endswith("\\") else raw.rstrip()
            if line.endswith("\\"):
                pending += line[:-1].strip() + " "
                continue
            line = re.sub(r"\s+\[[^\]]*\](?=\s|$)", "", pending + line.strip()).strip()   # [optional] parts
            pending = ""
            if not line:
                continue
            commands.extend(part.strip() for part in line.split("&&"))
    return commands


def test_readme_commands_parse():
    """The parser itself: continuations, comments, `&&`, quotes."""
    text = ("intro\n```bash\n# a comment\npip install -e . && naohai train tiny   # train\n"
            "naohai generate r --prompt \"a # b\"  # c\nnaohai x \\\n    --y 1 [--z 2]  # z\n```\n"
            "```python\nnot = 'run'\n```\n")
    assert readme_commands(text) == ["pip install -e .", "naohai train tiny", 'naohai generate r --prompt "a # b"',
                                     "naohai x --y 1"]


def _fresh_clone(dest: str) -> str:
    """A clone of this checkout's HEAD (a copy of the tree where this is no git checkout)."""
    inside = subprocess.run(["git", "-C", ROOT, "rev-parse", "--show-toplevel"], capture_output=True, text=True)
    if inside.returncode == 0 and os.path.realpath(inside.stdout.strip()) == os.path.realpath(ROOT):
        subprocess.run(["git", "clone", "--quiet", "--no-hardlinks", ROOT, dest], check=True)
    else:
        shutil.copytree(ROOT, dest, ignore=shutil.ignore_patterns("runs", ".git", "__pycache__", "*.egg-info"))
    return dest


@pytest.mark.slow
def test_every_readme_command_runs_on_a_fresh_clone(tmp_path, compile_slot):
    clone = _fresh_clone(str(tmp_path / "naohai"))
    with open(os.path.join(clone, "README.md"), encoding="utf-8") as fh:
        commands = readme_commands(fh.read())
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    shim = bin_dir / "naohai"
    shim.write_text(f"#!/bin/sh\nexec {shlex.quote(sys.executable)} -m naohai.cli \"$@\"\n")
    shim.chmod(0o755)
    env = dict(os.environ, PYTHONPATH=clone, PATH=f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}",
               PYTHONUNBUFFERED="1")
    used_not_run, used_files = set(), set()
    failures, timings = [], []

    used_checks, used_known = set(), set()

    def run(command: str) -> None:
        t0 = time.monotonic()
        # a simulated-device compile waits for the other test worker's (pytest -n 2: memory)
        with compile_slot() if " --compile" in command else contextlib.nullcontext():
            res = subprocess.run(["bash", "-c", command], cwd=clone, env=env, capture_output=True, text=True,
                                 timeout=1800)
        timings.append((time.monotonic() - t0, command))
        known = [pat for pat in KNOWN_FAILING if re.search(pat, command)]
        if known:
            used_known.update(known)
            if res.returncode == 0:
                failures.append(f"$ {command}\nnow exits 0: remove it from KNOWN_FAILING in tests/test_readme.py")
            return
        if res.returncode != 0:
            failures.append(f"$ {command}\nexit {res.returncode}\n{(res.stdout + res.stderr)[-3000:]}")
            return
        for pat, check in CHECKS.items():
            if re.search(pat, command):
                used_checks.add(pat)
                wrong = check(res.stdout + res.stderr, clone)
                if wrong:
                    failures.append(f"$ {command}\n{wrong}\n{(res.stdout + res.stderr)[-3000:]}")

    for command in commands:
        skip = [pat for pat in NOT_RUN if re.search(pat, command)]
        if skip:
            used_not_run.update(skip)
            continue
        for pat, make in USER_FILES.items():
            if pat not in used_files and re.search(pat, command):
                used_files.add(pat)
                for extra in make(clone):
                    run(shlex.join(extra))
        run(command)
    for seconds, command in sorted(timings, reverse=True)[:8]:
        print(f"{seconds:7.1f} s  {command}")
    assert not failures, "\n\n".join(failures)
    assert used_not_run == set(NOT_RUN), f"NOT_RUN rules that match no README command: {set(NOT_RUN) - used_not_run}"
    assert used_files == set(USER_FILES), f"USER_FILES rules that match no command: {set(USER_FILES) - used_files}"
    assert used_checks == set(CHECKS), f"CHECKS that match no command: {set(CHECKS) - used_checks}"
    assert used_known == set(KNOWN_FAILING), f"KNOWN_FAILING that match no command: {set(KNOWN_FAILING) - used_known}"
    assert len(timings) >= 25, [c for _, c in timings]
