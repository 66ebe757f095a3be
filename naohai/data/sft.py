"""Supervised fine-tuning data: conversations -> packed windows of token ids with a loss mask.

Input: ``.jsonl`` files, one conversation a line, either ``{"prompt": P, "response": R}``
(optional ``"system"``) or ``{"messages": [{"role": ..., "content": ...}, ...]}`` with roles
``system`` / ``user`` / ``assistant`` (multi-turn, at least one assistant message).  A line
that is not such an object (bad JSON, missing or mistyped keys, unknown role, no assistant
message, a chat template refusing it) is *malformed*: counted, listed as ``file:line: why``
in the report, and skipped -- never fatal.

Rendering.  With a tokenizer that has a chat template (a Hugging Face folder's), the
conversation is rendered by it (:meth:`HFTokenizer.apply_chat_template`, jinja2 as transformers
renders) and tokenized whole; the text of assistant message ``i`` is ``render(messages[:i+1],
add_generation_prompt=False)`` minus its prefix ``render(messages[:i], add_generation_prompt=
True)`` (the answer and the template's end-of-turn text), and a token is *learned* when its
first character lies in such a span.  A template that does not render conversations
incrementally (a turn's text is not a prefix of the next) is refused naming ``chat_template``.
Without a template, naohai's template::

    System: {content}\\n        (when there is a system message)
    User: {content}\\n
    Assistant: {content}\\n     ("{content}\\n" learned)

is encoded segment by segment.  Every conversation is followed by the EOD id, learned when the
last message is the assistant's (the model learns to stop).

Packing.  A window holds ``seq_length + 1`` tokens (inputs are the first ``seq_length``,
labels the last ``seq_length``); windows do not overlap.  Conversations are placed in corpus
order, a new window started when the next one does not fit; the rest of a window is the pad
id, never learned.  As every conversation ends with EOD, a model with ``model.eod_reset`` (the
PanGu / PengCheng presets; ``recipes/sft-tiny.yaml`` sets it for the tiny one) keeps packed
conversations from attending to each other; without it a conversation also sees the ones before
it in its window (training then prints a warning).  Where resetting at EOD cannot separate
them (a chat template that puts EOD inside conversations, see :func:`eod_inside`),
``data.packing: false`` gives every conversation a window of its own, padded: nothing is seen
across conversations, at the cost of the padding's compute.  A conversation longer than a window is
``truncation: drop`` (default: left out) or ``truncate`` (its head kept, the tokens of the
assistant message cut by the window end unlearned; left out if nothing learned remains);
the report counts both.

Layout of a prepared SFT directory::

    meta.json        format naohai-sft-v1, tokenizer, seq_length, truncation, packing, per split: file,
                     mask, conversations, windows, learned tokens; report (malformed lines, truncation);
                     eod_inside (conversations whose template puts the EOD id inside them)
    train.npy        [windows, seq_length + 1] token ids (uint16 / uint32)
    train.mask.npy   [windows, seq_length + 1] uint8, 1 where the token is a learned target
    valid.npy, valid.mask.npy

``mask[w, j] = 1`` says token ``j`` of window ``w`` is learned, i.e. label ``j - 1`` counts in
the loss; ``mask[w, 0]`` is always 0.  The held-out split is chosen by conversation as in
:func:`naohai.data.prepare.holdout_mask`.  :class:`SFTLoader` serves ``(tokens, mask)`` batches
in the order of :class:`naohai.data.loader.TokenWindowLoader`, each with the learned-token count of
the whole global batch (:class:`SFTBatch`: every data-parallel rank reads it from the global batch's
masks, so the loss's denominator agrees on every rank without a collective); :func:`masked_labels`
turns one into ``(input_ids, labels)`` with :data:`IGNORE` where a label is not learned.
"""
from __future__ import annotations

import glob
import json
import os
import shutil
import time
from typing import Any, Dict, Iterable, List, NamedTuple, Optional, Sequence, Tuple

import numpy as np

from naohai.data.loader import TokenWindowLoader
from naohai.data.prepare import Prepared, check_replaceable, holdout_mask, publish, token_dtype
from naohai.errors import UserError

FORMAT = "naohai-sft-v1"
ROLES = ("system", "user", "assistant")
TRUNCATION = ("drop", "truncate")
IGNORE = -100                 # label of a position that is not learned
MAX_LISTED = 200              # malformed lines listed in meta.json (all are counted)
META = "meta.json"
NAOHAI_TEMPLATE = {"system": "System: ", "user": "User: ", "assistant": "Assistant: "}


