"""Text generation from a checkpoint: greedy, temperature, top-k, top-p, repetition penalties.

Generation keeps a key/value cache (:class:`CachedDecoder`): the prompt is run
once (op by op on a decoder's first call, then through a compiled pass,
:class:`~naohai.model.transformer.PromptStep`, the prompts left-padded to a
multiple of 32 tokens so that similar lengths share a compile), then each step
feeds only the newest token and attends over the cached
keys and values, so a step's work does not grow with the window's recompute.  The
cache has a fixed size (the prompt plus the new tokens, rounded up to 128 columns)
and the step is one compiled graph (:class:`~naohai.model.transformer.DecodeStep`)
that writes each new key/value into its column, so every step costs the same.
Prompts of a batch are left-padded; the padding is masked out of attention and
position ids count from each prompt's first token.  Sampling happens on the
host with numpy from a seeded generator; PanGu-alpha's repetition penalties
(src/generate.py: log_probs - count * frequency - (count > 0) * presence over the
generated tokens) are applied before it.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import numpy as np

from naohai.errors import UserError


@dataclass
class SamplingConfig:
    max_new_tokens: int = 64
    temperature: float = 0.8     # 0 = greedy
    top_k: int = 0               # 0 = off
    top_p: float = 1.0           # 1 = off
    seed: int = 0
    frequency_penalty: float = 0.0   # PanGu-alpha's generate.py uses 1.5
    presence_penalty: float = 0.0    # PanGu-alpha's generate.py uses 0.3
    repetition_penalty: float = 1.0  # transformers' (CTRL's): 1 = off; Qwen2.5 Instruct's generation_config 1.05

    def validate(self) -> None:
        if self.max_new_tokens <= 0:
            raise UserError("must be a positive integer", where="command line", key="--max-new-tokens")
        if not (np.isfinite(self.temperature) and self.temperature >= 0):
            raise UserError(f"must be a finite number >= 0 (0 = greedy), got {self.temperature}", where="command line",
                            key="--temperature")
        if self.seed < 0:
            raise UserError(f"must be an integer >= 0, got {self.seed}", where="command line", key="--seed")
        if self.top_k < 0:
            raise UserError("must be >= 0 (0 = off)", where="command line", key="--top-k")
        if not 0.0 < self.top_p <= 1.0:
            raise UserError("must be in (0, 1]", where="command line", key="--top-p")
        for key in ("frequency_penalty", "presence_penalty"):
            value = getattr(self, key)
            if not np.isfinite(value) or value < 0:
                raise UserError(f"must be a finite number >= 0, got {value}", where="command line",
                                key="--" + key.replace("_", "-"))
        if not (np.isfinite(self.repetition_penalty) and self.repetition_penalty > 0):
            raise UserError(f"must be a finite number > 0 (1 = off), got {self.repetition_penalty}",
                            where="command line", key="--repetition-penalty")


def sample_next(logits: np.ndarray, cfg: SamplingConfig, rng: np.random.Generator, vocab: int,
                counts: Optional[np.ndarray] = None, seen: Optional[np.ndarray] = None) -> int:
    """Pick the next id from 1-D logits (only the first ``vocab`` entries are real pieces).

    ``counts`` [vocab]: how often each id was generated so far, for PanGu-alpha's frequency and presence
    penalties; ``seen`` [vocab] bool: the ids of the prompt and of what was generated, for transformers'
    ``repetition_penalty`` (its ``RepetitionPenaltyLogitsProcessor``: such an id's logit divided by the
    penalty where positive, multiplied where negative, before temperature and the top-k / top-p filters).
    """
    logits = np.array(logits[:vocab], np.float64)
    if seen is not None and cfg.repetition_penalty != 1.0:
        picked = logits[seen[:vocab]]
        logits[seen[:vocab]] = np.where(picked < 0, picked * cfg.repetition_penalty, picked / cfg.repetition_penalty)
    if counts is not None and (cfg.frequency_penalty or cfg.presence_penalty):
        m = logits.max()
        logits = logits - (m + np.log(np.exp(logits - m).sum()))               # log-probabilities
        logits = logits - counts * cfg.frequency_penalty - (counts > 0) * cfg.presence_penalty
    if cfg.temperature == 0:
        return int(np.argmax(logits))
    logits = logits / cfg.temperature
    if cfg.top_k > 0 and cfg.top_k < vocab:
        kth = np.partition(logits, -cfg.top_k)[-cfg.top_k]
        logits = np.where(logits < kth, -np.inf, logits)
    probs = np.exp(logits - np.max(logits))
    probs /= probs.sum()
    if cfg.top_p < 1.0:
        order = np.argsort(-probs)
        cum = np.cumsum(probs[order])
        keep = order[: int(np.searchsorted(cum, cfg.top_p) + 1)]
        mask = np.zeros_like(probs)
        mask[keep] = probs[keep]
        probs = mask / mask.sum()
    return int(rng.choice(len(probs), p=probs))


def step_bias(cfg, pads: Sequence[int], start: int, t: int) -> np.ndarray:
    """Additive attention bias [b, 1 or heads, t, start + t] for t new tokens after ``start`` cached
    ones: causal, left padding (``pads[r]`` columns of row r) blocked, ALiBi distances if configured."""
    from naohai.model.layers import alibi_slopes

    total = start + t
    i = start + np.arange(t)[:, None]
    j = np.arange(total)[None, :]
    rows = []
    for pad in pads:
        allowed = (j <= i) & (j >= pad)
        rows.append(np.where(allowed, 0.0, -1e9)[None])
    bias = np.stack(rows).astype(np.float32)                                   # [b, 1, t, T]
    if cfg.position == "alibi":
        bias = bias + (alibi_slopes(cfg.num_heads)[:, None, None] * (j - i)[None])[None].astype(np.float32)
    return bias


class CachedDecoder:
    """Batch generation with a key/value cache over a built :class:`~naohai.model.transformer.NaohaiLM`."""

    def __init__(self, model, cfg, pad_id: int = 0):
        self.model = model
        self.cfg = cfg
        self.pad_id = pad_id
        # prefix / prompt tuning: the cache's first columns hold the virtual positions (NaohaiLM.step)
        self.virtual = model.virtual_count()

    #: the fixed cache length is rounded up to a multiple of this, so calls of similar lengths share
    #: one compiled decode step
    CACHE_BUCKET = 128

    #: prompts are left-padded to a multiple of this many tokens, so calls of similar lengths share one
    #: compiled prompt pass
    PROMPT_BUCKET = 32

    def _prompt_run(self, ids: np.ndarray, positions: np.ndarray, bias: np.ndarray):
        """The prompt pass: (logits of the last position [b, vocab], keys, values per layer).  A decoder's first
        call runs it op by op, so a one-shot ``naohai generate`` compiles nothing but its decode step; later
        calls go through the compiled :class:`~naohai.model.transformer.PromptStep` (the same numbers, bit for
        bit on CPU: ``tests/test_generate.py``), once per padded prompt shape."""
        from mindspore import Tensor
        args = Tensor(ids.astype(np.int32)), Tensor(positions.astype(np.int32)), Tensor(bias)
        if getattr(self, "_prompt", None) is None:
            from naohai.model.transformer import PromptStep
            self._prompt = PromptStep(self.model)
            logits, cache = self.model.step(*args)
            return logits.asnumpy()[:, -1], tuple(k for k, _ in cache), tuple(v for _, v in cache)
        last, keys, values = self._prompt(*args)
        return last.asnumpy(), keys, values

    def _decode_step(self):
        from naohai.model.transformer import DecodeStep
        if getattr(self, "_decode", None) is None:
            self._decode = DecodeStep(self.model)
        return self._decode

    def _fixed_cache(self, keys, values, size: int):
        """The prompt's keys/values [b, nkv, T, d] per layer, zero-padded to ``size`` columns."""
        from mindspore import Tensor
        pad = lambda x: Tensor(np.pad(x.asnumpy(), ((0, 0), (0, 0), (0, size - x.shape[2]), (0, 0))))
        return tuple(pad(k) for k in keys), tuple(pad(v) for v in values)

    def _decode_run(self, ids, positions, bias, column: int, keys, values):
        """One new token per row through the compiled fixed-cache step; ``bias`` covers the
        ``column + 1`` filled columns and is padded blocked to the cache's size."""
        from mindspore import Tensor
        size, n = keys[0].shape[2], self.virtual
        full = np.full(bias.shape[:-1] + (size,), -1e9, np.float32)
        full[..., :n] = 0.0                                   # the virtual positions: open to every row
        full[..., n:n + bias.shape[-1]] = bias
        slot = np.zeros((1, 1, size, 1), np.bool_)
        slot[0, 0, n + column, 0] = True
        from mindspore import mutable       # tuples of tensors are graph constants unless marked mutable
        logits, keys, values = self._decode_step()(Tensor(ids.astype(np.int32)), Tensor(positions.astype(np.int32)),
                                                   Tensor(full), Tensor(slot), mutable(tuple(keys)),
                                                   mutable(tuple(values)))
        return logits.asnumpy(), keys, values

    def generate_ids(self, prompts: Sequence[Sequence[int]], cfg: SamplingConfig, vocab: int,
                     stop_ids: Iterable[int] = (),
                     on_token: Optional[Callable[[int, int], None]] = None,
                     stop: Optional[Callable[[int, List[int]], bool]] = None) -> List[List[int]]:
        """New ids per prompt (ending before any of ``stop_ids``, or once ``stop(row, its new ids)`` is
        true); ``on_token(row, id)`` streams each one."""
        cfg.validate()
        stop_ids = frozenset(int(i) for i in stop_ids)
        limit = self.cfg.positions - self.virtual          # the virtual positions come first
        prompts = [list(p)[-(limit - 1):] or [self.pad_id] for p in prompts]
        b, step = len(prompts), self.PROMPT_BUCKET
        longest = -(-max(len(p) for p in prompts) // step) * step         # every row left-padded to the bucket
        pads = [longest - len(p) for p in prompts]
        ids = np.full((b, longest), self.pad_id, np.int64)
        for r, p in enumerate(prompts):
            ids[r, pads[r]:] = p
        positions = np.maximum(np.arange(longest)[None] - np.asarray(pads)[:, None], 0)
        last, keys, values = self._prompt_run(ids, positions, step_bias(self.cfg, pads, 0, longest))
        bucket = self.CACHE_BUCKET
        # the cache holds what can be generated: the request, but never past the model's window (generation
        # stops there), so a huge --max-new-tokens cannot allocate more than one window of keys and values
        needed = self.virtual + min(longest + cfg.max_new_tokens, limit + min(pads) + 1)
        keys, values = self._fixed_cache(keys, values, -(-needed // bucket) * bucket)
        rng = np.random.default_rng(cfg.seed)
        counts = np.zeros((b, vocab), np.int64)
        seen = np.zeros((b, vocab), bool)       # the prompt's ids and the generated ones (repetition_penalty)
        for r, p in enumerate(prompts):
            seen[r, [t for t in p if 0 <= t < vocab]] = True
        out: List[List[int]] = [[] for _ in range(b)]
        done = [False] * b
        length = longest
        for _ in range(cfg.max_new_tokens):
            nxt = np.zeros((b, 1), np.int64)
            for r in range(b):
                if done[r]:
                    nxt[r, 0] = self.pad_id
                    continue
                tok = sample_next(last[r], cfg, rng, vocab, counts[r], seen[r])
                if tok in stop_ids:
                    done[r] = True
                    nxt[r, 0] = self.pad_id
                    continue
                out[r].append(tok)
                counts[r, tok] += 1
                seen[r, tok] = True
                nxt[r, 0] = tok
                if on_token is not None:
                    on_token(r, tok)
                if stop is not None and stop(r, out[r]):
                    done[r] = True
            if all(done) or length - min(pads) >= limit:
                break
            positions = (length - np.asarray(pads))[:, None]
            logits, keys, values = self._decode_run(nxt, positions, step_bias(self.cfg, pads, length, 1), length,
                                                    keys, values)
            last = logits[:, -1]
            length += 1
        return out


#: naohai's sampling when neither the command line nor the model's generation_config.json sets it
NAOHAI_SAMPLING = {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "repetition_penalty": 1.0}
#: transformers' GenerationConfig defaults for what a generation_config.json with ``do_sample: true`` leaves out
_HF_SAMPLING = {"temperature": 1.0, "top_k": 50, "top_p": 1.0}


def sampling_defaults(tokenizer) -> Tuple[Dict[str, Any], Optional[str]]:
    """``({temperature, top_k, top_p, repetition_penalty}, note)``: what the model folder's
    ``generation_config.json`` (beside a Hugging Face tokenizer) asks for, as transformers' ``generate`` reads
    it -- greedy unless ``do_sample`` is true, then its ``temperature`` / ``top_k`` / ``top_p`` (transformers'
    defaults where it leaves one out), and in both its ``repetition_penalty`` (1, off, when left out) -- with
    a note saying so; naohai's own settings and no note without such a file.  A value of the wrong kind exits
    2 naming the file and key."""
    gen = getattr(tokenizer, "generation", None) or {}
    if not gen:
        return dict(NAOHAI_SAMPLING), None
    where = _generation_file(tokenizer)
    sample = gen.get("do_sample", False)
    if not isinstance(sample, bool):
        raise UserError(f"must be true or false, got {sample!r}", where=where, key="do_sample")
    penalty = repetition_penalty_of(tokenizer)
    also = f", repetition penalty {penalty:g}" if penalty != 1.0 else ""
    if not sample:
        return ({"temperature": 0.0, "top_k": 0, "top_p": 1.0, "repetition_penalty": penalty},
                f"greedy, as {where} asks (no do_sample: true){also}")
    out = {key: _setting(gen, key, default, where) for key, default in _HF_SAMPLING.items()}
    out["repetition_penalty"] = penalty
    return out, (f"sampling as {where} asks: temperature {out['temperature']:g}, top-k {out['top_k']}, "
                 f"top-p {out['top_p']:g}{also}")


def repetition_penalty_of(tokenizer) -> float:
    """The ``repetition_penalty`` of the generation_config.json beside a Hugging Face tokenizer (1, off, without
    one or when it leaves it out), which transformers' ``generate`` applies to greedy search too."""
    gen = getattr(tokenizer, "generation", None) or {}
    return _setting(gen, "repetition_penalty", 1.0, _generation_file(tokenizer)) if gen else 1.0


def _generation_file(tokenizer) -> str:
    return os.path.join(os.path.dirname(tokenizer.path or "."), "generation_config.json")


def _setting(gen: Dict[str, Any], key: str, default: Any, where: str) -> Any:
    """One sampling setting of a generation_config.json (``default`` where it is left out or null), checked."""
    value = gen.get(key, default)
    value = default if value is None else value
    numeric = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    kinds = {"top_k": ("a whole number >= 0", lambda v: float(v).is_integer() and v >= 0),
             "top_p": ("a number in (0, 1]", lambda v: 0.0 < v <= 1.0),
             "repetition_penalty": ("a finite number > 0", lambda v: v > 0)}
    kind, ok = kinds.get(key, ("a finite number >= 0", lambda v: v >= 0))
    if not (numeric and ok(value)):
        raise UserError(f"{value!r} is not {kind}", where=where, key=key, rule="generation_config sampling")
    return int(value) if key == "top_k" else float(value)


class Generator:
    def __init__(self, checkpoint: str, device: Optional[str] = None, verify: bool = True):
        import mindspore as ms

        from naohai.checkpoint.weights import load_model
        from naohai.data.tokenizer import Tokenizer
        from naohai.devices import resolve_device

        ms.set_context(mode=ms.PYNATIVE_MODE)
        ms.set_device(resolve_device(device or "auto", where="command line", key="--device"))
        def tokenizer(found):       # a missing tokenizer is said before the weights are read
            self.tokenizer = Tokenizer.load(found.tokenizer_file())
        found, self.model = load_model(checkpoint, verify=verify, before_read=tokenizer)
        recipe, self.step = found.recipe, found.step
        self.conversational = recipe.data.format == "sft"      # trained on rendered conversations
        self.cfg = recipe.model
        self.model.set_train(False)
        self.decoder = CachedDecoder(self.model, self.cfg, pad_id=self.tokenizer.pad_id)

    def _ids(self, prompts: Sequence[str], chat: bool = False, system: Optional[str] = None) -> List[List[int]]:
        """Each prompt's ids: its text, or with ``chat`` a user turn (after ``system``'s turn) rendered as
        supervised fine-tuning renders conversations (:func:`naohai.data.sft.prompt_ids`)."""
        if chat:
            from naohai.data.sft import prompt_ids
            head = [{"role": "system", "content": system}] if system else []
            return [prompt_ids(head + [{"role": "user", "content": p}], self.tokenizer) for p in prompts]
        ids = [self.tokenizer.encode(p) if p else [] for p in prompts]
        return [x or [self.tokenizer.eod_id] for x in ids]

    def window_notes(self, prompts: Sequence[str], max_new_tokens: int, chat: bool = False,
                     system: Optional[str] = None) -> List[str]:
        """What the model's window will cut, said before generating: a prompt longer than the window is read
        from its end, and generation stops once the longest prompt's row fills the window."""
        limit = self.cfg.positions - self.decoder.virtual
        lengths = [len(x) for x in self._ids(prompts, chat, system)]
        notes = [f"prompt {i} has {n} tokens, more than the model's window of {limit} positions holds: only "
                 f"its last {limit - 1} are read" for i, n in enumerate(lengths, 1) if n > limit - 1]
        room = limit - min(max(lengths), limit - 1) + 1
        if max_new_tokens > room:
            notes.append(f"--max-new-tokens {max_new_tokens}: at most {room} new tokens fit the model's window of "
                         f"{limit} positions after the longest prompt, so generation stops there")
        return notes

    def generate_batch(self, prompts: Sequence[str], cfg: SamplingConfig,
                       stream: Optional[Callable[[int, str], None]] = None, chat: bool = False,
                       system: Optional[str] = None) -> List[str]:
        """The new text of each prompt (up to one of the tokenizer's ``stop_ids`` -- EOD, and for a Hugging Face
        folder its generation_config.json's ``eos_token_id`` -- or ``cfg.max_new_tokens``); ``chat`` / ``system``
        as for :meth:`_ids`."""
        ids = self._ids(prompts, chat, system)
        on_token = None if stream is None else (lambda row, tok: stream(row, self.tokenizer.decode([tok])))
        new = self.decoder.generate_ids(ids, cfg, self.tokenizer.vocab_size, self.tokenizer.stop_ids, on_token)
        return [self.tokenizer.decode(x) for x in new]

    def generate(self, prompt: str, cfg: SamplingConfig) -> str:
        return self.generate_batch([prompt], cfg)[0]

    def reply(self, messages: Sequence[Dict[str, str]], cfg: SamplingConfig,
              stream: Optional[Callable[[str], None]] = None,
              note: Callable[[str], None] = lambda _text: None) -> str:
        """The assistant's next turn after the conversation ``messages`` (a system turn first
        or none, then user and assistant turns, the last one the user's), rendered as supervised fine-tuning
        rendered conversations (:func:`naohai.data.sft.prompt_ids`), as transformers' chat pipelines ask it
        (the answers so far as their decoded text; the command keeps them without trailing line breaks).  Where
        the rendered conversation and ``cfg.max_new_tokens`` do not fit the model's window, the oldest turns
        after the system turn are left out, a user turn with the answer after it at a time, down to the last
        user turn; a prompt still longer than the window is read from its end.  ``note`` is told what is cut,
        before the answer is generated."""
        from naohai.data.sft import prompt_ids
        head = list(messages[:1]) if messages and messages[0].get("role") == "system" else []
        body = list(messages[len(head):])
        limit = self.cfg.positions - self.decoder.virtual
        ids = prompt_ids(head + body, self.tokenizer)
        left_out = 0
        while len(ids) + cfg.max_new_tokens > limit and len(body) > 1:
            cut = 2 if len(body) > 2 and body[1].get("role") == "assistant" else 1
            body, left_out = body[cut:], left_out + cut
            ids = prompt_ids(head + body, self.tokenizer)
        if left_out:
            note(f"the conversation and --max-new-tokens {cfg.max_new_tokens} outgrow the model's window of {limit} "
                 f"positions: its first {left_out} turn(s) after the system turn are left out of this answer's prompt")
        if len(ids) > limit - 1:
            note(f"this turn's prompt has {len(ids)} tokens, more than the model's window of {limit} positions "
                 f"holds: only its last {limit - 1} are read")
        on_token = None if stream is None else (lambda _row, tok: stream(self.tokenizer.decode([tok])))
        new = self.decoder.generate_ids([ids], cfg, self.tokenizer.vocab_size, self.tokenizer.stop_ids, on_token)[0]
        return self.tokenizer.decode(new)
