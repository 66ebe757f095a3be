"""`naohai data ...`: clean and mix raw corpora, score them, train a tokenizer, prepare packed shards, show a prepared dir."""
from __future__ import annotations

import math
import os
import sys
from typing import Optional

from naohai.errors import UserError
from naohai.validate import cli_int

# --vocab-size: sentencepiece and the byte-level BPE trainer need a few hundred pieces (they say how many);
# 2**24 (16.7 M) is far above any real vocabulary, and a larger number is a typo.
MAX_VOCAB_SIZE = 1 << 24
# --workers: processes; more than this is a typo, and a huge number overflows the pool's C integers.
MAX_WORKERS = 4096
DEFAULT_MASTER = "local[*]"     # --engine spark without --master: every core of this machine


def _log(msg: str) -> None:
    print(f"naohai data: {msg}", file=sys.stderr)


def register(subparsers) -> None:
    p = subparsers.add_parser("data", help="clean and mix corpora, train a tokenizer, prepare packed token shards")
    sub = p.add_subparsers(dest="data_command", metavar="ACTION", parser_class=type(p))

    c = sub.add_parser("clean", help="normalise, filter, de-identify and deduplicate raw .jsonl/.txt(.gz) "
                                     "into cleaned .jsonl shards and report.json (resumable)")
    c.add_argument("inputs", nargs="*", metavar="INPUT", help="files, directories or globs; with --engine spark also hdfs://, obs://, s3a://, file:// paths")
    c.add_argument("--out", help="output directory (re-running with the same inputs and config resumes)")
    c.add_argument("--config", default=None, help="YAML file with the steps' settings (default: all defaults)")
    c.add_argument("--workers", type=cli_int(1, MAX_WORKERS), default=None,
                   help=f"processes, 1 to {MAX_WORKERS} (default: all cores)")
    c.add_argument("--restart", action="store_true", help="discard an earlier run in --out with another "
                                                         "config or other inputs")
    c.add_argument("--print-config", action="store_true", help="print the effective config as YAML and exit")
    c.add_argument("--no-progress", action="store_true", help="no progress bars")
    c.add_argument("--engine", choices=("local", "spark"), default="local",
                   help="local: worker processes on this machine (default); spark: Apache Spark (pip install "
                        "-e \".[spark]\" and a Java runtime), same steps, same output")
    c.add_argument("--master", default=None, help="Spark master URL for --engine spark: local[N], yarn, "
                                                   f"k8s://..., spark://... (default {DEFAULT_MASTER})")
    c.add_argument("--spark-conf", action="append", default=[], metavar="KEY=VALUE",
                   help="a Spark setting for --engine spark (repeatable), e.g. spark.executor.memory=4g")
    c.add_argument("--split-mb", type=float, default=None,
                   help="--engine spark: an uncompressed .jsonl file larger than this is read by several tasks, "
                        "one per range of this size (default: the local .jsonl inputs' size over 16 splits per "
                        "task slot, 1 to 128 MB; Hadoop paths 128; the output does not depend on it)")
    c.set_defaults(run=run_clean)

    s = sub.add_parser("score", help="perplexity of each document under a naohai model; keep those under a "
                                     "threshold (cleaned .jsonl shards in, .jsonl shards + report.json out)")
    s.add_argument("inputs", nargs="*", metavar="INPUT", help="files, directories or globs (.jsonl/.txt(.gz))")
    s.add_argument("--model", help="a run folder (its latest checkpoint), a checkpoint folder or an imported "
                                   "model folder")
    s.add_argument("--out", help="output directory (re-running with the same inputs, model and settings resumes)")
    keep = s.add_mutually_exclusive_group()
    keep.add_argument("--max-perplexity", type=float, default=None, metavar="X",
                      help="drop documents whose perplexity is above X")
    keep.add_argument("--keep-fraction", type=float, default=None, metavar="F",
                      help="keep the fraction F of the documents with the lowest perplexity")
    s.add_argument("--tokenizer", default=None, help="the model's tokenizer .model (default: the recipe's, "
                                                     "else the one beside the run)")
    s.add_argument("--text-key", default="text", help="key of the text in .jsonl inputs (default 'text')")
    s.add_argument("--batch", type=int, default=8,   # its bounds: ScoreSettings.validate (naohai.data.score)
                   help="windows of seq_length per model call, 1 to 4096 (default 8)")
    s.add_argument("--device", choices=("auto", "CPU", "GPU", "Ascend"), default="auto",
                   help="device (default auto = Ascend, else GPU, else CPU)")
    s.add_argument("--restart", action="store_true", help="discard an earlier run in --out with other inputs, "
                                                         "model or settings")
    s.add_argument("--no-progress", action="store_true", help="no progress bars")
    s.set_defaults(run=run_score)

    m = sub.add_parser("mix", help="mix cleaned sources by weight (with epoch caps) into a mixture.json "
                                   "that `data prepare` takes as a corpus source")
    m.add_argument("sources", nargs="+", metavar="PATH:WEIGHT[:MAX_EPOCHS]",
                   help="a clean output dir, .jsonl file or glob; its byte share; repetition cap (default 1)")
    m.add_argument("--out", required=True, help="mixture file to write, e.g. data/mixture.json")
    m.add_argument("--seed", type=cli_int(0, 2 ** 63 - 1), default=0, help="seed of the order, >= 0 (default 0)")
    m.add_argument("--text-key", default="text", help="key of the text in the sources (default 'text')")
    m.set_defaults(run=run_mix)

    t = sub.add_parser("tokenizer", help="train a sentencepiece BPE or a byte-level BPE (tokenizer.json) tokenizer")
    t.add_argument("recipe", nargs="?", help="recipe file or name (corpus, vocab size, jieba, output_dir)")
    t.add_argument("overrides", nargs="*", help="dotted recipe overrides, e.g. model.vocab_size=1024")
    t.add_argument("--corpus", nargs="+", metavar="SOURCE", help="corpus sources (instead of the recipe's)")
    t.add_argument("--jsonl-key", default=None, help="key of the text in .jsonl files (default 'text')")
    t.add_argument("--vocab-size", type=cli_int(1, MAX_VOCAB_SIZE), default=None,
                   help="number of pieces (default model.vocab_size)")
    t.add_argument("--out", default=None, help="output prefix; writes PREFIX.model, or PREFIX.json for byte_bpe "
                                              "(default <train.output_dir>/tokenizer)")
    t.add_argument("--type", dest="tokenizer_type", choices=("sentencepiece", "byte_bpe"), default=None,
                   help="what to train (default data.tokenizer_type, else sentencepiece)")
    t.add_argument("--jieba", action="store_true", default=None, help="PanGu-style jieba pre-splitting")
    t.add_argument("--force", action="store_true", help="replace an existing PREFIX.model / PREFIX.json")
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
    i.add_argument("--held-out-text", metavar="FILE",
                   help="also write the held-out split, decoded, to FILE (one document after another, a blank "
                        "line between them): text the run never trained on, e.g. for `naohai eval --text`. FILE is "
                        "never replaced; one that holds this split already is left as it is (a rerun)")
    i.set_defaults(run=run_info)

    p.set_defaults(run=lambda args: (p.print_help(), 2)[1])


