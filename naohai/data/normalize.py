"""Unicode normalisation of one document: NFKC, traditional -> simplified, garbage characters, whitespace.

- NFKC folds full-width ASCII (``ＡＢＣ１２３``) and the ideographic space to their
  half-width forms and compatibility characters to their canonical ones.  CJK
  punctuation such as ``，。`` has no compatibility mapping and stays.
- Traditional -> simplified Chinese uses OpenCC's ``t2s`` conversion (phrase-aware).
- Control characters (except tab, newline and carriage return), format characters (zero-width and
  direction marks, the BOM), private-use code points, unpaired surrogates, unassigned
  code points and U+FFFD are removed.
- Whitespace: ``\\r\\n`` and ``\\r`` become ``\\n``, other space characters a space, runs of
  spaces/tabs between words one space (indentation stays), spaces at line ends go,
  more than two consecutive line breaks become two, the ends are stripped.
"""
from __future__ import annotations

import re
import unicodedata

import regex

# \p{C} = control, format, private use, surrogate, unassigned; \r is kept for the whitespace step
_GARBAGE = regex.compile(r"[^\P{C}\t\n\r]|\ufffd")
_ODD_SPACES = re.compile(r"[\u00a0\u2000-\u200a\u202f\u205f\u3000]")
_INNER_RUN = re.compile(r"(?<=\S)[ \t]{2,}(?=\S)")
_LINE_END = re.compile(r"[ \t]+\n")
_BLANKS = re.compile(r"\n{3,}")
_ASCII_PRINTABLE = re.compile(r"[\n\t\x20-\x7e]*")

_converter = None


def to_simplified(text: str) -> str:
    """Traditional -> simplified Chinese with OpenCC (t2s)."""
    global _converter
    if _converter is None:
        import opencc
        _converter = opencc.OpenCC("t2s")
    return _converter.convert(text)


def remove_garbage(text: str) -> str:
    """Drop control/format/private-use/surrogate/unassigned characters and U+FFFD."""
    if _ASCII_PRINTABLE.fullmatch(text):
        return text
    return _GARBAGE.sub("", text)


def normalize_whitespace(text: str) -> str:
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    text = _ODD_SPACES.sub(" ", text)
    text = _INNER_RUN.sub(" ", text)
    text = _LINE_END.sub("\n", text)
    return _BLANKS.sub("\n\n", text).strip()


def normalize(text: str, cfg) -> str:
    """Apply the enabled parts of a :class:`~naohai.data.clean_config.NormalizeConfig`."""
    if cfg.nfkc:
        text = unicodedata.normalize("NFKC", text)
    if cfg.traditional_to_simplified:
        text = to_simplified(text)
    if cfg.remove_control:
        text = remove_garbage(text)
    if cfg.whitespace:
        text = normalize_whitespace(text)
    return text
