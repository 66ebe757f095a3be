"""`naohai eval MODEL [--ids FILE.npy | --text FILE] [--json]`: mean loss and perplexity."""
from __future__ import annotations


def register(sub) -> None:
    p = sub.add_parser("eval", help="mean loss / perplexity of a model on token ids or text")
    p.add_argument("model", help="an imported model folder (see `naohai ckpt import`)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--ids", help=".npy of token ids: a 1-D stream or [n, seq_length + 1] windows")
    src.add_argument("--text", help="UTF-8 text file, encoded with the recipe's data.tokenizer")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(run=run)


def _ids_from_text(path, recipe):
    import numpy as np

    from naohai.data.tokenizer import Tokenizer
    from naohai.errors import UserError

    if not recipe.data.tokenizer:
        raise UserError("--text needs the recipe's data.tokenizer (a sentencepiece model)", where=path)
    try:
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError(f"cannot be read as UTF-8 text ({exc})", where=path) from None
    return np.asarray(Tokenizer.load(recipe.data.tokenizer).encode(text), np.int64)


def run(args) -> int:
    import json

    import numpy as np
    import mindspore as ms

    from naohai.convert.model_dir import load_model_dir
    from naohai.convert.weights import assign_weights
    from naohai.errors import UserError
    from naohai.evaluate import evaluate, windows_of
    from naohai.model.transformer import NaohaiLM

    if args.batch <= 0:
        raise UserError("must be a positive integer", where="command line", key="--batch")
    recipe, weights = load_model_dir(args.model)
    if args.ids:
        try:
            ids = np.load(args.ids)
        except (OSError, ValueError) as exc:
            raise UserError(f"is not a readable .npy array ({exc})", where=args.ids) from None
        where = args.ids
    else:
        ids, where = _ids_from_text(args.text, recipe), args.text
    windows = windows_of(ids, recipe.model, where)
    ms.set_device("CPU")
    model = NaohaiLM(recipe.model)
    assign_weights(model, weights, where=args.model)
    model.set_train(False)
    result = evaluate(model, recipe.model, windows, args.batch)
    if args.json:
        print(json.dumps(result.to_dict()))
    else:
        print(f"loss {result.loss:.6f}  perplexity {result.perplexity:.4f}  "
              f"({result.tokens} tokens in {result.windows} windows)")
    return 0