# --------------------------------------------------------------------------- reading
def _messages(record: Any) -> List[Dict[str, str]]:
    """The messages of one parsed line, or ValueError naming what is wrong."""
    if not isinstance(record, dict):
        raise ValueError(f"is a JSON {type(record).__name__}, not an object")
    if "messages" in record:
        msgs = record["messages"]
        if not isinstance(msgs, list) or not msgs:
            raise ValueError("'messages' is not a non-empty list")
        out = []
        for k, m in enumerate(msgs):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise ValueError(f"messages[{k}] is not an object with string 'role' and 'content'")
            if m["role"] not in ROLES:
                raise ValueError(f"messages[{k}] has role {m['role']!r}; roles are {', '.join(ROLES)}")
            out.append({"role": m["role"], "content": m["content"]})
    elif "prompt" in record or "response" in record:
        for key in ("prompt", "response"):
            if not isinstance(record.get(key), str):
                raise ValueError(f"'{key}' is missing or not a string")
        out = [{"role": "user", "content": record["prompt"]}, {"role": "assistant", "content": record["response"]}]
        if "system" in record:
            if not isinstance(record["system"], str):
                raise ValueError("'system' is not a string")
            out.insert(0, {"role": "system", "content": record["system"]})
    else:
        raise ValueError("has neither 'messages' nor 'prompt'/'response'")
    if not any(m["role"] == "assistant" for m in out):
        raise ValueError("has no assistant message (nothing to learn)")
    return out


def expand_paths(sources: Sequence[str], key: str = "data.corpus") -> List[str]:
    """The ``.jsonl`` files of ``sources`` (paths or globs, or ``builtin:sft-tasks``: the instruction set
    shipped with naohai, :mod:`naohai.data.sft_tasks`), in the order given."""
    from naohai.data import sft_tasks
    files: List[str] = []
    for src in sources:
        if src == sft_tasks.NAME:
            files.append(sft_tasks.FILE)
            continue
        found = sorted(glob.glob(src)) if any(c in src for c in "*?[") else ([src] if os.path.isfile(src) else [])
        if not found:
            raise UserError("matches no file", where=src, key=key)
        files.extend(found)
    return files


def read_conversations(paths: Sequence[str]) -> Tuple[List[Tuple[str, List[Dict[str, str]]]], List[str]]:
    """([(file:line, messages)], [malformed 'file:line: why'])."""
    good, bad = [], []
    for path in paths:
        with open(path, encoding="utf-8", errors="replace") as fh:
            for n, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                where = f"{path}:{n}"
                try:
                    good.append((where, _messages(json.loads(line))))
                except ValueError as exc:     # json.JSONDecodeError is a ValueError
                    bad.append(f"{where}: {exc}")
    return good, bad


# --------------------------------------------------------------------------- rendering
def _template_text(tokenizer, messages, generation_prompt: bool) -> str:
    """``messages`` rendered by the tokenizer's chat template; a template error exits 2 naming it."""
    import jinja2
    try:
        return tokenizer.apply_chat_template(list(messages), add_generation_prompt=generation_prompt)
    except jinja2.TemplateError as exc:
        raise UserError(f"the chat template does not render: {exc}", where=tokenizer.path,
                        key="chat_template") from None


def _template_spans(messages, tokenizer) -> Tuple[str, List[Tuple[int, int]]]:
    """Full text by the tokenizer's chat template and the character spans of the assistant turns."""
    full = _template_text(tokenizer, messages, False)
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before = _template_text(tokenizer, messages[:i], True)
        after = _template_text(tokenizer, messages[:i + 1], False)
        if not (after.startswith(before) and full.startswith(after)):
            raise UserError("the chat template does not render conversations incrementally (the text up to an "
                            "assistant turn is not a prefix of the whole), so the assistant tokens cannot be "
                            "found; use a template whose turns only append", where=tokenizer.path,
                            key="chat_template")
        spans.append((len(before), len(after)))
    return full, spans


def _naohai_turn(message: Dict[str, str], tokenizer) -> Tuple[List[int], List[int]]:
    """(ids, learned flags) of one turn in naohai's template: its role's head, then ``content`` and a newline,
    encoded segment by segment; the body is learned in an assistant turn."""
    head = tokenizer.encode(NAOHAI_TEMPLATE[message["role"]])
    body = tokenizer.encode(message["content"] + "\n")
    return head + body, [0] * len(head) + [int(message["role"] == "assistant")] * len(body)


