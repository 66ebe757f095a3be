"""The tokenizer: training a sentencepiece BPE model and exact encode/decode.

Ids (fixed for every tokenizer this module trains)::

    0 <pad>   padding
    1 <eod>   end of document (sentencepiece's eos); documents are joined with it
    2 <unk>   unknown (never produced: byte fallback covers every character)
    3 <s>     beginning of sequence (available, not inserted by the data pipeline)
    4 <naohai-text-v1> or <naohai-text-v1-jieba>   format marker (control symbol)
    5 "\\n"   newline, a user-defined symbol (always one token)
    6..261    byte-fallback pieces <0x00>..<0xFF>
    262..     learned BPE merges

The format marker inside the ``.model`` file records how text is mapped before
sentencepiece sees it, so a single file fully describes the tokenizer.

Exact round trip.  Sentencepiece runs with no normalisation (``identity``), no
dummy prefix, no whitespace squashing and byte fallback, which keeps every
character except one: a literal ``\\u2581`` ("▁", sentencepiece's space symbol)
would come back as a space.  Before encoding, text is therefore escaped with
``ESC = \\u2584`` ("▄"): ``▁ -> ESC _`` and ``ESC -> ESC ESC``.

PanGu-style jieba mode.  Text is cut into words with jieba, spaces inside the
text become ``\\u2582`` ("▂", as in PanGu-alpha), and the words are joined with
single spaces, which sentencepiece then treats as word boundaries.  A literal
``▂`` is escaped as ``ESC 2``.  Decoding drops the boundary spaces and maps ``▂``
back to a space.  (PanGu also mapped newlines to ``\\u2583``; here a newline is its
own user-defined piece instead, so it needs no marker.)

PanGu-alpha's ``vocab.model`` (scheme ``pangu``, detected by its ``<eod>``, ``<eot>``
and ``<pad>`` pieces and no naohai marker) is used the way the reference's
``JIEBATokenizer`` uses it (mindspore-ai/models official/nlp/Pangu_alpha/
src/tokenization_jieba.py): jieba cuts the text, each word has ``" " -> \u2582`` and
``"\n" -> \u2583``, the words are joined with spaces and sentencepiece encodes that
with the model's own normalisation; decoding drops spaces and maps ``\u2582`` / ``\u2583``
back.  EOD and pad are the ids of the ``<eod>`` and ``<pad>`` pieces, as there.  The
round trip is the reference's, not exact (e.g. a literal ``\u2582`` comes back as a space).

Other models without a naohai format marker (e.g. downloaded ones) are used "raw":
plain sentencepiece encode/decode, with no exactness promise.
"""
from __future__ import annotations

import hashlib
import io
import logging
import os
import re
import random
from collections import Counter
from typing import Iterable, List, Optional, Sequence

import sentencepiece as spm

from naohai.errors import UserError
from naohai.runfiles import write_bytes_atomically

PAD_ID, EOD_ID, UNK_ID, BOS_ID = 0, 1, 2, 3
MARKER_PLAIN = "<naohai-text-v1>"
MARKER_JIEBA = "<naohai-text-v1-jieba>"
NEWLINE = "\n"
ESC = "\u2584"
SP_SPACE = "\u2581"
JIEBA_SPACE = "\u2582"
JIEBA_NEWLINE = "\u2583"          # PanGu-alpha's newline marker (scheme "pangu" only)
PANGU_PIECES = ("<eod>", "<eot>", "<pad>")   # the pieces the reference JIEBATokenizer looks up
# pieces every trained model holds besides merges: 4 specials, marker, newline, 256 bytes
RESERVED_PIECES = 4 + 1 + 1 + 256
_MAX_LINE_CHARS = 8000      # training sentences are cut to this length (<= 32 KB UTF-8)


# --------------------------------------------------------------------------- text mapping
def _escape(text: str, jieba_mode: bool) -> str:
    if ESC in text:
        text = text.replace(ESC, ESC + ESC)
    if SP_SPACE in text:
        text = text.replace(SP_SPACE, ESC + "_")
    if jieba_mode and JIEBA_SPACE in text:
        text = text.replace(JIEBA_SPACE, ESC + "2")
    return text


_jieba_ready = False


def _jieba_cut(text: str) -> List[str]:
    global _jieba_ready
    import jieba
    if not _jieba_ready:
        jieba.setLogLevel(logging.WARNING)
        _jieba_ready = True
    return list(jieba.cut(text, cut_all=False, HMM=True))


def to_pieces_text(text: str, jieba_mode: bool) -> str:
    """The string handed to sentencepiece for ``text``."""
    if not jieba_mode:
        return _escape(text, False)
    words = []
    for word in _jieba_cut(text):
        word = _escape(word, True)
        if " " in word:
            word = word.replace(" ", JIEBA_SPACE)
        words.append(word)
    return " ".join(words)


