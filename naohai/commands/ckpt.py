"""`naohai ckpt inspect|verify|merge|reshard|import|export|merge-adapter`: look at, move and convert checkpoints.

  naohai ckpt inspect CKPT                       step, layout, files, tensors per rank and merged shapes
  naohai ckpt verify CKPT                        manifest, every file's size and SHA-256 (exit 2 if bad)
  naohai ckpt merge CKPT --out DIR               one full checkpoint (for one device, generate, eval)
  naohai ckpt reshard CKPT --to STRATEGY --recipe RECIPE [key=value ...] --out DIR [--compiled WORKDIR]
        the destination's strategy files come from a simulated compile of STRATEGY (run here, or the
        workdir of an earlier `naohai check --compile`), then MindSpore's checkpoint transform
  naohai ckpt import SRC --from pangu-alpha|pengcheng-mind --recipe RECIPE --out DIR [--strategy S]
        a published reference checkpoint -> an imported model folder (model.ckpt + recipe.yaml)
  naohai ckpt import HF_DIR --from hf --out DIR [model.key=value ...]
        a Hugging Face folder (config.json, safetensors shards, tokenizer) -> an imported model folder
        whose recipe comes from config.json (naohai.convert.hf)
  naohai ckpt import --from peft ADAPTER_DIR --base MODEL --out DIR
        a Hugging Face PEFT LoRA folder over a naohai model (run, checkpoint or imported model) -> an
        adapter folder (naohai.checkpoint.adapters) that generate / eval / train.init_from read merged
  naohai ckpt merge-adapter RUN --out DIR
        a fine-tuning run's (or an adapter folder's) LoRA folded into its base: an imported model folder
  naohai ckpt export RUN --to peft --out DIR
        a fine-tuning run's (or an adapter folder's) LoRA as a PEFT folder (adapter_config.json +
        adapter_model.safetensors) for the families transformers knows
  naohai ckpt export CKPT --format safetensors|pangu-alpha|pengcheng-mind --out FILE
        the full model weights, as safetensors or with the reference code's names and layouts
  naohai ckpt export CKPT --to hf --out DIR [--shard-size 5GB]
        a Hugging Face folder: config.json, model.safetensors (or shards + index), tokenizer files

CKPT is a checkpoint folder, a run folder (its newest checkpoint) or, for export, an imported model
folder.
"""
from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

from naohai.commands._args import allow_intermixed
from naohai.convert import FORMATS
from naohai.errors import UserError
from naohai.runfiles import existing_ancestor
from naohai.validate import cli_seconds

DEFAULT_SHARD_SIZE = "5GB"      # --to hf: transformers' own default largest shard


