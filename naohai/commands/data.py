"""`naohai data ...`: clean and mix raw corpora, score them, train a tokenizer, prepare packed shards, show a prepared dir."""
from __future__ import annotations

import os
import sys

from naohai.errors import UserError


def _log(msg: str) -> None:
    print(f"naohai data: {msg}", file=sys.stderr)


def register(subparsers) -> None:
    p = subparsers.add_parser("data", help="clean and mix corpora, train a tokenizer, prepare packed token shards")
    sub = p.add_subparsers(dest="data_command", metavar="ACTION", parser_class=type(p))

    c = sub.add_parser("clean", help="normalise, filter, de-identify and deduplicate raw .jsonl/.txt(.gz) "
                                     "into cleaned .jsonl shards and report.json (resumable)")
    c.add_argument("inputs", nargs="*", metavar="INPUT", help="files, directories or globs")
    c.add_argument("--out", help="output directory (re-running with the same inputs and config resumes)")
    c.add_argument("--config", default=None, help="YAML file with the steps' settings (default: all defaults)")
    c.add_argument("--workers", type=int, default=None, help="processes (default: all cores)")
    c.add_argument("--restart", action="store_true", help="discard an earlier run in --out with another "
                                                         "config or other inputs")
    c.add_argument("--print-config", action="store_true", help="print the effective config as YAML and exit")
    c.add_argument("--no-progress", action="store_true", help="no progress bars")
    c.set_defaults(run=run_clean)

    m = sub.add_parser("mix", help="mix cleaned sources by weight (with epoch caps) into a mixture.json "
                                   "that `data prepare` takes as a corpus source")
    m.add_argument("sources", nargs="+", metavar="PATH:WEIGHT[:MAX_EPOCHS]",
                   help="a clean output dir, .jsonl file or glob; its byte share; repetition cap (default 1)")
    m.add_argument("--out", required=True, help="mixture file to write, e.g. data/mixture.json")
    m.add_argument("--seed", type=int, default=0, help="seed of the order (default 0)")
    m.add_argument("--text-key", default="text", help="key of the text in the sources (default 'text')")
    m.set_defaults(run=run_mix)

    t = sub.add_parser("tokenizer", help="train a sentencepiece BPE tokenizer")
    t.add_argument("recipe", nargs="?", help="recipe file or name (corpus, vocab size, jieba, output_dir)")
    t.add_argument("overrides", nargs="*", help="dotted recipe overrides, e.g. model.vocab_size=1024")
    t.add_argument("--corpus", nargs="+", metavar="SOURCE", help="corpus sources (instead of the recipe's)")
    t.add_argument("--jsonl-key", default=None, help="key of the text in .jsonl files (default 'text')")
    t.add_argument("--vocab-size", type=int, default=None, help="number of pieces (default model.vocab_size)")
    t.add_argument("--out", default=None, help="output prefix; writes PREFIX.model "
                                              "(default <train.output_dir>/tokenizer)")
    t.add_argument("--jieba", action="store_true", default=None, help="PanGu-style jieba pre-splitting")
    t.add_argument("--force", action="store_true", help="replace an existing PREFIX.model")
    t.set_defaults(run=run_tokenizer)

    q = sub.add_parser("prepare", help="tokenize the recipe's corpus into packed train/valid shards")
    q.add_argument("recipe", help="recipe file or name")
    q.add_argument("overrides", nargs="*", help="dotted recipe overrides, e.g. model.seq_length=256")
    q.add_argument("--out", default=None, help="directory (default data.prepared_dir or <output_dir>/data)")
    q.add_argument("--overwrite", action="store_true", help="rebuild, replacing shards made with another "
                                                            "tokenizer or seq_length")
    q.add_argument("--no-progress", action="store_true", help="no progress bar")
    q.set_defaults(run=run_prepare)

    i = sub.add_parser("info", help="show a prepared directory and its first window, decoded")
    i.add_argument("dir", help="prepared data directory")
    i.set_defaults(run=run_info)

    p.set_defaults(run=lambda args: (p.print_help(), 2)[1])