def _refuse_engine_strays(args) -> None:
    """Exit 2 for a flag the chosen run of `data clean` would not read: Spark's flags with the local engine,
    --workers with Spark (its task slots come from --master), the run's flags with --print-config."""
    if args.print_config:
        stray = [f for f, given in (("INPUT", bool(args.inputs)), ("--out", args.out is not None),
                                    ("--workers", args.workers is not None), ("--restart", args.restart)) if given]
        why = "--print-config prints the effective config and exits, cleaning nothing"
    elif args.engine == "spark":
        stray = ["--workers"] if args.workers is not None else []
        why = "with --engine spark the task slots come from --master (local[N] or the cluster's executors)"
    else:
        stray = [f for f, given in (("--master", args.master is not None), ("--spark-conf", bool(args.spark_conf)),
                                    ("--split-mb", args.split_mb is not None)) if given]
        why = "they are --engine spark's, and this run uses the local engine"
    if stray:
        raise UserError(f"{', '.join(stray)} would be ignored: {why}. Drop {'it' if len(stray) == 1 else 'them'}",
                        where="command line", key=stray[0], rule="flags of the chosen engine")


def run_clean(args) -> int:
    from naohai.data.clean import clean, report_table
    from naohai.data.clean_config import load_clean_config

    _refuse_engine_strays(args)
    cfg = load_clean_config(args.config)
    if args.print_config:
        import yaml
        print(yaml.safe_dump(cfg.to_dict(), sort_keys=False, allow_unicode=True), end="")
        return 0
    if not args.inputs or not args.out:
        raise UserError("give INPUT... and --out DIR", where="command line")
    lm_factory = None
    if cfg.perplexity.enabled:
        pp = cfg.perplexity
        if not os.path.exists(pp.model):
            raise UserError(f"{pp.model} does not exist; give a naohai run, checkpoint or model folder",
                            where=cfg.source, key="perplexity.model")

        def lm_factory():
            return load_scorer(pp.model, pp.tokenizer, pp.device, where=cfg.source,
                               keys=("perplexity.model", "perplexity.tokenizer", "perplexity.device"))
    if args.engine == "spark":
        from naohai.data.spark_engine import clean_spark
        conf = {}
        for item in args.spark_conf:
            key, sep, value = item.partition("=")
            if not sep or not key.strip():
                raise UserError(f"{item!r} is not KEY=VALUE", where="command line", key="--spark-conf")
            conf[key.strip()] = value.strip()
        if args.split_mb is not None and (not math.isfinite(args.split_mb)
                                          or not 0 < args.split_mb * (1 << 20) < 1 << 62):
            raise UserError(f"must be a size in MB above 0, got {args.split_mb:g}", where="command line",
                            key="--split-mb")
        report = clean_spark(args.inputs, args.out, cfg, master=args.master or DEFAULT_MASTER, conf=conf,
                             restart=args.restart,
                             progress=not args.no_progress, split_bytes=(None if args.split_mb is None
                                                        else max(1, int(args.split_mb * (1 << 20)))),
                             lm_factory=lm_factory)
        print(report_table(report))
        _print_problems(report, args.out)
        return 0
    report = clean(args.inputs, args.out, cfg, workers=args.workers, progress=not args.no_progress,
                   restart=args.restart, lm_factory=lm_factory)
    print(report_table(report))
    _print_problems(report, args.out)
    return 0