def register(sub) -> None:
    p = sub.add_parser("ckpt", help="inspect, verify, merge, reshard or export a checkpoint")
    actions = p.add_subparsers(dest="action", metavar="ACTION", parser_class=type(p))
    a = actions.add_parser("inspect", help="what a checkpoint holds")
    a.add_argument("checkpoint")
    a.add_argument("--tensors", type=int, default=20, help="model tensors listed (default 20, 0 = all)")
    a.add_argument("--state", action="store_true",
                   help="list the optimizer and training state too (Adam moments, step, loss-scale guard)")
    a = actions.add_parser("verify", help="check every file against the manifest")
    a.add_argument("checkpoint")
    a = actions.add_parser("merge", help="merge a sharded checkpoint into full tensors")
    a.add_argument("checkpoint")
    a.add_argument("--out", required=True, help="new checkpoint folder")
    a.add_argument("--no-verify", action="store_true",
                   help="skip the SHA-256 check of the source's files (sizes are still checked)")
    a = actions.add_parser("reshard", help="move a checkpoint to another strategy")
    a.add_argument("checkpoint")
    a.add_argument("overrides", nargs="*", help="recipe overrides for the destination, e.g. train.micro_batch_size=2")
    a.add_argument("--to", required=True, metavar="STRATEGY", help="destination strategy file")
    a.add_argument("--recipe", help="recipe of the destination (default: the checkpoint's own)")
    a.add_argument("--out", required=True, help="new checkpoint folder")
    a.add_argument("--compiled", metavar="WORKDIR",
                   help="workdir of a `naohai check --compile` of the destination (skips compiling here)")
    a.add_argument("--timeout", type=cli_seconds(), default=1800.0, help="seconds for the destination compile")
    a.add_argument("--no-verify", action="store_true",
                   help="skip the SHA-256 check of the source's files (sizes are still checked)")
    allow_intermixed(a)
    a = actions.add_parser("merge-adapter", help="fold a run's LoRA adapters into its base weights")
    a.add_argument("checkpoint", help="a fine-tuning run, its checkpoint or an adapter folder")
    a.add_argument("--out", required=True, help="new imported model folder")
    a.add_argument("--no-verify", action="store_true",
                   help="skip the SHA-256 check of the source's files (sizes are still checked)")
    a = actions.add_parser("import", help="published reference checkpoint -> imported model folder")
    a.add_argument("src", help="a .ckpt file, a folder with one .ckpt (+ the .npy embedding tables), a "
                               "folder of rank_<n>/ slices (with --strategy), or a PEFT adapter folder")
    a.add_argument("--from", dest="fmt", required=True, choices=FORMATS + ("hf", "peft"))
    a.add_argument("--base", help="peft: the model the adapter was trained on (a naohai run, checkpoint or "
                                  "imported model folder)")
    a.add_argument("--recipe", help="recipe (file or name) whose model the checkpoint holds (reference "
                                    "formats; a Hugging Face folder's config.json gives it)")
    a.add_argument("--strategy", default=None, help="strategy file of the run that wrote sharded slices")
    a.add_argument("--out", required=True, help="new folder for the imported model")
    a.add_argument("overrides", nargs="*", help="dotted recipe overrides, e.g. model.seq_length=2048")
    allow_intermixed(a)
    a = actions.add_parser("export", help="write the full model weights in another format")
    a.add_argument("checkpoint", help="a checkpoint, run folder or imported model folder")
    a.add_argument("--format", "--to", dest="format", choices=("safetensors",) + FORMATS + ("hf", "peft"),
                   default="safetensors", help="safetensors (naohai names), a reference checkpoint layout (.ckpt), "
                                               "hf (a Hugging Face folder) or peft (a fine-tuning run's LoRA "
                                               "adapters as a PEFT folder); --to is the same")
    a.add_argument("--out", required=True, help="output file (a new folder for hf)")
    a.add_argument("--shard-size", default=None, help="hf: largest safetensors shard (bytes, or with KB/MB/GB; "
                                                       f"default {DEFAULT_SHARD_SIZE} as transformers)")
    a.add_argument("--no-verify", action="store_true",
                   help="skip the SHA-256 check of the source's files (sizes are still checked)")
    p.set_defaults(run=run)


def run(args) -> int:
    from naohai.checkpoint import store
    from naohai.convert.model_dir import is_model_dir
    if not getattr(args, "action", None):
        raise UserError("give an action: inspect, verify, merge, reshard, import, export or merge-adapter",
                        where="command line", key="ACTION")
    if getattr(args, "out", None) is not None:
        _new_out(args.out)
    for flag, dest, action, fmt in (("--shard-size", "shard_size", "export", "hf"),
                                    ("--base", "base", "import", "peft")):
        given = getattr(args, "format", None) if action == "export" else getattr(args, "fmt", None)
        if args.action == action and getattr(args, dest, None) is not None and given != fmt:
            via = "--to" if action == "export" else "--from"
            raise UserError(f"{flag} is for `ckpt {action}` {via} {fmt}; with {via} {given} it would be ignored. "
                            f"Drop it", where="command line", key=flag, rule=f"{flag} with {via} {fmt}")
    if args.action == "import":
        return _import(args)
    if args.action == "merge-adapter":
        return _merge_adapter(args)
    if args.action == "export" and args.format == "peft":
        return _export_peft(args)
    if args.action == "export" and is_model_dir(args.checkpoint):
        return _export(args, None)
    path = store.resolve_checkpoint(args.checkpoint)
    return {"inspect": _inspect, "verify": _verify, "merge": _merge, "reshard": _reshard,
            "export": _export}[args.action](args, path)


def _new_out(out: str) -> None:
    """Every action that writes ``--out`` writes a new file or folder: an empty path, one that exists (a file,
    a folder, a link) or one under a file exits 2 before anything is read or written."""
    if not out.strip():
        raise UserError("is empty; give the new file or folder to write", where="command line", key="--out",
                        rule="a new path")
    if os.path.lexists(out):
        raise UserError("already exists; choose a new path (nothing is overwritten)", where=out, key="--out",
                        rule="a new path")
    parent = existing_ancestor(out)
    if not os.path.isdir(parent):
        raise UserError(f"lies under {parent}, which is a file, not a folder", where=out, key="--out",
                        rule="a new path")


