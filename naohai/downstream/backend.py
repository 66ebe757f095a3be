"""The ``naohai`` model of lm-evaluation-harness (``pip install -e ".[eval]"``).

Importing this module registers :class:`NaohaiEvalLM` under the name ``naohai`` in lm-eval's model
registry.  lm-eval 0.4 finds models only through its own table (no plugin entry points), so its
``lm_eval`` command cannot see it; ``naohai lm-eval ARGS`` runs lm-eval's own command line (every
flag of it, ``--log_samples`` included) with the model registered, and ``naohai eval RUN --tasks``
runs tasks through :mod:`naohai.downstream.tasks`.

Model arguments (``--model_args``): ``path`` (a run folder, a checkpoint folder or an imported
model, as ``naohai eval`` reads them), ``tokenizer`` (a tokenizer file, default the model's),
``max_gen_toks`` (default 256).  ``batch_size`` (lm-eval's own flag) sets the rows of the one
compiled scoring graph; ``auto`` means 16.

Requests are answered by :class:`naohai.downstream.engine.Scorer`: ``loglikelihood`` with the
tokenisation of lm-eval's ``TemplateLM`` (context and continuation encoded together, trailing
spaces moved to the continuation, an empty context replaced by the prefix id), ``loglikelihood_rolling``
over lm-eval's disjoint rolling windows of ``seq_length`` tokens after the prefix id (EOD, which joins
naohai's documents; for a recipe with ``data.add_special_tokens`` texts are encoded as ``tokenizer(text)``
and the prefix is the BOS its documents start with, as lm-eval's ``hf`` model does by default for such
a tokenizer: :func:`naohai.downstream.engine.text_encoding`),
``generate_until`` greedily (sampling arguments are refused) up to ``max_gen_toks`` tokens, the
text cut at the first stop string.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

from lm_eval import utils as lm_utils
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text

from naohai.data.hf_tokenizer import HFTokenizer
from naohai.downstream.engine import Scorer
from naohai.errors import UserError

DEFAULT_BATCH = 16
#: what lm-eval itself adds to a model's arguments beside those naohai reads (``simple_evaluate``'s
#: ``additional_config``): accepted, not used -- naohai's batches are what ``batch_size`` says
LM_EVAL_OWN = frozenset({"max_batch_size"})


def _batch(value: Any) -> int:
    if value is None or str(value).startswith("auto"):
        return DEFAULT_BATCH
    try:
        batch = int(value)
    except (TypeError, ValueError):
        batch = 0
    if batch <= 0:
        raise UserError(f"must be a positive integer or 'auto', got {value!r}", where="command line",
                        key="--batch_size")
    return batch


@register_model("naohai")
class NaohaiEvalLM(TemplateLM):
    """lm-eval's view of a naohai model (see the module docstring)."""

    def __init__(self, path: Optional[str] = None, tokenizer: Optional[str] = None, batch_size: Any = None,
                 max_gen_toks: Any = 256, device: Optional[str] = None, scorer: Optional[Scorer] = None,
                 tok=None, step: Optional[int] = None, **others: Any):
        super().__init__()
        unknown = sorted(set(others) - LM_EVAL_OWN)
        if unknown:        # a typo such as batch=8 for batch_size=8 was swallowed
            raise UserError(f"the naohai model takes path, tokenizer, batch_size, max_gen_toks and device; "
                            f"{', '.join(unknown)} {'is' if len(unknown) == 1 else 'are'} not among them",
                            where="command line", key="--model_args", rule="known model_args keys")
        if scorer is None:
            if not path:
                raise UserError("the naohai model needs path=RUN_OR_CHECKPOINT", where="command line",
                                key="--model_args")
            from naohai.downstream.tasks import load_scorer
            scorer, tok, step = load_scorer(str(path), tokenizer=tokenizer, batch=_batch(batch_size),
                                            device=_device(device))
        self.scorer = scorer
        self.tok = tok
        self.step = step
        try:
            self.max_gen_toks = int(max_gen_toks)
        except (TypeError, ValueError):
            self.max_gen_toks = 0
        if self.max_gen_toks <= 0:
            raise UserError(f"max_gen_toks must be a positive integer, got {max_gen_toks!r}", where="command line",
                            key="--model_args")

    # ------------------------------------------------------------------ tokenizer
    @property
    def eot_token_id(self) -> int:
        return int(self.tok.eod_id)

    @property
    def prefix_token_id(self) -> int:
        """Before an empty context and each rolling window: the scorer's ``prefix_id`` (EOD, or the BOS the
        model's documents start with)."""
        return self.scorer.prefix_id

    @property
    def max_length(self) -> int:
        return self.scorer.max_length

    def tok_encode(self, string: str, add_special_tokens: Optional[bool] = None, **kwargs) -> List[int]:
        """The text's ids as the model's documents were encoded: with the tokens the tokenizer adds (BOS) where
        the scorer says so, unless asked not to or the text already starts with the prefix token's text, as
        lm-eval's ``hf`` model encodes by default."""
        if not string:
            return []
        if self.scorer.special_tokens and add_special_tokens is not False and \
                not string.startswith(self.tok.decode([self.prefix_token_id])):
            return list(self.tok.encode_documents([string])[0])
        return list(self.tok.encode(string))

    def tok_decode(self, ids: List[int]) -> str:
        return self.tok.decode(list(ids))

    def _generated_text(self, ids: List[int]) -> str:
        """A generation's text as lm-eval's ``hf`` model decodes it: a tokenizer.json's special tokens left out
        (a model that emits its BOS mid-answer); naohai's sentencepiece tokenizers decode as they do."""
        if isinstance(self.tok, HFTokenizer):
            return self.tok.decode(list(ids), skip_special_tokens=True)
        return self.tok_decode(ids)

    # ------------------------------------------------------------------ requests
    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> List[Tuple[float, bool]]:
        pairs = [(ctx, cont) for _, ctx, cont in requests]
        out = self.scorer.loglikelihood(pairs)
        for (key, _, _), answer in zip(requests, out):
            if key is not None:
                self.cache_hook.add_partial("loglikelihood", key, answer)
        return out

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> List[float]:
        windows: List[Tuple[List[int], List[int]]] = []
        owner: List[int] = []
        for i, (text,) in enumerate(req.args for req in requests):
            for ctx, cont in map(lm_utils.make_disjoint_window, lm_utils.get_rolling_token_windows(
                    token_list=self.tok_encode(text), prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length, context_len=1)):
                windows.append((ctx, cont))
                owner.append(i)
        scores = self.scorer.loglikelihood(windows)
        totals = [0.0] * len(requests)
        for i, (logp, _) in zip(owner, scores):
            totals[i] += logp
        for req, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> List[str]:
        groups: Dict[str, List[int]] = {}
        for i, req in enumerate(requests):
            groups.setdefault(repr(sorted(req.args[1].items())), []).append(i)
        out: List[Optional[str]] = [None] * len(requests)
        eos = self.tok_decode([self.eot_token_id])
        for members in groups.values():
            kwargs = normalize_gen_kwargs(dict(requests[members[0]].args[1]), self.max_gen_toks)
            until = handle_stop_sequences(kwargs.pop("until", None), eos=eos or None)
            max_gen = int(kwargs.pop("max_gen_toks"))
            if kwargs.get("do_sample") or float(kwargs.get("temperature") or 0.0) > 0:
                raise UserError(f"the naohai model generates greedily; the task asks for sampling ({kwargs})",
                                where="task generation_kwargs")
            if max_gen >= self.max_length:
                raise UserError(f"max_gen_toks {max_gen} must be below the model's seq_length {self.max_length}",
                                where="task generation_kwargs")
            prompts = [self.tok_encode(requests[i].args[0]) for i in members]
            stop = (lambda ids: any(s and s in self.tok_decode(ids) for s in until)) if until else None
            new = self.scorer.generate(prompts, max_gen, stop=stop)
            for i, ids in zip(members, new):
                text = postprocess_generated_text(self._generated_text(ids), until, None)
                out[i] = text
                self.cache_hook.add_partial("generate_until", requests[i].args, text)
        return out


def _device(value: Optional[str]) -> Optional[str]:
    """lm-eval passes its ``--device`` (default 'cuda' in some versions); naohai names devices its own way."""
    if value is None:
        return None
    low = str(value).lower()
    return {"cpu": "CPU", "gpu": "GPU", "cuda": "auto", "ascend": "Ascend", "npu": "Ascend", "auto": "auto"}.get(
        low.split(":")[0], None) or _bad_device(value)


def _bad_device(value) -> str:
    raise UserError(f"'{value}' is not a device naohai knows (cpu, gpu, ascend, auto)", where="command line",
                    key="--device")