def render(messages: Sequence[Dict[str, str]], tokenizer) -> Tuple[List[int], List[int]]:
    """(token ids, learned flags) of one conversation, EOD included (see the module docstring)."""
    if getattr(tokenizer, "chat_template", None):
        full, spans = _template_spans(messages, tokenizer)
        enc = tokenizer.backend.encode(full, add_special_tokens=False)
        ids = list(enc.ids)
        learned = [int(any(a <= start < b for a, b in spans)) for start, _ in enc.offsets]
    else:
        ids, learned = [], []
        for m in messages:
            turn_ids, turn_learned = _naohai_turn(m, tokenizer)
            ids += turn_ids
            learned += turn_learned
    ids.append(tokenizer.eod_id)
    learned.append(int(messages[-1]["role"] == "assistant"))
    if learned:
        learned[0] = 0               # the first token of a conversation is never a label of it
    return ids, learned


def prompt_ids(messages: Sequence[Dict[str, str]], tokenizer) -> List[int]:
    """The token ids that ask a fine-tuned model for the next assistant turn after ``messages`` (system / user /
    assistant turns, the last one not the assistant's): what :func:`render` puts before an assistant message's
    text, so the model sees the prompt as it saw it in training and answers up to the EOD it learned.  The
    tokenizer's chat template renders it with ``add_generation_prompt`` (encoded whole, as transformers
    encodes such a prompt), else naohai's template turn by turn, ending ``Assistant: ``."""
    if getattr(tokenizer, "chat_template", None):
        text = _template_text(tokenizer, messages, True)
        return list(tokenizer.backend.encode(text, add_special_tokens=False).ids)
    ids = [i for m in messages for i in _naohai_turn(m, tokenizer)[0]]
    return ids + tokenizer.encode(NAOHAI_TEMPLATE["assistant"])


def _truncate(ids: List[int], learned: List[int], size: int) -> Tuple[List[int], List[int]]:
    """The first ``size`` tokens, the learned run cut by the end unlearned."""
    ids, learned = ids[:size], list(learned[:size])
    j = size - 1
    while j >= 0 and learned[j]:
        learned[j] = 0
        j -= 1
    return ids, learned


# --------------------------------------------------------------------------- packing
def pack(conversations: Iterable[Tuple[List[int], List[int]]], seq_length: int, pad_id: int,
         truncation: str = "drop", packing: bool = True) -> Tuple[np.ndarray, np.ndarray, Dict[str, int]]:
    """Windows ``[W, seq_length + 1]`` of ids and of learned flags, and counts (see the docstring); with
    ``packing`` off every conversation has a window of its own."""
    size = int(seq_length) + 1
    rows_ids: List[List[int]] = []
    rows_mask: List[List[int]] = []
    stats = {"conversations": 0, "dropped_truncated": 0, "truncated": 0, "learned_tokens": 0}
    cur_ids: List[int] = []
    cur_mask: List[int] = []

    def close():
        if cur_ids:
            rows_ids.append(cur_ids + [pad_id] * (size - len(cur_ids)))
            rows_mask.append(cur_mask + [0] * (size - len(cur_mask)))

    for ids, learned in conversations:
        if len(ids) > size:
            if truncation == "drop":
                stats["dropped_truncated"] += 1
                continue
            ids, learned = _truncate(ids, learned, size)
            if not any(learned):
                stats["dropped_truncated"] += 1
                continue
            stats["truncated"] += 1
        if cur_ids and (not packing or len(cur_ids) + len(ids) > size):
            close()
            cur_ids, cur_mask = [], []
        cur_ids = cur_ids + list(ids)
        # a conversation's first token is never learned, so the mask needs no care at the seam
        cur_mask = cur_mask + list(learned)
        stats["conversations"] += 1
        stats["learned_tokens"] += int(sum(learned))
    close()
    if not rows_ids:
        return np.zeros((0, size), np.int64), np.zeros((0, size), np.uint8), stats
    return np.asarray(rows_ids, np.int64), np.asarray(rows_mask, np.uint8), stats