def run_clean(args) -> int:
    from naohai.data.clean import clean, report_table
    from naohai.data.clean_config import load_clean_config

    cfg = load_clean_config(args.config)
    if args.print_config:
        import yaml
        print(yaml.safe_dump(cfg.to_dict(), sort_keys=False, allow_unicode=True), end="")
        return 0
    if not args.inputs or not args.out:
        raise UserError("give INPUT... and --out DIR", where="command line")
    if args.workers is not None and args.workers < 1:
        raise UserError("must be >= 1", where="command line", key="--workers")
    report = clean(args.inputs, args.out, cfg, workers=args.workers, progress=not args.no_progress,
                   restart=args.restart)
    print(report_table(report))
    problems = report["read"]["problems"]
    for item in problems["listed"][:20]:
        print(f"  malformed: {item['where']}: {item['reason']}")
    if problems["total"] > 20:
        print(f"  ... {problems['total'] - 20} more in {os.path.join(args.out, 'report.json')}")
    return 0


def run_mix(args) -> int:
    from naohai.data.mix import build_mixture, parse_source_spec

    if not args.out.endswith(".json"):
        raise UserError("must end in .json (data.corpus recognises mixtures by it)", where="command line",
                        key="--out")
    desc = build_mixture([parse_source_spec(s) for s in args.sources], args.out, args.seed, args.text_key)
    print(f"wrote {args.out}: {desc['documents']} documents, seed {desc['seed']}")
    for s in desc["sources"]:
        print(f"  {s['path']}: share {s['share']:.3f}, {s['taken']} of {s['documents']} documents "
              f"({s['epochs']:.2f} epochs, cap {s['max_epochs']})")
    return 0


def run_tokenizer(args) -> int:
    from naohai.config import load_recipe
    from naohai.data.corpus import iter_documents
    from naohai.data.tokenizer import train_tokenizer

    recipe = load_recipe(args.recipe, args.overrides) if args.recipe else None
    if recipe is None and args.overrides:
        raise UserError("overrides need a recipe", where="command line")
    corpus = args.corpus or (recipe.data.corpus if recipe else None)
    vocab = args.vocab_size or (recipe.model.vocab_size if recipe else None)
    out = args.out or (os.path.join(recipe.train.output_dir, "tokenizer") if recipe else None)
    jieba = bool(args.jieba) if args.jieba is not None else bool(recipe and recipe.data.jieba)
    key = args.jsonl_key or (recipe.data.jsonl_key if recipe else "text")
    missing = [flag for flag, v in (("--corpus", corpus), ("--vocab-size", vocab), ("--out", out)) if not v]
    if missing:
        raise UserError(f"without a recipe, give {', '.join(missing)}", where="command line")
    path = out if out.endswith(".model") else out + ".model"
    if os.path.exists(path) and not args.force:
        raise UserError("exists; pass --force to replace it (shards prepared with it would need "
                        "preparing again)", where=path)
    tok = train_tokenizer(iter_documents(corpus, key), vocab, path, jieba=jieba)
    print(f"wrote {tok.path}: {tok.vocab_size} pieces, scheme {tok.scheme}, eod id {tok.eod_id}, "
          f"pad id {tok.pad_id}")
    return 0


def run_prepare(args) -> int:
    from naohai.config import load_recipe
    from naohai.data.pipeline import ensure_prepared
    from naohai.data.prepare import load_prepared

    recipe = load_recipe(args.recipe, args.overrides)
    out_dir, tok = ensure_prepared(recipe, progress=not args.no_progress, out_dir=args.out,
                                   overwrite=args.overwrite, log=_log)
    prep = load_prepared(out_dir)
    print(_summary(prep))
    return 0


def _summary(prep) -> str:
    m = prep.meta
    lines = [f"{prep.path}: seq_length {m['seq_length']}, dtype {m['dtype']}, "
             f"tokenizer {m['tokenizer']['path']} ({m['tokenizer']['vocab_size']} pieces)"]
    for split, info in m["splits"].items():
        lines.append(f"  {split}: {info['documents']} documents, {info['tokens']} tokens, "
                     f"{info['windows']} windows")
    return "\n".join(lines)


def run_info(args) -> int:
    from naohai.data.prepare import load_prepared
    from naohai.data.tokenizer import Tokenizer

    prep = load_prepared(args.dir)
    print(_summary(prep))
    path = prep.meta["tokenizer"]["path"]
    if path and os.path.exists(path):
        tok = Tokenizer.load(path)
        print("first training window, decoded:")
        print(repr(tok.decode(prep.window("train", 0))))
    return 0