def load_scorer(model: str, tokenizer: Optional[str] = None, device: str = "auto", *,
                where: Optional[str] = None, keys=("--model", "--tokenizer", "--device")):
    """A :class:`naohai.data.score.LM` from a run / checkpoint / model folder and its tokenizer.

    Mistakes name ``keys`` (the flags, or a config file's keys with ``where`` the file)."""
    import mindspore as ms

    from naohai.data.pipeline import encodes_special_tokens
    from naohai.data.score import LM
    from naohai.data.tokenizer import Tokenizer
    from naohai.evaluate import token_nll_fn
    from naohai.checkpoint.weights import load_model
    from naohai.devices import resolve_device

    if not os.path.exists(model):
        raise UserError(f"{model} does not exist; give a run folder, a checkpoint folder or an imported model "
                        f"folder", where=where or "command line", key=keys[0])
    if tokenizer is not None and not os.path.isfile(tokenizer):
        raise UserError(f"{tokenizer} is not a file; give the model's tokenizer .model",
                        where=where or "command line", key=keys[1])
    ms.set_context(mode=ms.PYNATIVE_MODE)
    ms.set_device(resolve_device(device, where=where or "command line", key=keys[2]))
    loaded = {}

    def load_tokenizer(found):      # before the weights are read: a missing or wrong tokenizer fails at once
        tok_path = tokenizer or found.tokenizer_file()
        if not os.path.isfile(tok_path):
            raise UserError(f"the tokenizer of {model}, {tok_path}, does not exist; give it", where=where or model,
                            key=keys[1])
        tok = Tokenizer.load(tok_path, key=keys[1])
        if tok.vocab_size > found.recipe.model.vocab_size:
            raise UserError(f"{tok_path} has {tok.vocab_size} pieces, more than the model's vocabulary of "
                            f"{found.recipe.model.vocab_size}; give the tokenizer the model was trained with",
                            where=where or "command line", key=keys[1])
        loaded.update(tok=tok, path=tok_path)
    found, net = load_model(model, before_read=load_tokenizer)
    recipe, path, step = found.recipe, found.checkpoint, found.step
    tok, tok_path, cfg = loaded["tok"], loaded["path"], recipe.model
    net.set_train(False)
    describe = {"model": os.path.abspath(model), "checkpoint": path and os.path.abspath(path),
                "step": step, "tokenizer": os.path.abspath(tok_path), "tokenizer_sha256": tok.sha256,
                "seq_length": cfg.seq_length, "loss_pad_id": cfg.loss_pad_id}
    encode = tok.encode_batch
    if encodes_special_tokens(recipe, tok):
        describe["add_special_tokens"] = True      # only then: plans written before the key stay valid

        def encode(texts):
            """Documents as the model's own were encoded (tokenizer(text), BOS first); scoring adds the EOD."""
            return [ids[:-1] if ids and ids[-1] == tok.eod_id else ids for ids in tok.encode_documents(texts)]
    return LM(nll=token_nll_fn(net), encode_batch=encode,
              seq_length=cfg.seq_length, eod_id=tok.eod_id, pad_id=tok.pad_id if tok.pad_id >= 0 else tok.eod_id,
              loss_pad_id=cfg.loss_pad_id, describe=describe)


