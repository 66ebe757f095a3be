"""Hugging Face ``tokenizer.json`` tokenizers (the ``tokenizers`` library), beside sentencepiece.

:class:`HFTokenizer` has the interface of :class:`naohai.data.tokenizer.Tokenizer`
(``encode`` / ``decode`` / ids / ``sha256``), so data preparation, ``eval --text``,
``generate`` and ``data score`` take either: :meth:`Tokenizer.load` hands a ``.json`` path
here.  Text is encoded without added special tokens (as ``tokenizer(text,
add_special_tokens=False)`` in transformers; the data pipeline joins documents with the
EOD id itself) and decoded with special tokens kept.  The special tokens come from the
``tokenizer_config.json`` (or ``special_tokens_map.json``) beside the file: EOD is the
``eos_token``, pad the ``pad_token`` (else EOD), as transformers reads them (with
``data.add_special_tokens`` a pretraining document is encoded as ``tokenizer(text)`` encodes it,
:meth:`HFTokenizer.encode_documents`); so does the
``chat_template`` (or ``chat_template.jinja``), rendered by :meth:`HFTokenizer.apply_chat_template`
with jinja2 the way transformers renders it.  A ``generation_config.json`` beside it may name more
ids that end a generation (``eos_token_id``, one or a list: Llama 3's ``<|eot_id|>``, GLM-4's
``<|user|>``); :attr:`HFTokenizer.stop_ids` is EOD and those, where transformers' ``generate`` stops.

:func:`train_byte_bpe` trains a byte-level BPE (GPT-2's byte alphabet, so every text
round-trips exactly) and writes ``tokenizer.json`` plus a ``tokenizer_config.json`` that
``transformers.AutoTokenizer`` loads.  Special tokens: ``<pad>`` 0, ``<eod>`` 1,
``<unk>`` 2 (never produced), ``<s>`` 3, the ids naohai's sentencepiece tokenizers use.
"""
from __future__ import annotations

import datetime
import functools
import hashlib
import json
import os
from typing import Any, Dict, Iterable, List, Optional, Sequence

from naohai.errors import UserError
from naohai.runfiles import write_bytes_atomically
from naohai.validate import read_json_object

SPECIALS = ("<pad>", "<eod>", "<unk>", "<s>")
CONFIG = "tokenizer_config.json"
GENERATION = "generation_config.json"


def _json_beside(folder: str, name: str) -> Dict[str, Any]:
    """The JSON object in ``folder/name``, {} when there is no such file; unreadable JSON, another type or a
    key written twice exits 2 naming the file."""
    path = os.path.join(folder, name)
    return read_json_object(path) if os.path.isfile(path) else {}


def _token_text(value: Any) -> Optional[str]:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken mapping."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