def _inspect(args, path) -> int:
    from naohai import ckpt_format
    from naohai.checkpoint import store
    man = store.read_manifest(path)
    layout = man.get("layout") or {}
    print(f"checkpoint {path}")
    print(f"  step {man.get('step')}, saved {man.get('saved_at')}, loss scale {man.get('loss_scale')}, "
          f"versions {man.get('versions')}")
    print(f"  layout: {layout.get('describe')} (signature {layout.get('signature')}, world {layout.get('world')})")
    if man.get("strategy"):
        print(f"  strategy: {man['strategy'].get('name')} ({man['strategy'].get('source')})")
    if man.get("resharded_from"):
        print(f"  resharded from {man['resharded_from']['path']}")
    base = man.get("finetune_base")
    if base:
        print(f"  LoRA adapters only (and their optimizer state) over the base {base.get('describe')}; "
              f"`naohai ckpt merge-adapter` writes the merged model")
    order = _model_tensor_order(man)
    model_names = set(order)
    files = man.get("files") or {}
    print(f"  files: {len(files)}, {sum(int(e.get('bytes', 0)) for e in files.values()) / 1e6:.2f} MB")
    for rank in layout.get("ranks_with_files") or [0]:
        name = store.rank_file(int(rank))
        if store.inside(path, name) is None:
            raise UserError(f"integrity error: {name} resolves outside the checkpoint folder (a symbolic link "
                            f"out); not read", where=path)
        try:        # names, shapes and types from the file's table of contents: no tensor is loaded
            tensors = {e.name: e for e in ckpt_format.entries(os.path.join(path, name))}
        except (OSError, ckpt_format.MalformedCheckpoint) as exc:
            raise UserError(f"integrity error: {name} cannot be read as a checkpoint ({exc}); `naohai ckpt verify "
                            f"{path}` checks every file", where=path) from None
        model = {k: v for k, v in tensors.items() if k in model_names}
        state = {k: v for k, v in tensors.items() if k not in model_names}
        print(f"  {name}: {len(model)} model tensors ({sum(v.size for v in model.values()):,} values), "
              f"{len(state)} optimizer / training state tensors ({sum(v.size for v in state.values()):,} "
              f"values{'' if args.state else '; --state lists them'})")
        if rank == (layout.get("ranks_with_files") or [0])[0]:
            shown = [model] + ([state] if args.state else [])
            for group in shown:
                items = sorted(group.items(), key=lambda kv: order.get(kv[0], (len(order), kv[0])))
                limit = args.tensors or len(items)
                for k, v in items[:limit]:
                    print(f"    {k:60s} {list(v.dims)} {v.dtype}")
                if len(items) > limit:
                    print(f"    ... {len(items) - limit} more (--tensors 0 lists all)")
    if layout.get("signature", "full") != "full":
        from naohai.checkpoint.reshard import merged_tensors
        merged = merged_tensors(path)
        print(f"  merged (full) tensors: {len(merged)}")
        limit = args.tensors or len(merged)
        for k in sorted(merged)[:limit]:
            print(f"    {k:60s} {list(merged.shape(k))}")
    return 0


def _model_tensor_order(man) -> dict:
    """Model parameter name -> position in the model (embedding, layers in order, head), from the
    checkpoint's recipe; optimizer and training state are the other tensors."""
    from naohai.config import recipe_from_dict
    from naohai.model.spec import param_shapes
    try:
        cfg = recipe_from_dict(man["recipe"], where="checkpoint manifest").model
    except (KeyError, TypeError, UserError):
        return {}
    return {p.name: (i, p.name) for i, p in enumerate(param_shapes(cfg))}


def _verify(args, path) -> int:
    from naohai.checkpoint import store
    verdict = store.verify(path)
    if not verdict.ok:
        raise UserError(f"does not verify: {verdict.reason()}", where=path)
    man = store.read_manifest(path)
    print(f"{path}: ok ({len(man.get('files') or {})} files, sizes and SHA-256 match the manifest)")
    return 0


def _merge(args, path) -> int:
    from naohai.checkpoint.reshard import reshard_checkpoint
    out = reshard_checkpoint(path, args.out, hash_files=not args.no_verify)
    print(f"merged {path} -> {out} (full tensors; usable by one device, data parallel, generate)")
    return 0


