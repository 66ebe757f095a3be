"""Recipe -> ready data: the tokenizer and the prepared shards a training run needs.

:func:`ensure_tokenizer` loads ``data.tokenizer`` or, when that is None, uses
``<train.output_dir>/tokenizer.model``, training it on the corpus first if it does
not exist yet (vocabulary ``model.vocab_size``, jieba per ``data.jieba``).

:func:`ensure_prepared` prepares shards in ``data.prepared_dir`` (default
``<train.output_dir>/data``) unless they are already up to date: same tokenizer
(sha256), seq_length, corpus fingerprint (with ``data.add_special_tokens``), holdout fraction and seed.  Shards made
with a different tokenizer or seq_length are never replaced silently.
"""
from __future__ import annotations

import os
from typing import Callable, Optional, Tuple

from naohai.data.corpus import fingerprint, iter_documents
from naohai.data.prepare import check_compatible, prepare, read_meta, vocab_fits
from naohai.data.prepared_dir import open_prepared
from naohai.data.tokenizer import Tokenizer, train_tokenizer
from naohai.errors import UserError

Log = Optional[Callable[[str], None]]


def default_tokenizer_path(recipe) -> str:
    """``data.tokenizer``, else where a trained one lives: ``<output_dir>/tokenizer.model`` (sentencepiece)
    or ``<output_dir>/tokenizer.json`` (``data.tokenizer_type: byte_bpe``)."""
    name = "tokenizer.json" if recipe.data.tokenizer_type == "byte_bpe" else "tokenizer.model"
    return recipe.data.tokenizer or os.path.join(recipe.train.output_dir, name)


def default_prepared_dir(recipe) -> str:
    return recipe.data.prepared_dir or os.path.join(recipe.train.output_dir, "data")


def padded_rows_allowed(recipe) -> bool:
    """Whether the tokenizer may have fewer pieces than ``model.vocab_size``: when the weights come from
    ``train.init_from`` and the tokenizer is given (``data.tokenizer``), as published models pad their
    embedding past their tokenizer (Qwen2.5 151,936 rows for 151,665 tokens, BLOOM 250,880 for 250,680,
    OLMo, GLM-4, Pythia) and the rows past it are never an input or a label.  A model trained from scratch
    is sized to its tokenizer."""
    return bool(recipe.data.tokenizer and recipe.train.init_from)


def encodes_special_tokens(recipe, tok) -> bool:
    """Whether the model's documents were encoded as ``tokenizer(text)`` (with the tokens a ``tokenizer.json``'s
    post-processor adds): ``data.add_special_tokens`` with such a tokenizer.  Evaluation and scoring encode
    text so too."""
    return bool(recipe.data.add_special_tokens) and hasattr(tok, "encode_documents")


def _check_tokenizer(tok: Tokenizer, recipe, path: str) -> None:
    """The tokenizer fits the model: as many pieces as ``model.vocab_size`` (naohai pads the rows itself,
    ``vocab_pad_multiple``; a tokenizer naohai trained into the run folder with another count was trained for
    another model), or at most that many where the model comes from ``train.init_from`` with its own
    ``data.tokenizer`` (:func:`padded_rows_allowed`)."""
    where = recipe.source or "recipe"
    exact = not padded_rows_allowed(recipe)
    if not vocab_fits(tok.vocab_size, recipe.model.vocab_size, exact):
        raise UserError(f"is {recipe.model.vocab_size}, but the tokenizer {path} has {tok.vocab_size} pieces; "
                        f"set model.vocab_size={tok.vocab_size}" +
                        ("" if recipe.data.tokenizer else " or delete that file to train a new tokenizer"),
                        where=where, key="model.vocab_size",
                        rule="model.vocab_size == tokenizer vocab size" if exact else
                        "model.vocab_size >= the pieces of data.tokenizer (train.init_from)")
    if tok.scheme not in ("raw", "hf") and tok.jieba != recipe.data.jieba:
        raise UserError(f"is {str(recipe.data.jieba).lower()}, but the tokenizer {path} was trained with "
                        f"jieba={str(tok.jieba).lower()}", where=where, key="data.jieba")


def ensure_tokenizer(recipe, log: Log = None) -> Tokenizer:
    """The recipe's tokenizer, trained into ``<output_dir>/tokenizer.model`` if needed."""
    path = default_tokenizer_path(recipe)
    if recipe.data.tokenizer or os.path.exists(path):
        tok = Tokenizer.load(path)
        _check_tokenizer(tok, recipe, path)
        return tok
    if log:
        log(f"training a {recipe.model.vocab_size}-piece tokenizer on {', '.join(recipe.data.corpus)} -> {path}")
    docs = iter_documents(recipe.data.corpus, recipe.data.jsonl_key)
    if recipe.data.tokenizer_type == "byte_bpe":
        from naohai.data.hf_tokenizer import train_byte_bpe
        tok = train_byte_bpe(docs, recipe.model.vocab_size, path)
        _check_tokenizer(tok, recipe, path)
        return tok
    return train_tokenizer(docs, recipe.model.vocab_size, path, jieba=recipe.data.jieba)


def _source(recipe) -> dict:
    source = fingerprint(recipe.data.corpus, recipe.data.jsonl_key)
    if recipe.data.add_special_tokens:     # only then: folders (and runs' data identities) from before the key stay valid
        source["add_special_tokens"] = True
    return source