class HFTokenizer:
    """A ``tokenizers.Tokenizer`` with the special tokens and chat template of its folder."""

    scheme = "hf"
    jieba = False

    def __init__(self, tokenizer_json: bytes, config: Dict[str, Any], path: Optional[str] = None,
                 chat_template: Optional[str] = None, generation: Optional[Dict[str, Any]] = None):
        from tokenizers import Tokenizer as Backend

        self._json = bytes(tokenizer_json)
        self.config = dict(config)
        self.path = path
        self.backend = Backend.from_str(self._json.decode("utf-8"))
        self.chat_template = chat_template if chat_template is not None else self.config.get("chat_template")
        self.generation = dict(generation or {})       # generation_config.json beside the file, if any

    # ---- construction / persistence
    @classmethod
    def load(cls, path: str, key: Optional[str] = "data.tokenizer") -> "HFTokenizer":
        if not os.path.isfile(path):
            raise UserError("tokenizer file not found", where=path, key=key)
        folder = os.path.dirname(os.path.abspath(path))
        config: Dict[str, Any] = {}
        for name in ("special_tokens_map.json", CONFIG):       # tokenizer_config.json wins where both say
            config.update(_json_beside(folder, name))
        generation = _json_beside(folder, GENERATION)
        template = None
        jinja = os.path.join(folder, "chat_template.jinja")
        if os.path.isfile(jinja):
            with open(jinja, encoding="utf-8") as fh:
                template = fh.read()
        with open(path, "rb") as fh:
            raw = fh.read()
        try:
            made = cls(raw, config, path=os.path.abspath(path), chat_template=template, generation=generation)
        except Exception as exc:  # noqa: BLE001 - the tokenizers library raises its own Exception types
            raise UserError(f"is not a Hugging Face tokenizer.json ({str(exc).strip()[:160]})", where=path,
                            key=key) from None
        made._generation_stops()    # a wrong generation_config.json is named now, not when a generation ends
        return made

    def save(self, path: str) -> str:
        """Write tokenizer.json (and tokenizer_config.json beside it); returns the absolute path."""
        self.path = write_bytes_atomically(path, self._json)
        write_bytes_atomically(os.path.join(os.path.dirname(self.path), CONFIG),
                         json.dumps(self.config, indent=2, ensure_ascii=False).encode("utf-8"))
        return self.path

    @property
    def sha256(self) -> str:
        h = hashlib.sha256(self._json)
        h.update(json.dumps({k: self.config.get(k) for k in ("eos_token", "pad_token", "bos_token", "unk_token")},
                            sort_keys=True, default=str).encode())
        return h.hexdigest()

    # ---- ids
    def _special_id(self, name: str) -> Optional[int]:
        text = _token_text(self.config.get(name))
        return None if text is None else self.backend.token_to_id(text)

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    @property
    def eod_id(self) -> int:
        found = self._special_id("eos_token")
        if found is None:
            raise UserError("names no eos_token (or one not in the vocabulary); naohai joins documents with it",
                            where=os.path.join(os.path.dirname(self.path or "."), CONFIG), key="eos_token")
        return found

    @property
    def stop_ids(self) -> tuple:
        """The ids that end a generation: EOD, then ``generation_config.json``'s ``eos_token_id`` (an id or a
        list; transformers' ``generate`` stops at any of them)."""
        ids = [self.eod_id]
        ids += [i for i in self._generation_stops() if i not in ids]
        return tuple(ids)

    def _generation_stops(self) -> List[int]:
        listed = self.generation.get("eos_token_id")
        values = listed if isinstance(listed, list) else [] if listed is None else [listed]
        for value in values:    # an id past the tokenizer's pieces may still be a row of a padded embedding
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise UserError(f"must be a token id (an integer >= 0) or a list of them, got {listed!r}",
                                key="eos_token_id", rule="generation stop ids",
                                where=os.path.join(os.path.dirname(self.path or "."), GENERATION))
        return list(values)

    @property
    def pad_id(self) -> int:
        found = self._special_id("pad_token")
        return self.eod_id if found is None else found

    @property
    def unk_id(self) -> Optional[int]:
        return self._special_id("unk_token")

    @property
    def bos_id(self) -> Optional[int]:
        return self._special_id("bos_token")

    def id_to_piece(self, i: int) -> str:
        return self.backend.id_to_token(int(i))

    # ---- text
    def encode(self, text: str) -> List[int]:
        return self.backend.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str], num_threads: int = -1) -> List[List[int]]:
        return [e.ids for e in self.backend.encode_batch(list(texts), add_special_tokens=False)]

    def encode_documents(self, texts: Sequence[str]) -> List[List[int]]:
        """Each text as ``tokenizer(text)`` encodes it in transformers: with the tokens the tokenizer's
        post-processor adds (a TemplateProcessing's: Llama's BOS; none for most byte-level BPEs)."""
        return [e.ids for e in self.backend.encode_batch(list(texts), add_special_tokens=True)]

    @property
    def adds_special_tokens(self) -> bool:
        """Whether :meth:`encode_documents` adds tokens to a text (the post-processor has some to add)."""
        return self.backend.encode("a", add_special_tokens=True).ids != self.backend.encode(
            "a", add_special_tokens=False).ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        """The text of ``ids``; ``skip_special_tokens`` leaves out the special added tokens (BOS, EOS, pad...),
        as lm-eval's ``hf`` model decodes a generation."""
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: Sequence[Dict[str, str]], add_generation_prompt: bool = True) -> str:
        """The prompt text of ``messages`` ([{"role": ..., "content": ...}]) by the folder's chat template,
        rendered as transformers renders it: jinja2's sandbox with trim_blocks / lstrip_blocks, loop controls
        and the ``{% generation %}`` block, the special tokens as variables, ``tools`` and ``documents`` none,
        ``raise_exception``, ``strftime_now`` (today's date, as Llama 3's templates print it) and a
        ``tojson`` that keeps non-ASCII text and takes ``indent``, ``separators`` and ``sort_keys``."""
        if not self.chat_template:
            raise UserError("has no chat_template (tokenizer_config.json or chat_template.jinja)",
                            where=os.path.dirname(self.path or "."), key="chat_template")
        specials = {k: _token_text(v) for k, v in self.config.items() if k.endswith("_token")}
        template = _compiled_template(self.chat_template, os.path.dirname(self.path or "."))
        return template.render(messages=list(messages), tools=None, documents=None,
                               add_generation_prompt=add_generation_prompt, **specials)

    def __repr__(self) -> str:
        return f"HFTokenizer(path={self.path!r}, vocab_size={self.vocab_size})"


@functools.lru_cache(maxsize=8)
def _compiled_template(text: str, where: str):
    """A chat template compiled once in the environment transformers renders it in (see
    :meth:`HFTokenizer.apply_chat_template`); ``raise_exception`` is a UserError naming ``where``."""
    import jinja2
    import jinja2.ext           # not imported by jinja2 itself (transformers imports it, so tests missed it)
    import jinja2.nodes
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise UserError(f"the chat template refused the messages: {message}", where=where, key="chat_template")

    class Generation(jinja2.ext.Extension):
        """``{% generation %}...{% endgeneration %}``: transformers marks assistant text with it (for its
        assistant-token mask); rendered as its body."""
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    return env.from_string(text)


def train_byte_bpe(documents: Iterable[str], vocab_size: int, out_path: Optional[str] = None, *,
                   key: str = "model.vocab_size") -> HFTokenizer:
    """Train a byte-level BPE of ``vocab_size`` tokens (the 4 specials and 256 bytes included) on
    ``documents``; writes ``out_path`` (a ``tokenizer.json``) and its ``tokenizer_config.json``."""
    from tokenizers import Tokenizer as Backend, decoders, models, pre_tokenizers, trainers

    vocab_size = int(vocab_size)
    if vocab_size < len(SPECIALS) + 256 + 16:
        raise UserError(f"a byte-level BPE needs at least {len(SPECIALS) + 256 + 16} tokens (4 specials and 256 "
                        f"bytes are reserved), got {vocab_size}", key=key)
    backend = Backend(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIALS), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator((d for d in documents if d), trainer=trainer)
    if backend.get_vocab_size() < len(SPECIALS) + 256:
        raise UserError("the corpus holds no text to train a tokenizer on", key="data.corpus")
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "pad_token": "<pad>", "eos_token": "<eod>",
              "unk_token": "<unk>", "bos_token": "<s>", "clean_up_tokenization_spaces": False,
              "model_max_length": 1_000_000_000}
    tok = HFTokenizer(backend.to_str().encode("utf-8"), config)
    if out_path is not None:
        tok.save(out_path)
    return tok