def eod_inside(rendered: Sequence[Tuple[List[int], List[int]]], tokenizer) -> Dict[str, Any]:
    """How many rendered conversations hold the EOD id before their own closing EOD, and the first one's text up
    to it: a chat template that ends each turn with the tokenizer's EOS, where EOS is the EOD (Qwen's
    ``<|im_end|>``, Llama-2's ``</s>``...).  Resetting attention at EOD (``model.eod_reset``) would cut such a
    conversation at its turns, so an answer could not see its question (:func:`naohai.train.job.adopt_token_ids`
    refuses it)."""
    hits = [ids for ids, _ in rendered if tokenizer.eod_id in ids[:-1]]
    example = None
    if hits:
        ids = hits[0]
        example = tokenizer.decode(ids[:ids.index(tokenizer.eod_id) + 1])[-200:]
    return {"conversations": len(hits), "example": example}


# --------------------------------------------------------------------------- preparing
def prepare_sft(sources: Sequence[str], tokenizer, out_dir: str, seq_length: int, holdout_fraction: float = 0.05,
                seed: int = 1234, *, truncation: str = "drop", packing: bool = True, overwrite: bool = False,
                source: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """Render, split, pack and write ``sources`` (``.jsonl`` paths or globs) to ``out_dir``; returns meta."""
    if truncation not in TRUNCATION:
        raise UserError(f"'{truncation}' is not one of {', '.join(TRUNCATION)}", key="data.truncation")
    seq_length = int(seq_length)
    if seq_length <= 0:
        raise UserError(f"must be a positive integer, got {seq_length}", key="model.seq_length")
    out_dir = os.path.abspath(out_dir)
    if os.path.isdir(out_dir) and os.listdir(out_dir) and not overwrite:
        raise UserError("exists and is not empty; refusing to replace it (pass --overwrite or choose another "
                        "directory)", where=out_dir, key="data.prepared_dir")
    check_replaceable(out_dir)
    convs, malformed = read_conversations(expand_paths(sources))
    lines_read = len(convs) + len(malformed)
    rendered, where = [], []
    for loc, msgs in convs:
        try:
            rendered.append(render(msgs, tokenizer))
            where.append(loc)
        except UserError as exc:
            if exc.key == "chat_template" and "refused" in exc.message:
                malformed.append(f"{loc}: {exc.message}")        # the template refuses this conversation
                continue
            raise
    if len(rendered) < 2:
        first = "; ".join(malformed[:3])
        raise UserError(f"holds {len(rendered)} usable conversation(s) ({len(malformed)} malformed line(s)"
                        f"{': ' + first if first else ''}); at least 2 are needed to hold one out",
                        key="data.corpus")
    is_valid = holdout_mask(np.array([len(r[0]) for r in rendered]), holdout_fraction, seed)
    dtype = token_dtype(tokenizer.vocab_size)
    tmp = f"{out_dir}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    try:
        splits: Dict[str, Any] = {}
        totals = {"conversations": 0, "dropped_truncated": 0, "truncated": 0}
        for split, take in (("train", ~is_valid), ("valid", is_valid)):
            ids, mask, stats = pack((r for r, t in zip(rendered, take) if t), seq_length, tokenizer.pad_id,
                                    truncation, packing)
            if len(ids) == 0:
                raise UserError(f"the {split} split holds no window: every conversation is longer than "
                                f"seq_length + 1 = {seq_length + 1} tokens and data.truncation is "
                                f"'{truncation}'", key="data.corpus")
            np.save(os.path.join(tmp, f"{split}.npy"), ids.astype(dtype))
            np.save(os.path.join(tmp, f"{split}.mask.npy"), mask)
            splits[split] = {"file": f"{split}.npy", "mask": f"{split}.mask.npy", "windows": int(len(ids)),
                             "tokens": int(ids.size), **stats}
            for k in totals:
                totals[k] += stats[k]
        meta = {
            "format": FORMAT,
            "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
            "tokenizer": {"path": tokenizer.path, "sha256": tokenizer.sha256, "vocab_size": tokenizer.vocab_size,
                          "eod_id": tokenizer.eod_id, "pad_id": tokenizer.pad_id, "scheme": tokenizer.scheme,
                          "template": "chat_template" if getattr(tokenizer, "chat_template", None) else "naohai"},
            "seq_length": seq_length,
            "window": {"length": seq_length + 1, "stride": seq_length + 1},
            "dtype": dtype.name,
            "max_token_id": int(max(int(np.max(np.load(os.path.join(tmp, f"{s}.npy")))) for s in splits)),
            "holdout_fraction": float(holdout_fraction),
            "seed": int(seed),
            "truncation": truncation,
            "packing": bool(packing),
            "splits": splits,
            "report": {"lines_read": lines_read, **totals, "malformed": len(malformed),
                       "malformed_lines": malformed[:MAX_LISTED]},
            "eod_inside": eod_inside(rendered, tokenizer),
            "source": source or {"files": expand_paths(sources)},
        }
        return publish(tmp, out_dir, meta)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def report_text(meta: Dict[str, Any]) -> str:
    """The preparation report as lines for the console."""
    r = meta["report"]
    packed = "packed" if meta.get("packing", True) else "one a window (data.packing: false)"
    lines = [f"{r['lines_read']} lines: {r['conversations']} conversations {packed}, {r['malformed']} malformed, "
             f"{r['dropped_truncated']} dropped as too long, {r['truncated']} truncated (truncation: "
             f"{meta['truncation']})"]
    for split, info in meta["splits"].items():
        lines.append(f"  {split}: {info['conversations']} conversations in {info['windows']} windows of "
                     f"{meta['seq_length'] + 1} tokens, {info['learned_tokens']} learned tokens")
    lines += [f"  malformed {m}" for m in r["malformed_lines"]]
    if r["malformed"] > len(r["malformed_lines"]):
        lines.append(f"  ... and {r['malformed'] - len(r['malformed_lines'])} more malformed lines")
    return "\n".join(lines)


# --------------------------------------------------------------------------- reading back
class SFTPrepared(Prepared):
    """A prepared SFT directory: ``tokens(split)`` and ``mask(split)`` are ``[windows, seq_length + 1]``."""

    def mask(self, split: str) -> np.ndarray:
        return np.load(os.path.join(self.path, self._split(split)["mask"]), mmap_mode="r")


def is_sft_dir(path: str) -> bool:
    """Whether ``path`` holds a meta.json of a prepared SFT directory."""
    try:
        with open(os.path.join(path, META), encoding="utf-8") as fh:
            return json.load(fh).get("format") == FORMAT
    except (OSError, ValueError, AttributeError):
        return False


def load_sft(path: str) -> SFTPrepared:
    """Open a prepared SFT directory, checking meta.json and the shapes of its arrays."""
    path = os.path.abspath(path)
    try:
        with open(os.path.join(path, META), encoding="utf-8") as fh:
            meta = json.load(fh)
    except (OSError, ValueError):
        meta = None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise UserError(f"is not a prepared SFT directory (no {META} of format {FORMAT})", where=path,
                        key="data.prepared_dir")
    prep = SFTPrepared(path, meta)
    for split in meta["splits"]:
        want = (prep.num_windows(split), prep.seq_length + 1)
        for arr, name in ((prep.tokens(split), "file"), (prep.mask(split), "mask")):
            if arr.shape != want:
                raise UserError(f"has shape {arr.shape}, meta.json says {want}; prepare the data again",
                                where=os.path.join(path, meta["splits"][split][name]))
    return prep


class SFTBatch(NamedTuple):
    """One rank's rows of an SFT global batch: ``tokens`` int32 and ``mask`` uint8, ``[rows, seq + 1]``,
    and ``learned``, the learned tokens (mask ones past column 0) of the GLOBAL batch, all ranks' rows."""

    tokens: np.ndarray
    mask: np.ndarray
    learned: int


class SFTLoader(TokenWindowLoader):
    """:class:`TokenWindowLoader`'s order over SFT windows; batches are :class:`SFTBatch`."""

    def __init__(self, prepared, split: str = "train", *args, **kwargs):
        super().__init__(prepared if isinstance(prepared, SFTPrepared) else load_sft(prepared), split, *args,
                         **kwargs)
        self._mask = self.prepared.mask(split)

    def next_batch(self) -> SFTBatch:
        everyone = self.window_indices(self.sample, self.global_batch_size)
        lo = self.rank * self.local_batch_size
        idx = everyone[lo:lo + self.local_batch_size]
        learned = int(np.count_nonzero(np.asarray(self._mask[np.sort(everyone)])[:, 1:]))
        self.sample += self.global_batch_size
        return SFTBatch(np.asarray(self._tokens[idx], np.int32), np.asarray(self._mask[idx], np.uint8), learned)


def masked_labels(batch) -> Tuple[np.ndarray, np.ndarray]:
    """``(input_ids, labels)`` int32 of an SFT batch (:class:`SFTBatch` or ``(tokens, mask)``): labels are
    :data:`IGNORE` where not learned."""
    tokens, mask = batch[0], batch[1]
    tokens = np.asarray(tokens, np.int32)
    labels = np.where(np.asarray(mask)[:, 1:] != 0, tokens[:, 1:], IGNORE).astype(np.int32)
    return tokens[:, :-1], labels