def _reshard(args, path) -> int:
    from naohai.checkpoint import store
    from naohai.checkpoint.reshard import reshard_checkpoint
    from naohai.config import recipe_from_dict
    man = store.read_manifest(path)
    work = Path(tempfile.mkdtemp(prefix="naohai-reshard-"))
    try:
        if args.recipe:
            from naohai.config import load_recipe
            recipe = load_recipe(args.recipe, list(args.overrides))
        else:
            from naohai.config import merge_trees, parse_overrides
            raw = merge_trees(dict(man["recipe"]), parse_overrides(list(args.overrides)))
            recipe = recipe_from_dict(raw, where=os.path.join(path, store.MANIFEST))
        from naohai.strategy.run_plan import plan_run
        from naohai.train.job import planned_checkpoint_layout
        run = plan_run(recipe, args.to)
        run.tell()
        layout = planned_checkpoint_layout(run.strategy)
        strategy_dir = work / "strategy"
        strategy_dir.mkdir()
        if layout["signature"] != "full":
            compiled = Path(args.compiled) if args.compiled else _compile(run, args.to, work, args.timeout)
            for r in range(int(layout["world"])):
                src = compiled / f"rank_{r}" / "strategy.ckpt"
                if not src.exists():
                    raise UserError(f"has no rank_{r}/strategy.ckpt: not a compile of this strategy",
                                    where=str(compiled), key="--compiled")
                shutil.copyfile(src, strategy_dir / store.rank_file(r))
            out = reshard_checkpoint(path, args.out, str(strategy_dir), layout, hash_files=not args.no_verify)
        else:
            if args.compiled:
                print(f"note: --compiled {args.compiled} is not read: {layout['describe']} keeps every tensor "
                      f"whole, so no compile of the strategy is needed", file=sys.stderr)
            out = reshard_checkpoint(path, args.out, hash_files=not args.no_verify)
        print(f"resharded {path} -> {out} for {layout['describe']}")
        return 0
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _compile(run, strategy: str, work: Path, timeout: float) -> Path:
    """Simulated compile of the destination (``run``, planned from the strategy file ``strategy``): its
    per-rank strategy files."""
    from naohai.train.compile_target import compile_layout
    resolved = run.strategy
    out = work / "compile"
    print(f"compiling the destination layout on {resolved.device_num} simulated devices ...", flush=True)
    rep = compile_layout(run.recipe, strategy, out, stages=resolved.stages, timeout=timeout, ranks=resolved.device_num)
    if not rep.compiled:
        raise UserError(f"the destination strategy did not compile:\n{rep.render()}", where=strategy, key="--to")
    return out


def _adapters_of(path: str, verify: bool):
    """(weights, trained adapter tensors) of a fine-tuning run, its checkpoint or an adapter folder; exit 2
    otherwise."""
    from naohai.checkpoint.weights import find_weights
    found = find_weights(path, verify=verify)
    if found.adapters is None:
        raise UserError(f"holds no adapters ({found.describe()}: a model trained without a finetune section)",
                        where=path, key="finetune")
    return found, found.adapters()


def _refuse_unmergeable(found, path: str, what: str) -> None:
    """Only LoRA folds into the base weights; the other methods' models are not plain ones."""
    ft = found.recipe.finetune
    if ft is not None and ft.method != "lora":
        raise UserError(f"holds a {ft.method} adapter, which does not fold into the base weights, so there is no "
                        f"plain model to {what}; export the adapter with --to peft (prefix, prompt, llama_adapter) "
                        f"or read it as it is (eval, generate)", where=path, key="finetune.method")


def _merge_adapter(args) -> int:
    from naohai.checkpoint.adapters import plain_recipe
    from naohai.convert.model_dir import write_model_dir
    found, factors = _adapters_of(args.checkpoint, not args.no_verify)
    _refuse_unmergeable(found, args.checkpoint, "write")
    tensors = found.tensors()
    tokenizer = found.tokenizer_file()
    work = os.path.abspath(args.out)
    os.makedirs(work)
    kept = None
    if os.path.isfile(tokenizer):                  # the merged folder carries its tokenizer
        kept = os.path.join(work, os.path.basename(tokenizer))
        shutil.copyfile(tokenizer, kept)
        config = os.path.join(os.path.dirname(tokenizer), "tokenizer_config.json")
        if tokenizer.endswith(".json") and os.path.isfile(config):
            shutil.copyfile(config, os.path.join(work, "tokenizer_config.json"))
    write_model_dir(work, plain_recipe(found.recipe, kept), tensors)
    print(f"merged {len(factors) // 2} LoRA adapters of {found.describe()} into its base -> {args.out} "
          f"(an imported model folder: generate, eval, train.init_from, ckpt export)")
    return 0


