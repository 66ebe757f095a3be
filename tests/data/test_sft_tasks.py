"""builtin:sft-tasks: every shipped instruction's answer is its rule's, on hand-made examples too; the
prompts are distinct (held-out instructions are unseen); the recipe source names the shipped file."""
import json

import pytest

from naohai.data import sft_tasks
from naohai.data.sft import expand_paths


def test_rules_on_hand_examples():
    assert sft_tasks.answer("Reverse: alpha beta gamma") == "Reversed: gamma beta alpha"
    assert sft_tasks.answer("Repeat: alpha beta") == "Repeated: alpha beta"
    assert sft_tasks.answer("Last word: alpha beta gamma delta") == "Last: delta"
    assert sft_tasks.answer("First word: alpha beta") == "First: alpha"
    for bad in ("Sort: b a", "Reverse:", "Reverse alpha beta"):
        with pytest.raises(ValueError):
            sft_tasks.answer(bad)


def test_shipped_file_answers_by_the_rules_and_distinct_prompts():
    rows = [json.loads(line) for line in open(sft_tasks.FILE, encoding="utf-8")]
    assert len(rows) == 4000
    assert len({r["prompt"] for r in rows}) == len(rows)
    kinds = {}
    for r in rows:
        task, _, words = r["prompt"].partition(": ")
        kinds[task] = kinds.get(task, 0) + 1
        w = words.split()
        assert 2 <= len(w) <= 4 and len(set(w)) == len(w)
        assert r["response"] == {"Reverse": "Reversed: " + " ".join(w[::-1]), "Repeat": "Repeated: " + " ".join(w),
                                 "Last word": "Last: " + w[-1], "First word": "First: " + w[0]}[task]
    assert kinds == {"Reverse": 1000, "Repeat": 1000, "Last word": 1000, "First word": 1000}
    assert expand_paths(["builtin:sft-tasks"]) == [sft_tasks.FILE]


def test_make_tasks_is_deterministic_and_uses_the_words():
    words = ["aa", "bb", "cc", "dd", "ee"]
    one, two = sft_tasks.make_tasks(words, 40, seed=3), sft_tasks.make_tasks(words, 40, seed=3)
    assert one == two and len({r["prompt"] for r in one}) == 40
    assert all(set(r["prompt"].split(": ")[1].split()) <= set(words) for r in one)
