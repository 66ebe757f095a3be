"""Rule-based quality filters for one document (Gopher-style, plus Chinese rules and a blocklist).

:func:`quality_reason` returns ``None`` for a document to keep, or the name of the
first rule it breaks.  The rules and default thresholds are those of Gopher's
MassiveWeb filter (Rae et al. 2021, appendix A.1.1 "quality filters" and "repetition
removal").  Words are whitespace-separated runs, except in Chinese documents
(identified as ``zh``, or with CJK characters in at least half their words), whose
words come from jieba, so word counts and repeated n-grams mean the same there.
Rules that only make sense for Latin-script text (mean word length, stop words) are
not applied to Chinese documents; ``zh_min_cjk_ratio`` (CJK characters among
CJK characters and Latin letters) applies only to them.
"""
from __future__ import annotations

import re
from collections import Counter
from typing import Dict, List, Optional, Sequence

_WORD = re.compile(r"[\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff]|[^\s\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff]+")
_CJK = re.compile(r"[\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff]")
_SPACE = re.compile(r"\s")
_LATIN = re.compile(r"[A-Za-z]")
_WORDLIKE = re.compile(r"[^\W_]")
_DIGIT = re.compile(r"\d")
_ALPHA = re.compile(r"[^\W\d_]")
_GARBAGE = re.compile(r"[\ufffd\ue000-\uf8ff]")
_BULLETS = ("•", "●", "○", "■", "□", "▪", "▫", "◆", "◇", "-", "*", "·", "‣", "⁃", "➢", "►")
_ELLIPSES = ("...", "…", "。。。")
STOP_WORDS = frozenset(("the", "be", "to", "of", "and", "that", "have", "with"))


def words(text: str) -> List[str]:
    return _WORD.findall(text)


def load_segmenter() -> None:
    """Load jieba's dictionary now (it loads on first use otherwise): in a process that forks workers, once."""
    import jieba
    jieba.setLogLevel(60)
    jieba.initialize()


def chinese_words(text: str) -> List[str]:
    """jieba's words (the segmenter the tokenizer's PanGu mode uses) that hold a letter or digit."""
    import jieba
    jieba.setLogLevel(60)
    return [w for w in jieba.lcut(text) if _WORDLIKE.search(w)]


def _dup_fraction(items: Sequence[str]):
    """(fraction of items that repeat an earlier one, fraction of their characters)."""
    seen = set()
    dup_n = dup_chars = total_chars = 0
    for it in items:
        total_chars += len(it)
        if it in seen:
            dup_n += 1
            dup_chars += len(it)
        else:
            seen.add(it)
    if not items:
        return 0.0, 0.0
    return dup_n / len(items), (dup_chars / total_chars if total_chars else 0.0)


def top_ngram_char_fraction(ws: Sequence[str], n: int) -> float:
    """Characters in the most frequent word n-gram (counted once per occurrence) / characters in all words."""
    if len(ws) < n:
        return 0.0
    grams = Counter(tuple(ws[i:i + n]) for i in range(len(ws) - n + 1))
    gram, count = grams.most_common(1)[0]
    if count < 2:
        return 0.0
    total = sum(len(w) for w in ws)
    return sum(len(w) for w in gram) * count / total if total else 0.0


def duplicate_ngram_char_fraction(ws: Sequence[str], n: int) -> float:
    """Characters of words inside any n-gram that occurs more than once / characters in all words."""
    if len(ws) < n:
        return 0.0
    first: Dict[tuple, int] = {}
    covered = [False] * len(ws)
    for i in range(len(ws) - n + 1):
        g = tuple(ws[i:i + n])
        if g in first:
            j = first[g]
            for k in range(n):
                covered[i + k] = True
                covered[j + k] = True
        else:
            first[g] = i
    total = sum(len(w) for w in ws)
    return sum(len(w) for w, c in zip(ws, covered) if c) / total if total else 0.0


def load_blocklist(path: Optional[str]) -> List[str]:
    if not path:
        return []
    from naohai.errors import UserError
    try:
        with open(path, "r", encoding="utf-8") as fh:
            return [line.strip().lower() for line in fh if line.strip() and not line.startswith("#")]
    except OSError as exc:
        raise UserError(f"cannot be read: {exc.strerror}", where=path, key="quality.blocklist") from None
    except UnicodeDecodeError:
        raise UserError("is not UTF-8 text", where=path, key="quality.blocklist") from None