def _export_peft(args) -> int:
    from naohai.convert.peft import write_peft
    found, tensors = _adapters_of(args.checkpoint, not args.no_verify)
    ft = found.recipe.finetune
    files = write_peft(args.out, found.recipe.model, ft, tensors, base_model=found.recipe.train.init_from or "",
                       where=args.checkpoint)
    _conventions_note(found.recipe.model)
    print(f"exported the {ft.method} adapter ({len(tensors)} tensors) of {found.describe()} -> {args.out} "
          f"(PEFT: {', '.join(files)})")
    return 0


def _import_peft(args) -> int:
    from naohai.checkpoint import adapters as ad
    from naohai.checkpoint.weights import find_weights
    from naohai.config import recipe_from_dict
    from naohai.convert.peft import read_peft
    if not args.base:
        raise UserError("--from peft needs --base: the model the adapter was trained on (an imported model folder, "
                        "a run or a checkpoint)", where="command line", key="--base")
    if args.recipe or args.strategy or args.overrides:
        raise UserError("--from peft takes its model from --base; drop --recipe / --strategy / overrides",
                        where="command line", key="--recipe")
    try:
        base = find_weights(args.base)
    except UserError as exc:
        raise UserError(exc.message, where=exc.where, key="--base") from None
    fields, tensors = read_peft(args.src, base.recipe.model, where_base=args.base)
    raw = base.recipe.to_dict()
    raw["finetune"] = fields
    recipe = recipe_from_dict(raw, where=os.path.join(args.src, "adapter_config.json")).validate()
    origin = {"from": "peft", "path": os.path.abspath(args.src)}
    ad.write_adapter_dir(args.out, recipe, tensors, ad.base_record(base, base.recipe.train.seed), origin)
    detail = ", ".join(f"{k} {v}" for k, v in fields.items() if k not in ("method", "targets"))
    print(f"imported a {fields['method']} adapter ({detail}; {len(tensors)} tensors) from {args.src} over "
          f"{base.describe()} -> {args.out} (generate / eval read it over its base"
          f"{'; ckpt merge-adapter writes the merged model' if fields['method'] == 'lora' else ''})")
    return 0


def _import(args) -> int:
    if args.fmt == "hf":
        return _import_hf(args)
    if args.fmt == "peft":
        return _import_peft(args)
    if not args.recipe:
        raise UserError(f"--from {args.fmt} needs --recipe (the model the checkpoint holds)", where="command line",
                        key="--recipe")
    from naohai.config import load_recipe, resolve_recipe_path
    from naohai.convert.files import read_reference
    from naohai.convert.model_dir import write_model_dir
    from naohai.convert.names import from_reference
    recipe = load_recipe(resolve_recipe_path(args.recipe), args.overrides)
    weights = from_reference(read_reference(args.src, args.strategy), recipe.model, args.fmt, where=args.src)
    write_model_dir(args.out, recipe, weights)
    print(f"imported {len(weights)} tensors from {args.src} -> {args.out}")
    return 0


def _import_hf(args) -> int:
    from naohai.config import parse_overrides
    from naohai.convert.hf.convert import stream_hf
    from naohai.convert.model_dir import write_hf_model_dir
    if args.recipe or args.strategy:
        raise UserError("a Hugging Face folder's config.json gives the model; give model.* overrides instead of "
                        "--recipe / --strategy", where="command line", key="--recipe" if args.recipe else "--strategy")
    tree = parse_overrides(list(args.overrides))
    if set(tree) - {"model"}:
        raise UserError(f"only model.* overrides apply to an import, got {sorted(set(tree) - {'model'})}",
                        where="command line")
    cfg, weights = stream_hf(args.src, tree.get("model") or {})     # read one tensor at a time while written
    sizes = []

    def counted():
        for name, value in weights:
            sizes.append(int(value.size))
            yield name, value
    write_hf_model_dir(args.out, cfg, counted(), args.src)
    if not os.path.isfile(os.path.join(args.src, "tokenizer.json")):
        print(f"naohai: note: {args.src} has no tokenizer.json: generate, eval --text, data score and training on "
              f"text need the model's own; put it in {args.out} and set data.tokenizer in its recipe.yaml",
              file=sys.stderr)
    n = sum(sizes)
    print(f"imported {len(sizes)} tensors ({n:,} parameters, {cfg.family}: {cfg.num_layers} layers, hidden "
          f"{cfg.hidden_size}, seq_length {cfg.seq_length}) from {args.src} -> {args.out}")
    return 0