def from_pieces_text(text: str, jieba_mode: bool) -> str:
    """Invert :func:`to_pieces_text` on sentencepiece's decoded string (lenient on junk)."""
    if ESC not in text:
        if jieba_mode:
            return text.replace(" ", "").replace(JIEBA_SPACE, " ")
        return text
    out = []
    i, n = 0, len(text)
    codes = {ESC: ESC, "_": SP_SPACE}
    if jieba_mode:
        codes["2"] = JIEBA_SPACE
    while i < n:
        ch = text[i]
        if ch == ESC and i + 1 < n and text[i + 1] in codes:
            out.append(codes[text[i + 1]])
            i += 2
            continue
        if jieba_mode and ch == " ":
            pass
        elif jieba_mode and ch == JIEBA_SPACE:
            out.append(" ")
        else:
            out.append(ch)
        i += 1
    return "".join(out)


_PANGU_TRANSLATE = str.maketrans(" \n", JIEBA_SPACE + JIEBA_NEWLINE)


def pangu_pieces_text(text: str) -> str:
    """The string PanGu-alpha's JIEBATokenizer hands sentencepiece (tokenize + convert_tokens_to_ids)."""
    return " ".join(word.translate(_PANGU_TRANSLATE) for word in _jieba_cut(text))


def pangu_text(decoded: str) -> str:
    """PanGu-alpha's JIEBATokenizer.process_tokens on sentencepiece's decoded string."""
    return decoded.replace(" ", "").replace(JIEBA_SPACE, " ").replace(JIEBA_NEWLINE, "\n")


# --------------------------------------------------------------------------- tokenizer
class Tokenizer:
    """A sentencepiece model plus its text mapping (``scheme``, detected from the model's pieces)."""

    def __init__(self, model_proto: bytes, path: Optional[str] = None):
        self._proto = bytes(model_proto)
        self.path = path
        self.sp = spm.SentencePieceProcessor(model_proto=self._proto)
        pieces = {self.sp.id_to_piece(i) for i in range(min(8, self.sp.get_piece_size()))}
        if MARKER_JIEBA in pieces:
            self.scheme, self.jieba = "naohai-v1-jieba", True
        elif MARKER_PLAIN in pieces:
            self.scheme, self.jieba = "naohai-v1", False
        elif all(self._piece_id(p) is not None for p in PANGU_PIECES):
            self.scheme, self.jieba = "pangu", True
        else:
            self.scheme, self.jieba = "raw", False

    def _piece_id(self, piece: str) -> Optional[int]:
        i = self.sp.piece_to_id(piece)
        return i if self.sp.id_to_piece(i) == piece else None      # unknown pieces map to unk

    # ---- construction / persistence
    @classmethod
    def load(cls, path: str, key: Optional[str] = "data.tokenizer") -> "Tokenizer":
        """A sentencepiece ``.model``, or for a ``.json`` path a Hugging Face tokenizer
        (:class:`naohai.data.hf_tokenizer.HFTokenizer`, the same interface)."""
        if str(path).endswith(".json"):
            from naohai.data.hf_tokenizer import HFTokenizer
            return HFTokenizer.load(path, key)
        if not os.path.isfile(path):
            raise UserError("tokenizer model not found", where=path, key=key)
        with open(path, "rb") as fh:
            proto = fh.read()
        try:
            return cls(proto, path=os.path.abspath(path))
        except (RuntimeError, OSError) as exc:
            raise UserError(f"is not a sentencepiece model ({str(exc).strip()[:120]})", where=path,
                            key=key) from None

    def save(self, path: str) -> str:
        """Write the model file atomically; returns the absolute path."""
        self.path = write_bytes_atomically(path, self._proto)
        return self.path

    @property
    def model_proto(self) -> bytes:
        return self._proto

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self._proto).hexdigest()

    # ---- ids
    @property
    def vocab_size(self) -> int:
        return self.sp.get_piece_size()

    @property
    def eod_id(self) -> int:
        if self.scheme == "pangu":
            return self._piece_id("<eod>")
        return self.sp.eos_id()

    @property
    def stop_ids(self) -> tuple:
        """The ids that end a generation: EOD."""
        return (self.eod_id,)

    @property
    def pad_id(self) -> int:
        if self.scheme == "pangu":
            return self._piece_id("<pad>")
        return self.sp.pad_id()

    @property
    def unk_id(self) -> int:
        return self.sp.unk_id()

    @property
    def bos_id(self) -> int:
        return self.sp.bos_id()

    def id_to_piece(self, i: int) -> str:
        return self.sp.id_to_piece(int(i))

    # ---- text
    def _mapped(self, text: str) -> str:
        if self.scheme == "raw":
            return text
        if self.scheme == "pangu":
            return pangu_pieces_text(text)
        return to_pieces_text(text, self.jieba)

    def encode(self, text: str) -> List[int]:
        return self.sp.encode(self._mapped(text))

    def encode_batch(self, texts: Sequence[str], num_threads: int = -1) -> List[List[int]]:
        """Encode many texts at once (sentencepiece threads over the batch)."""
        return self.sp.encode([self._mapped(t) for t in texts], num_threads=num_threads)

    def decode(self, ids: Iterable[int]) -> str:
        text = self.sp.decode([int(i) for i in ids])
        if self.scheme == "raw":
            return text
        if self.scheme == "pangu":
            return pangu_text(text)
        return from_pieces_text(text, self.jieba)

    def __repr__(self) -> str:
        return f"Tokenizer(path={self.path!r}, vocab_size={self.vocab_size}, scheme={self.scheme!r})"