def quality_reason(text: str, cfg, language: Optional[str] = None, blocklist: Sequence[str] = ()) -> Optional[str]:
    """The first rule of a :class:`~naohai.data.clean_config.QualityConfig` that ``text`` breaks, or None."""
    n_chars = len(text)
    if n_chars < cfg.min_chars:
        return "min_chars"
    if n_chars > cfg.max_chars:
        return "max_chars"
    ws = words(text)
    cjk_doc = len(_CJK.findall(text)) >= 0.5 * len(ws) if ws else False
    if language == "zh" or cjk_doc:
        ws = chinese_words(text)
    if len(ws) < cfg.min_words:
        return "min_words"
    if len(ws) > cfg.max_words:
        return "max_words"
    non_space = (n_chars - len(_SPACE.findall(text))) or 1
    n_cjk = len(_CJK.findall(text))
    if len(_GARBAGE.findall(text)) / non_space > cfg.max_garbage_ratio:
        return "max_garbage_ratio"
    if len(_DIGIT.findall(text)) / non_space > cfg.max_digit_ratio:
        return "max_digit_ratio"
    chinese = language == "zh" or cjk_doc
    latin = [w for w in ws if not _CJK.match(w)]
    if not chinese and latin:
        mean = sum(len(w) for w in latin) / len(latin)
        if not cfg.min_mean_word_length <= mean <= cfg.max_mean_word_length:
            return "mean_word_length"
        if sum(1 for w in ws if _ALPHA.search(w)) / len(ws) < cfg.min_alpha_words:
            return "min_alpha_words"
        if language in (None, "en") and sum(1 for w in ws if w.lower() in STOP_WORDS) < cfg.min_stop_words:
            return "min_stop_words"
    if language == "zh" and n_cjk / ((n_cjk + len(_LATIN.findall(text))) or 1) < cfg.zh_min_cjk_ratio:
        return "zh_min_cjk_ratio"
    symbols = text.count("#") + sum(text.count(e) for e in _ELLIPSES)
    if symbols / len(ws) > cfg.max_symbol_word_ratio:
        return "max_symbol_word_ratio"
    lines = [ln.strip() for ln in text.split("\n") if ln.strip()]
    if lines:
        if sum(ln.startswith(_BULLETS) for ln in lines) / len(lines) > cfg.max_bullet_lines:
            return "max_bullet_lines"
        if sum(ln.endswith(_ELLIPSES) for ln in lines) / len(lines) > cfg.max_ellipsis_lines:
            return "max_ellipsis_lines"
        frac, chars = _dup_fraction(lines)
        if frac > cfg.max_duplicate_lines:
            return "max_duplicate_lines"
        if chars > cfg.max_duplicate_line_chars:
            return "max_duplicate_line_chars"
    paragraphs = [p.strip() for p in re.split(r"\n\s*\n", text) if p.strip()]
    frac, chars = _dup_fraction(paragraphs)
    if frac > cfg.max_duplicate_paragraphs:
        return "max_duplicate_paragraphs"
    if chars > cfg.max_duplicate_paragraph_chars:
        return "max_duplicate_paragraph_chars"
    for n, limit in sorted(cfg.max_top_ngram_chars.items()):
        if top_ngram_char_fraction(ws, n) > limit:
            return f"top_{n}gram_chars"
    # words inside a repeated (n+1)-gram are inside repeated n-grams too, so the fraction falls with n:
    # once it is under every remaining limit, larger n cannot fail
    dup = sorted(cfg.max_duplicate_ngram_chars.items())
    for i, (n, limit) in enumerate(dup):
        frac = duplicate_ngram_char_fraction(ws, n)
        if frac > limit:
            return f"duplicate_{n}gram_chars"
        if frac <= min(lim for _, lim in dup[i:]):
            break
    if blocklist:
        low = text.lower()
        if sum(low.count(b) for b in blocklist) > cfg.max_blocklist_hits:
            return "blocklist"
    return None
