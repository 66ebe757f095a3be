"""User-facing errors.

Everything a user can get wrong (recipes, strategy files, data files, CLI flags,
environment variables) raises :class:`UserError`.  The CLI prints its message as
one paragraph and exits with code 2, without a traceback.  Internal bugs are
ordinary exceptions and keep their tracebacks.
"""
from __future__ import annotations

import difflib
from typing import Iterable, Optional


class UserError(Exception):
    """A mistake in user input.  ``where`` names the file, ``key`` the key path."""

    exit_code = 2

    def __init__(self, message: str, *, where: Optional[str] = None, key: Optional[str] = None,
                 rule: Optional[str] = None):
        self.where = where
        self.key = key
        self.rule = rule
        self.message = message
        super().__init__(self.render())

    def render(self) -> str:
        head = []
        if self.where:
            head.append(str(self.where))
        if self.key:
            head.append(f"key '{self.key}'")
        prefix = ": ".join(head)
        text = f"{prefix}: {self.message}" if prefix else self.message
        if self.rule:
            text += f" (rule: {self.rule})"
        return text


def did_you_mean(name: str, choices: Iterable[str], n: int = 3) -> str:
    """Return ' Did you mean: a, b?' for the closest choices, or ''."""
    choices = [str(c) for c in choices]
    close = difflib.get_close_matches(str(name), choices, n=n, cutoff=0.5)
    if close:
        return " Did you mean: " + ", ".join(repr(c) for c in close) + "?"
    return ""