def run_score(args) -> int:
    from naohai.data.reader import resolve_inputs
    from naohai.data.rundir import refuse_input_overlap
    from naohai.data.score import ScoreSettings, report_table, score

    settings = ScoreSettings(text_key=args.text_key, max_perplexity=args.max_perplexity,
                             keep_fraction=args.keep_fraction, batch=args.batch).validate()
    if not args.model:
        raise UserError("give the model to score with", where="command line", key="--model")
    if not args.out:
        raise UserError("give the output directory", where="command line", key="--out")
    files = resolve_inputs(args.inputs)      # bad inputs, and an --out among them, before the model is loaded
    refuse_input_overlap(args.out, args.inputs, files, "naohai data score")
    lm = load_scorer(args.model, args.tokenizer, args.device)
    report = score(args.inputs, args.out, lm, settings, progress=not args.no_progress, restart=args.restart)
    print(report_table(report))
    _print_problems(report, args.out)
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
    # a flag given empty is a mistake, never "use the default": `--out ""` fell back to the run's own
    # tokenizer and, with --force, replaced it
    for flag, value in (("--out", args.out), ("--jsonl-key", args.jsonl_key)):
        if value is not None and not value.strip():
            raise UserError("must not be empty", where="command line", key=flag, rule="a non-empty value")
    corpus = args.corpus if args.corpus is not None else (recipe.data.corpus if recipe else None)
    vocab = args.vocab_size if args.vocab_size is not None else (recipe.model.vocab_size if recipe else None)
    out = args.out if args.out is not None else (os.path.join(recipe.train.output_dir, "tokenizer")
                                                 if recipe else None)
    jieba = bool(args.jieba) if args.jieba is not None else bool(recipe and recipe.data.jieba)
    key = args.jsonl_key if args.jsonl_key is not None else (recipe.data.jsonl_key if recipe else "text")
    missing = [flag for flag, v in (("--corpus", corpus), ("--vocab-size", vocab), ("--out", out)) if not v]
    if missing:
        raise UserError(f"without a recipe, give {', '.join(missing)}", where="command line")
    vocab_key = "--vocab-size" if args.vocab_size is not None else "model.vocab_size"
    kind = args.tokenizer_type or (recipe.data.tokenizer_type if recipe else "sentencepiece")
    suffix = ".json" if kind == "byte_bpe" else ".model"
    path = out if out.endswith(suffix) else out + suffix
    if os.path.exists(path) and not args.force:
        raise UserError("exists; pass --force to replace it (shards prepared with it would need "
                        "preparing again)", where=path)
    if kind == "byte_bpe":
        if jieba:
            raise UserError("jieba pre-splitting is for sentencepiece tokenizers", where="command line", key="--jieba")
        from naohai.data.hf_tokenizer import train_byte_bpe
        tok = train_byte_bpe(iter_documents(corpus, key), vocab, path, key=vocab_key)
    else:
        tok = train_tokenizer(iter_documents(corpus, key), vocab, path, jieba=jieba, key=vocab_key)
    print(f"wrote {tok.path}: {tok.vocab_size} pieces, scheme {tok.scheme}, eod id {tok.eod_id}, "
          f"pad id {tok.pad_id}")
    return 0


