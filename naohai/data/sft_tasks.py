"""A small built-in instruction set whose answers a rule checks: ``builtin:sft-tasks``.

Each conversation is one instruction over two to four words drawn from the embedded pydoc corpus
(the most frequent lower-case words of 3-8 letters, so the tiny model's tokenizer knows them) and
its answer, computed by :func:`answer`:

* ``Reverse: w1 w2 w3``  ->  ``Reversed: w3 w2 w1``
* ``Repeat: w1 w2 w3``   ->  ``Repeated: w1 w2 w3``
* ``Last word: w1 w2 w3`` -> ``Last: w3``
* ``First word: w1 w2 w3`` -> ``First: w1``

The answer opens with a fixed word so that its words, like the prompt's, follow a space: naohai's
template encodes the answer as a segment of its own, and a word at a segment's start is other
tokens (``standard`` is ``st`` + ``andard`` in the tiny tokenizer, `` standard`` one token).

Every prompt is distinct, so the held-out split (``data.holdout_fraction``, chosen by conversation)
holds instructions the run never trains on.  The shipped file ``builtin/sft_tasks.jsonl`` is written
by ``python run/make_sft_tasks.py`` (:func:`make_tasks`); its words depend on the Python version's
pydoc text, its answers on :func:`answer` only (``tests/data/test_sft_tasks.py`` checks every line).
"""
from __future__ import annotations

import collections
import os
import re
from typing import Dict, List

import numpy as np

NAME = "builtin:sft-tasks"
FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "builtin", "sft_tasks.jsonl")

_RULES = {
    "Reverse": lambda words: "Reversed: " + " ".join(reversed(words)),
    "Repeat": lambda words: "Repeated: " + " ".join(words),
    "Last word": lambda words: "Last: " + words[-1],
    "First word": lambda words: "First: " + words[0],
}


def answer(prompt: str) -> str:
    """The answer to ``prompt`` (``<Task>: w1 w2 ...``) by the task's rule; ``ValueError`` for another text."""
    task, sep, rest = prompt.partition(": ")
    if not sep or task not in _RULES or not rest.split():
        raise ValueError(f"not an instruction of {NAME}: {prompt!r}")
    return _RULES[task](rest.split())


def pydoc_words(count: int = 200) -> List[str]:
    """The ``count`` most frequent lower-case words of 3-8 letters in the pydoc topics."""
    from naohai.data.corpus import pydoc_documents
    counts = collections.Counter()
    for doc in pydoc_documents():
        counts.update(re.findall(r"(?<![\w.])([a-z]{3,8})(?![\w.])", doc))
    return [w for w, _ in counts.most_common(count)]


def make_tasks(words: List[str], n: int = 4000, seed: int = 0) -> List[Dict[str, str]]:
    """``n`` distinct instructions over ``words`` (tasks in turn, 2-4 distinct words each), with answers."""
    rng = np.random.default_rng(seed)
    tasks = list(_RULES)
    seen, out = set(), []
    while len(out) < n:
        task = tasks[len(out) % len(tasks)]
        picked = [words[i] for i in rng.choice(len(words), size=int(rng.integers(2, 5)), replace=False)]
        prompt = f"{task}: {' '.join(picked)}"
        if prompt in seen:
            continue
        seen.add(prompt)
        out.append({"prompt": prompt, "response": answer(prompt)})
    return out