def _made_for(meta: dict, tokenizer: Tokenizer, recipe, source: dict) -> bool:
    """Prepared data (its ``meta``) made from ``source`` for this recipe: same tokenizer, seq_length,
    holdout and seed (whether it is reused; :func:`naohai.data.prepare.check_compatible` then refuses
    data that does not fit the model)."""
    return bool(meta) and (
        meta.get("tokenizer", {}).get("sha256") == tokenizer.sha256
        and meta.get("seq_length") == recipe.model.seq_length
        and meta.get("holdout_fraction") == float(recipe.data.holdout_fraction)
        and meta.get("seed") == int(recipe.data.shuffle_seed)
        and meta.get("source") == source)


def is_up_to_date(prepared_dir: str, tokenizer: Tokenizer, recipe) -> bool:
    return _made_for(read_meta(prepared_dir), tokenizer, recipe, _source(recipe))


def _ensure_sft(recipe, tok: Tokenizer, out_dir: str, rebuild: bool, log: Log) -> None:
    """``data.format: sft``: conversations prepared by :func:`naohai.data.sft.prepare_sft` unless up to date
    (same tokenizer, seq_length, corpus fingerprint, holdout, seed, truncation, packing)."""
    from naohai.data.sft import expand_paths, is_sft_dir, prepare_sft, report_text, load_sft
    d = recipe.data
    source = dict(fingerprint(expand_paths(d.corpus), "sft"), truncation=d.truncation)
    if not d.packing:              # only then: folders (and runs' data identities) from before the key stay valid
        source["packing"] = False
    if not rebuild and is_sft_dir(out_dir):
        meta = load_sft(out_dir).meta
        if _made_for(meta, tok, recipe, source) and "eod_inside" in meta:   # older folders: made again, same windows
            if log:
                log(f"prepared SFT data in {out_dir} is up to date")
            return
    elif os.path.isdir(out_dir) and os.listdir(out_dir) and not is_sft_dir(out_dir) and not rebuild:
        raise UserError("holds other prepared data; choose another data.prepared_dir for the SFT data (or pass "
                        "--overwrite)", where=out_dir, key="data.prepared_dir")
    if log:
        log(f"preparing conversations {', '.join(d.corpus)} with seq_length {recipe.model.seq_length} -> {out_dir}")
    meta = prepare_sft(d.corpus, tok, out_dir, recipe.model.seq_length, d.holdout_fraction, d.shuffle_seed,
                       truncation=d.truncation, packing=d.packing, overwrite=True, source=source)
    if log:
        log(report_text(meta))


def ensure_prepared(recipe, progress: bool = True, *, out_dir: Optional[str] = None, overwrite: bool = False,
                    rebuild: bool = False, log: Log = None) -> Tuple[str, Tokenizer]:
    """Make sure tokenizer and shards exist and fit the recipe; returns (prepared_dir, tokenizer)."""
    if recipe.data.format == "sft" and not (recipe.data.tokenizer or os.path.exists(default_tokenizer_path(recipe))):
        raise UserError("fine-tuning data (data.format: sft) needs the base model's tokenizer; set data.tokenizer",
                        where=recipe.source or "recipe", key="data.tokenizer")
    tok = ensure_tokenizer(recipe, log)
    if recipe.data.add_special_tokens and not encodes_special_tokens(recipe, tok):
        raise UserError(f"needs a Hugging Face tokenizer.json, whose post-processor says which tokens a document "
                        f"gets; {tok.path} is a sentencepiece model", where=recipe.source or "recipe",
                        key="data.add_special_tokens", rule="add_special_tokens with a tokenizer.json")
    out_dir = os.path.abspath(out_dir or default_prepared_dir(recipe))
    if recipe.data.format == "sft":
        _ensure_sft(recipe, tok, out_dir, rebuild or overwrite, log)
    elif rebuild or overwrite or not is_up_to_date(out_dir, tok, recipe):
        if log:
            log(f"preparing {', '.join(recipe.data.corpus)} with seq_length {recipe.model.seq_length} -> {out_dir}")
            if not recipe.data.add_special_tokens and getattr(tok, "adds_special_tokens", False):
                log(f"note: {tok.path} adds {tok.decode(tok.encode_documents([''])[0])!r} to a text (tokenizer(text)); "
                    f"documents are prepared without it unless data.add_special_tokens is true")
        prepare(iter_documents(recipe.data.corpus, recipe.data.jsonl_key), tok, out_dir, recipe.model.seq_length,
                recipe.data.holdout_fraction, recipe.data.shuffle_seed, overwrite=overwrite, progress=progress,
                source=_source(recipe), min_train_windows=recipe.train.global_batch_size,
                add_special_tokens=recipe.data.add_special_tokens)
    elif log:
        log(f"prepared data in {out_dir} is up to date")
    prep = open_prepared(out_dir, verify=False)
    check_compatible(prep.meta, recipe.model.vocab_size, recipe.model.seq_length, where=recipe.source,
                     exact_vocab=not padded_rows_allowed(recipe))
    if prep.num_windows("train") < recipe.train.global_batch_size:
        raise UserError(f"the corpus is too small: {prep.num_windows('train')} training windows, fewer than "
                        f"one global batch of {recipe.train.global_batch_size}", where=recipe.source,
                        key="data.corpus")
    return out_dir, tok
