"""Each per-document filter on real text with planted defects: precision and recall against the planted truth.

The corpus is :mod:`tests.data.planted`.  Figures are printed (``pytest -s``) and
asserted against thresholds justified next to each assertion.
"""
from __future__ import annotations

import pytest

from naohai.data.clean_config import LanguageConfig, NormalizeConfig, PIIConfig, QualityConfig
from naohai.data.fasttext_models import Classifier, LanguageIdentifier, bundled_lid_model
from naohai.data.normalize import normalize
from naohai.data.pii import deidentify, id_check_char, is_id_number, luhn_ok
from naohai.data.quality import duplicate_ngram_char_fraction, quality_reason, top_ngram_char_fraction
from tests.data import planted


@pytest.fixture(scope="module")
def corpus():
    return planted.build()


def _pr(tp, fp, fn):
    precision = tp / (tp + fp) if tp + fp else 1.0
    recall = tp / (tp + fn) if tp + fn else 1.0
    return precision, recall


# --------------------------------------------------------------------------- normalisation
def test_normalize_against_unicode_tables():
    cfg = NormalizeConfig(traditional_to_simplified=True)
    # U+FF21 FULLWIDTH A -> A, U+3000 IDEOGRAPHIC SPACE -> space (NFKC, Unicode's own tables);
    # 漢語 -> 汉语 (the simplified forms of the General List of Standard Chinese Characters, 2013)
    assert normalize("ＡＢＣ１２３\u3000漢語", cfg) == "ABC123 汉语"
    # zero width space, BOM, bell, private use, U+FFFD go; tab, newline and the text stay
    assert normalize("a\u200bb\ufeffc\x07d\ue000e\ufffdf\tg\nh", cfg) == "abcdef\tg\nh"
    assert normalize("x  y \r\n\r\n\r\n\r\nz   ", cfg) == "x y\n\nz"
    assert normalize("def f():\n    return 1", cfg) == "def f():\n    return 1"   # indentation stays
    assert normalize("漢語", NormalizeConfig()) == "漢語"                               # t2s is opt-in


# --------------------------------------------------------------------------- PII
def test_check_digits_against_published_examples():
    # GB 11643-1999's example number and the check digits of the standard's formula
    assert is_id_number("11010519491231002X") and not is_id_number("110105194912310021")
    assert id_check_char("34052419800101001") == "X"
    # Luhn: the example of the Wikipedia article / ISO 7812 and the Visa test number
    assert luhn_ok("79927398713") and not luhn_ok("79927398710")
    assert luhn_ok("4111111111111111") and not luhn_ok("4111111111111112")


def test_pii_precision_and_recall(corpus):
    cfg = PIIConfig()
    placeholders = {k: getattr(cfg, k) for k in ("email", "phone", "id_number", "ip", "bank_card")}
    tp = {k: 0 for k in placeholders}
    fp = dict(tp)
    fn = dict(tp)
    for j, items in corpus.pii.items():
        out, counts = deidentify(corpus.docs[j], cfg)
        base_out, base_counts = deidentify(corpus.docs[corpus.origin[j]], cfg)
        for kind, values in items.items():
            missed = sum(1 for v in values if v in out)
            found = len(values) - missed
            tp[kind] += found
            fn[kind] += missed
            # replacements beyond the planted ones, less those already in the original document
            fp[kind] += max(0, counts.get(kind, 0) - base_counts.get(kind, 0) - found)
        for decoy in planted.DECOYS:
            if decoy in corpus.docs[j]:
                assert decoy in out, f"decoy {decoy!r} was changed"
    # the originals hold some real addresses (fortunes-zh's Linux FAQ entries: foo@www.example.com,
    # 192.168.11.1, ...); those replacements are right, so they are reported, not counted as false
    in_originals = {}
    for i, kind in enumerate(corpus.kind):
        if kind.startswith("base"):
            _, counts = deidentify(corpus.docs[i], cfg)
            for k, n in counts.items():
                in_originals[k] = in_originals.get(k, 0) + n
    for kind in placeholders:
        p, r = _pr(tp[kind], fp[kind], fn[kind])
        print(f"pii {kind}: precision {p:.3f} recall {r:.3f} (tp {tp[kind]}, fn {fn[kind]}, fp {fp[kind]}; "
              f"{in_originals.get(kind, 0)} real ones in the unplanted originals)")
        # every planted item follows the formats the module documents, so all must be found; a false
        # positive costs a little text, a miss leaks personal data: recall 1.0, precision >= 0.9
        assert r == 1.0, kind
        assert p >= 0.9, kind


