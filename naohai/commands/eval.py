"""`naohai eval RUN_OR_CHECKPOINT [--ids FILE.npy | --text FILE] [--json]`: mean loss and perplexity.

The model is read by :func:`naohai.generate.load_model`: a run folder (its newest
checkpoint), one checkpoint folder of a run, or an imported model folder
(``naohai ckpt import``).
"""
from __future__ import annotations


def register(sub) -> None:
    p = sub.add_parser("eval", help="mean loss / perplexity of a model on token ids or text")
    p.add_argument("model", help="a run folder (its latest checkpoint), a checkpoint folder, or an imported "
                                 "model folder (see `naohai ckpt import`)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--ids", help=".npy of token ids: a 1-D stream or [n, seq_length + 1] windows")
    src.add_argument("--text", help="UTF-8 text file, encoded with the model's tokenizer")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--device", choices=("auto", "CPU", "GPU", "Ascend"), default="auto",
                   help="device (default auto = Ascend, else GPU, else CPU)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(run=run)


def _ids_from_text(path, tokenizer_file):
    import os

    import numpy as np

    from naohai.data.tokenizer import Tokenizer
    from naohai.errors import UserError

    if not os.path.exists(tokenizer_file):
        raise UserError(f"--text needs the model's tokenizer, and {tokenizer_file} does not exist (set the "
                        f"recipe's data.tokenizer, or give --ids)", where=path)
    try:
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError(f"cannot be read as UTF-8 text ({exc})", where=path) from None
    return np.asarray(Tokenizer.load(tokenizer_file).encode(text), np.int64)


def _read_ids(path):
    import numpy as np

    from naohai.errors import UserError

    try:
        return np.load(path)
    except (OSError, ValueError) as exc:
        raise UserError(f"is not a readable .npy array ({exc})", where=path) from None


def run(args) -> int:
    import json

    import mindspore as ms

    from naohai.errors import UserError
    from naohai.evaluate import evaluate, windows_of
    from naohai.generate import load_model, tokenizer_path
    from naohai.train.device import resolve_device

    if args.batch <= 0:
        raise UserError("must be a positive integer", where="command line", key="--batch")
    ids = _read_ids(args.ids) if args.ids else None
    ms.set_context(mode=ms.PYNATIVE_MODE)
    ms.set_device(resolve_device(args.device, where="command line", key="--device"))
    recipe, model, path, _step = load_model(args.model)
    if ids is None:
        ids = _ids_from_text(args.text, tokenizer_path(recipe, args.model, path))
    windows = windows_of(ids, recipe.model, args.ids or args.text)
    model.set_train(False)
    result = evaluate(model, recipe.model, windows, args.batch)
    if args.json:
        print(json.dumps(result.to_dict()))
    else:
        print(f"loss {result.loss:.6f}  perplexity {result.perplexity:.4f}  "
              f"({result.tokens} tokens in {result.windows} windows)")
    return 0