# --------------------------------------------------------------------------- training
def _training_lines(documents: Iterable[str], jieba_mode: bool, max_lines: int, seed: int) -> List[str]:
    """Mapped lines of all documents; a seeded reservoir sample if there are more than max_lines."""
    rng = random.Random(seed)
    sample: List[str] = []
    seen = 0
    for doc in documents:
        for line in to_pieces_text(doc, jieba_mode).split(NEWLINE):
            for start in range(0, len(line), _MAX_LINE_CHARS):
                chunk = line[start:start + _MAX_LINE_CHARS]
                if not chunk.strip():
                    continue
                seen += 1
                if len(sample) < max_lines:
                    sample.append(chunk)
                else:
                    j = rng.randrange(seen)
                    if j < max_lines:
                        sample[j] = chunk
    return sample


def limit_alphabet(lines: List[str], vocab_size: int) -> List[str]:
    """Keep at most half the learnable vocabulary as single characters.

    If the lines hold more distinct characters than ``(vocab_size - 262) // 2``,
    the rarer ones are cut out of the training lines (each line is split at them),
    so sentencepiece can reach its coverage target with the vocabulary it has.
    Such characters are still encoded exactly later, through byte-fallback pieces.
    """
    counts: Counter = Counter()
    for line in lines:
        counts.update(line)
    budget = max(1, (vocab_size - RESERVED_PIECES) // 2)
    if len(counts) <= budget:
        return lines
    ranked = sorted(counts, key=lambda c: (c != " ", -counts[c], c))
    keep = "".join(re.escape(c) for c in ranked[:budget])
    rare = re.compile(f"[^{keep}]+")
    out = []
    for line in lines:
        out.extend(part for part in rare.split(line) if part.strip())
    return out


def train_tokenizer(documents: Iterable[str], vocab_size: int, out_prefix: Optional[str] = None, *,
                    jieba: bool = False, character_coverage: Optional[float] = None,
                    max_sentences: int = 2_000_000, seed: int = 0, num_threads: int = 2,
                    key: str = "model.vocab_size") -> Tokenizer:
    """Train a byte-fallback BPE tokenizer on ``documents``.

    Writes ``<out_prefix>.model`` (atomically) when ``out_prefix`` is given.  At
    most ``max_sentences`` lines (a reservoir sample seeded by ``seed``) are used.
    ``character_coverage`` None means 0.9995 (suits Chinese) after
    :func:`limit_alphabet` has dropped rare characters that a small vocabulary
    could not hold anyway.
    The result is deterministic for the same documents and arguments.
    """
    vocab_size = int(vocab_size)
    if vocab_size < RESERVED_PIECES + 16:
        raise UserError(f"a tokenizer needs at least {RESERVED_PIECES + 16} pieces ({RESERVED_PIECES} are "
                        f"reserved for specials and bytes), got {vocab_size}", key=key)
    lines = _training_lines(documents, jieba, max_sentences, seed)
    if not lines:
        raise UserError("the corpus holds no text to train a tokenizer on", key="data.corpus")
    if character_coverage is None:
        lines = limit_alphabet(lines, vocab_size)
        character_coverage = 0.9995
    buf = io.BytesIO()
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(lines), model_writer=buf, vocab_size=vocab_size, model_type="bpe",
            byte_fallback=True, character_coverage=character_coverage,
            normalization_rule_name="identity", remove_extra_whitespaces=False, add_dummy_prefix=False,
            split_by_whitespace=True, split_digits=True, allow_whitespace_only_pieces=True,
            pad_id=PAD_ID, eos_id=EOD_ID, unk_id=UNK_ID, bos_id=BOS_ID,
            pad_piece="<pad>", eos_piece="<eod>", unk_piece="<unk>", bos_piece="<s>",
            control_symbols=[MARKER_JIEBA if jieba else MARKER_PLAIN], user_defined_symbols=[NEWLINE],
            input_sentence_size=0, shuffle_input_sentence=False, max_sentence_length=1 << 16,
            num_threads=max(1, int(num_threads)), minloglevel=2)
    except RuntimeError as exc:
        msg = str(exc).strip().splitlines()[-1] if str(exc).strip() else repr(exc)
        if "Vocabulary size" in msg or "vocab_size" in msg:
            raise UserError(f"the corpus is too small for a tokenizer of {vocab_size} pieces ({msg}); "
                            f"lower the vocabulary size or add text", key=key) from None
        raise
    tok = Tokenizer(buf.getvalue())
    if out_prefix is not None:
        tok.save(out_prefix if out_prefix.endswith(".model") else out_prefix + ".model")
    return tok