def run_prepare(args) -> int:
    from naohai.config import load_recipe
    from naohai.data.pipeline import ensure_prepared
    from naohai.data.prepared_dir import open_prepared

    recipe = load_recipe(args.recipe, args.overrides)
    out_dir, tok = ensure_prepared(recipe, progress=not args.no_progress, out_dir=args.out,
                                   overwrite=args.overwrite, log=_log)
    prep = open_prepared(out_dir)
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
    from naohai.data.prepared_dir import open_prepared
    from naohai.data.tokenizer import Tokenizer

    held_out = args.held_out_text
    if held_out is not None and not os.path.isfile(held_out):
        _check_new_file(held_out, "--held-out-text")       # an existing file is compared with the text below
    prep = open_prepared(args.dir)
    path = prep.meta["tokenizer"]["path"]
    tok = Tokenizer.load(path) if path and os.path.exists(path) else None
    if held_out is not None:
        if tok is None:
            raise UserError(f"--held-out-text needs the tokenizer the data was made with, and {path} does not "
                            f"exist", where=args.dir, key="--held-out-text")
        docs = _split_documents(prep.tokens("valid"), prep.eod_id)
        text = "\n\n".join(tok.decode(doc) for doc in docs) + "\n"
        rerun = _same_text(held_out, text)                   # a rerun: the file already holds this split
        if os.path.lexists(held_out) and not rerun:
            raise UserError("exists and holds other text; give a new file name (it is never replaced)",
                            where=held_out, key="--held-out-text",
                            rule="a new file, or one that holds this held-out split already")
    print(_summary(prep))
    if tok is not None:
        print("first training window, decoded:")
        print(repr(tok.decode(prep.window("train", 0))))
    if held_out is None:
        return 0
    if rerun:
        print(f"held-out split: {len(docs)} documents, already in {held_out} (unchanged)")
        return 0
    try:   # "x": never replaces a file, even one made since the check above
        with open(held_out, "x", encoding="utf-8") as fh:
            fh.write(text)
    except FileExistsError:
        raise UserError("was made by another process while this one ran; it is left as it is", where=held_out,
                        key="--held-out-text", rule="a new file, or one that holds this split already") from None
    except OSError as exc:
        raise UserError(f"cannot be written: {exc.strerror or exc}", where=held_out, key="--held-out-text") from None
    print(f"held-out split: {len(docs)} documents, {int(prep.tokens('valid').size)} tokens -> {held_out}")
    return 0


def _same_text(path: str, text: str) -> bool:
    """Whether the regular file ``path`` holds exactly ``text`` (UTF-8); its size is compared first, so a
    large file that differs is never read."""
    data = text.encode("utf-8")
    try:
        if not os.path.isfile(path) or os.path.getsize(path) != len(data):
            return False
        with open(path, "rb") as fh:
            return fh.read() == data
    except OSError:
        return False


def _check_new_file(path: str, flag: str) -> None:
    """``path`` names a file that does not exist yet, in a folder that does: what a flag that writes a new
    file (and must never replace one: it could be the data it reads) needs."""
    rule = "a new file in an existing folder"
    if not path.strip():
        raise UserError("must not be empty; give a new file name", where="command line", key=flag, rule=rule)
    if os.path.isdir(path):
        raise UserError("is a folder; give a new file name", where=path, key=flag, rule=rule)
    if os.path.lexists(path):
        raise UserError("exists; give a new file name (it is never replaced)", where=path, key=flag, rule=rule)
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise UserError(f"its folder {parent} does not exist (or is not a folder)", where=path, key=flag,
                        rule=rule)
    if not os.access(parent, os.W_OK):
        raise UserError(f"its folder {parent} is not writable", where=path, key=flag, rule=rule)


def _split_documents(ids, eod_id: int):
    """The documents of a packed token stream (joined by EOD), each a list of ids, empty ones left out."""
    docs, current = [], []
    for token in ids.tolist():
        if token == eod_id:
            if current:
                docs.append(current)
            current = []
        else:
            current.append(token)
    if current:
        docs.append(current)
    return docs


def _print_problems(report, out_dir: str, most: int = 20) -> None:
    """The first ``most`` malformed input lines a clean or score run recorded, and how many more."""
    problems = report["read"]["problems"]
    for item in problems["listed"][:most]:
        print(f"  malformed: {item['where']}: {item['reason']}")
    if problems["total"] > most:
        print(f"  ... {problems['total'] - most} more in {os.path.join(out_dir, 'report.json')}")