def _shard_bytes(text: str) -> int:
    units = {"": 1, "B": 1, "KB": 10 ** 3, "MB": 10 ** 6, "GB": 10 ** 9, "KIB": 2 ** 10, "MIB": 2 ** 20, "GIB": 2 ** 30}
    raw = str(text).strip().upper()
    number = raw.rstrip("KMGIB")
    try:
        value = int(float(number) * units[raw[len(number):]])
    except (ValueError, KeyError, OverflowError):       # OverflowError: inf, 1e400
        value = 0
    if not 0 < value <= 2 ** 62:
        raise UserError(f"'{text}' is not a size (e.g. 5GB, 200MB, 1000000)", where="command line", key="--shard-size")
    return value


def _export_hf(args, path) -> int:
    from naohai.convert.hf.convert import write_hf
    if path is None:            # an imported model folder
        from naohai.convert.model_dir import hf_export_sources
        recipe, weights, tokenizer_dir, base = hf_export_sources(args.checkpoint)
    else:                       # a trained checkpoint: its model tensors, merged when sharded
        from naohai.checkpoint.weights import find_weights
        from naohai.convert.hf.registry import for_family
        found = find_weights(path, verify=not args.no_verify)
        _refuse_unmergeable(found, args.checkpoint, "export")
        for_family(found.recipe.model, args.checkpoint)        # a family with no architecture: before reading
        recipe, weights, base = found.recipe, found.tensors(), None
        tok = found.tokenizer_file() if recipe.data.tokenizer else None     # where training read it, any folder
        tokenizer_dir = os.path.dirname(os.path.abspath(tok)) if tok and tok.endswith(".json") else None
    files = write_hf(args.out, recipe.model, weights, where=args.checkpoint, tokenizer_dir=tokenizer_dir,
                     base_config=base,
                     shard_bytes=_shard_bytes(DEFAULT_SHARD_SIZE if args.shard_size is None else args.shard_size))
    _conventions_note(recipe.model)
    print(f"exported {args.checkpoint} -> {args.out} (Hugging Face: {', '.join(files)})")
    return 0


def _conventions_note(cfg) -> None:
    """Say on stderr what of the recipe's packing and loss the exported model does not carry."""
    from naohai.convert.hf.arch import training_conventions
    for note in training_conventions(cfg):
        print(f"note: {note}", file=sys.stderr)


def _export(args, path) -> int:
    """``path`` is a naohai checkpoint folder, or None for an imported model folder (args.checkpoint)."""
    if args.format == "hf":
        return _export_hf(args, path)
    if args.format == "safetensors":
        if path is None:
            raise UserError("safetensors export reads a trained checkpoint; an imported model folder already "
                            "holds model.ckpt with naohai's names", where=args.checkpoint)
        from naohai.checkpoint.reshard import export_safetensors
        names = export_safetensors(path, args.out, hash_files=not args.no_verify)
        print(f"exported {len(names)} model tensors of {path} -> {args.out} (safetensors)")
        return 0
    from naohai.convert.files import write_ckpt
    from naohai.convert.names import to_reference
    if path is None:
        from naohai.convert.model_dir import load_model_dir
        recipe, weights = load_model_dir(args.checkpoint)
    else:
        from naohai.checkpoint.reshard import model_weights
        recipe, weights = model_weights(path, hash_files=not args.no_verify)
    tensors = to_reference(weights, recipe.model, args.format)
    from naohai.runfiles import temp_dir_beside
    work = temp_dir_beside(args.out)
    try:
        write_ckpt(tensors, os.path.join(work, "model.ckpt"))
        if os.path.lexists(args.out):
            raise UserError("appeared while it was being written; exporting never overwrites a file",
                            where=args.out, key="--out")
        os.rename(os.path.join(work, "model.ckpt"), args.out)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"exported {len(tensors)} tensors -> {args.out} ({args.format} names and layouts)")
    return 0