# --------------------------------------------------------------------------- quality
def test_gopher_repetition_measures_by_hand():
    ws = "a b c a b c x".split()
    # most frequent 2-gram ('a','b') x2 -> 4 characters of 7
    assert top_ngram_char_fraction(ws, 2) == pytest.approx(4 / 7)
    # 3-gram 'a b c' occurs twice: words 0-2 and 3-5 are covered, 6 of 7 characters
    assert duplicate_ngram_char_fraction(ws, 3) == pytest.approx(6 / 7)
    assert duplicate_ngram_char_fraction(ws, 4) == 0.0


def test_quality_precision_and_recall(corpus):
    cfg = QualityConfig(min_words=30, min_chars=40)
    lid = LanguageIdentifier()
    tp = fn = 0
    kept = {"base-en": 0, "base-zh": 0}
    total = {"base-en": 0, "base-zh": 0}
    reasons = {}
    for text, kind in zip(corpus.docs, corpus.kind):
        if kind not in ("base-en", "base-zh", "garbage"):
            continue
        clean = normalize(text, NormalizeConfig())
        lang, _ = lid.identify(clean) if clean else ("unknown", 0.0)
        reason = quality_reason(clean, cfg, lang)
        if reason:
            reasons[reason] = reasons.get(reason, 0) + 1
        if kind == "garbage":
            tp += bool(reason)
            fn += not reason
        else:
            total[kind] += 1
            kept[kind] += not reason
    fp = sum(total.values()) - sum(kept.values())
    p, r = _pr(tp, fp, fn)
    print(f"quality: precision {p:.3f} recall {r:.3f} (tp {tp} fp {fp} fn {fn}); kept English "
          f"{kept['base-en']}/{total['base-en']}, Chinese {kept['base-zh']}/{total['base-zh']}; reasons {reasons}")
    # every planted garbage kind breaks a Gopher rule by construction -> recall 1.0.  The rules were made
    # for web prose: pydoc topics are prose with some grammar tables (we keep >= 80% of them); the
    # fortunes-zh documents are largely Debian-reference excerpts (shell commands, box-drawn tables, URLs)
    # that a prose filter is meant to drop, so only >= 40% of them are required to stay
    assert r == 1.0
    assert kept["base-en"] >= 0.8 * total["base-en"]
    assert kept["base-zh"] >= 0.4 * total["base-zh"]


def test_blocklist(tmp_path):
    path = tmp_path / "block.txt"
    path.write_text("# ads\n代开发票\n", encoding="utf-8")
    from naohai.data.quality import load_blocklist
    words = load_blocklist(str(path))
    cfg = QualityConfig(min_words=1, min_chars=1)
    assert quality_reason("专业代开发票，欢迎来电咨询我们的服务", cfg, "zh", words) == "blocklist"
    assert quality_reason("今天天气很好，我们去公园散步吧", cfg, "zh", words) is None


# --------------------------------------------------------------------------- language / classifier
def test_language_id_precision_and_recall(corpus):
    lid = LanguageIdentifier()
    cfg = LanguageConfig()
    tp = fp = fn = 0
    for text, kind in zip(corpus.docs, corpus.kind):
        if not (kind.startswith("base") or kind.startswith("foreign")):
            continue
        lang, score = lid.identify(normalize(text, NormalizeConfig()))
        dropped = lang not in cfg.keep or score < cfg.min_score
        if kind.startswith("foreign"):
            tp += dropped
            fn += not dropped
        else:
            fp += dropped
    p, r = _pr(tp, fp, fn)
    print(f"language (keep zh, en): precision {p:.3f} recall {r:.3f} (tp {tp} fp {fp} fn {fn})")
    # lid.176 is reported at ~96% on its benchmarks; on multi-sentence documents every foreign one must go.
    # Classical Chinese poems are sometimes taken for Japanese: allow 10% of the kept-language documents
    assert r == 1.0
    assert fp <= 12


def test_classifier_drops_by_label():
    # no spam model can be trained or downloaded here; lid.176 is a real supervised fastText model,
    # so use it as a classifier whose 'bad' label is German
    clf = Classifier(bundled_lid_model(), ["de"])
    assert clf.drop_probability("Das ist ein ganz normaler deutscher Satz über das Wetter.") > 0.9
    assert clf.drop_probability("This is an ordinary English sentence about the weather.") < 0.1


def test_missing_model_is_a_user_error(tmp_path):
    from naohai.errors import UserError
    with pytest.raises(UserError, match="classifier.model"):
        Classifier(str(tmp_path / "nope.bin"), ["spam"])
    bad = tmp_path / "bad.bin"
    bad.write_bytes(b"not a model")
    with pytest.raises(UserError, match="not a fastText model"):
        Classifier(str(bad), ["spam"])
