"""Makes the shipped downstream tasks' data (``naohai/downstream/shipped/*.jsonl``) from the embedded corpora.

    python run/make_eval_tasks.py [--n 200] [--seed 0]

Deterministic for a given seed and corpus.  Four tasks (the YAML files beside the data say how
lm-eval reads them):

* ``naohai_pydoc_cont``: 30 words of a pydoc passage; choose its true next 8 words among 4 (3
  distractors: 8 words from a random place of another topic).
* ``naohai_fortunes_zh_cont``: the same over fortunes-zh entries (Debian's ``fortunes-zh``), by
  characters (20-60 of context, a 12-40 character continuation).
* ``naohai_chid_idiom``: CHID-style idiom cloze: a fortunes-zh passage up to a four-character idiom
  (jieba's dictionary tags idioms ``i``), choose the idiom among 7 (6 other idioms of the corpus).
* ``naohai_pydoc_word``: generate_until: a pydoc passage cut before a word; generate the next word
  (30 words of context; exact match, stop at a space or line end).

The passages come from the corpora naohai's recipes train on (``builtin:pydoc``, ``builtin:fortunes-zh``),
so the tasks measure how well a model has learnt that text, not generalisation.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import re
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(os.path.dirname(HERE), "naohai", "downstream", "shipped")


def _sentences(text: str):
    text = re.sub(r"\s+", " ", text).strip()
    return [s for s in re.split(r"(?<=[.!?])\s+(?=[A-Z])", text) if s]


def pydoc_cont(rng, n):
    from naohai.data.corpus import pydoc_documents
    docs = [re.sub(r"\s+", " ", d).strip().split(" ") for d in pydoc_documents()]
    docs = [d for d in docs if len(d) >= 60]
    cuts = []
    for i, words in enumerate(docs):
        for k in range(30, len(words) - 8, 83):
            cuts.append((i, " ".join(words[k - 30:k]), " ".join(words[k:k + 8])))
    rng.shuffle(cuts)
    out = []
    for i, ctx, cont in cuts[:n]:
        others = []
        while len(others) < 3:
            j = rng.randrange(len(docs))
            if j == i:
                continue
            k = rng.randrange(0, len(docs[j]) - 8)
            others.append(" ".join(docs[j][k:k + 8]))
        choices = others + [cont]
        rng.shuffle(choices)
        out.append({"context": ctx, "choices": choices, "label": choices.index(cont)})
    return out


def _zh_docs():
    from naohai.data.corpus import fortunes_documents
    docs = []
    for d in fortunes_documents():
        d = re.sub(r"\s+", "", d)
        if len(d) >= 60:
            docs.append(d)
    return docs


def fortunes_cont(rng, n):
    docs = _zh_docs()
    rng.shuffle(docs)
    pieces = []
    for d in docs:
        cut = rng.randint(20, min(60, len(d) - 12))
        pieces.append((d[max(0, cut - 60):cut], d[cut:cut + rng.randint(12, 40)]))
    out = []
    for i, (ctx, cont) in enumerate(pieces):
        others = []
        for j in rng.sample(range(len(pieces)), 10):
            if j != i and pieces[j][1] != cont:
                others.append(pieces[j][1][:len(cont)])
            if len(others) == 3:
                break
        choices = others + [cont]
        rng.shuffle(choices)
        out.append({"context": ctx, "choices": choices, "label": choices.index(cont)})
        if len(out) == n:
            break
    return out


def chid_idiom(rng, n):
    import jieba
    path = os.path.join(os.path.dirname(jieba.__file__), "dict.txt")
    with open(path, encoding="utf-8") as fh:
        idioms = {w for w, _, tag in (line.split() for line in fh if line.count(" ") == 2)
                  if tag == "i" and len(w) == 4}
    found = []
    for d in _zh_docs():
        for k in range(20, len(d) - 3):
            w = d[k:k + 4]
            if w in idioms:
                found.append((d[max(0, k - 60):k], w))
                break
    rng.shuffle(found)
    seen = sorted({w for _, w in found})
    out = []
    for ctx, w in found[:n]:
        others = [x for x in rng.sample(seen, 12) if x != w][:6]
        choices = others + [w]
        rng.shuffle(choices)
        out.append({"context": ctx, "choices": choices, "label": choices.index(w)})
    return out


def pydoc_word(rng, n):
    from naohai.data.corpus import pydoc_documents
    docs = [re.sub(r"\s+", " ", d).strip() for d in pydoc_documents()]
    rng.shuffle(docs)
    cuts = []
    for d in docs:
        words = d.split(" ")
        for k in range(30, len(words), 97):
            if re.fullmatch(r"[A-Za-z]+", words[k]):
                cuts.append({"context": " ".join(words[k - 30:k]), "answer": words[k]})
    rng.shuffle(cuts)
    return cuts[:n]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    sys.path.insert(0, os.path.dirname(HERE))
    makers = {"naohai_pydoc_cont": pydoc_cont, "naohai_fortunes_zh_cont": fortunes_cont,
              "naohai_chid_idiom": chid_idiom, "naohai_pydoc_word": pydoc_word}
    for name, make in makers.items():
        rows = make(random.Random(f"{args.seed}-{name}"), args.n)
        path = os.path.join(OUT, name + ".jsonl")
        with open(path, "w", encoding="utf-8") as fh:
            for row in rows:
                fh.write(json.dumps(row, ensure_ascii=False) + "\n")
        print(f"{path}: {len(rows)} examples")
    return 0


if __name__ == "__main__":
    sys.exit(main())
