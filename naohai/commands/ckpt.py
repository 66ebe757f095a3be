"""`naohai ckpt import|export`: published PanGu-alpha / PengCheng-Mind checkpoints in and out."""
from __future__ import annotations

from naohai.convert.names import FORMATS


def register(sub) -> None:
    p = sub.add_parser("ckpt", help="import / export published PanGu-alpha and PengCheng-Mind checkpoints")
    s = p.add_subparsers(dest="ckpt_command", metavar="ACTION")
    imp = s.add_parser("import", help="reference checkpoint -> imported model folder (model.ckpt + recipe.yaml)")
    imp.add_argument("src", help="a .ckpt file, a folder with one .ckpt (+ the .npy embedding tables), or a "
                                 "folder of rank_<n>/ slices (with --strategy)")
    imp.add_argument("--from", dest="fmt", required=True, choices=FORMATS)
    imp.add_argument("--recipe", required=True, help="recipe (file or name) whose model the checkpoint holds")
    imp.add_argument("--strategy", default=None, help="strategy file of the run that wrote sharded slices")
    imp.add_argument("--out", required=True, help="new folder for the imported model")
    imp.add_argument("overrides", nargs="*", help="dotted recipe overrides, e.g. model.seq_length=2048")
    imp.set_defaults(run=run_import)
    exp = s.add_parser("export", help="imported model folder -> reference checkpoint file")
    exp.add_argument("model", help="an imported model folder")
    exp.add_argument("--to", dest="fmt", required=True, choices=FORMATS)
    exp.add_argument("--out", required=True, help="the .ckpt file to write")
    exp.set_defaults(run=run_export)
    p.set_defaults(run=lambda args: (p.print_help(), 2)[1])


def run_import(args) -> int:
    from naohai.config import load_recipe, resolve_recipe_path
    from naohai.convert.files import read_reference
    from naohai.convert.model_dir import write_model_dir
    from naohai.convert.names import from_reference

    recipe = load_recipe(resolve_recipe_path(args.recipe), args.overrides)
    weights = from_reference(read_reference(args.src, args.strategy), recipe.model, args.fmt, where=args.src)
    write_model_dir(args.out, recipe, weights)
    print(f"imported {len(weights)} tensors from {args.src} -> {args.out}")
    return 0


def run_export(args) -> int:
    import os

    from naohai.convert.files import write_ckpt
    from naohai.convert.model_dir import load_model_dir
    from naohai.convert.names import to_reference
    from naohai.errors import UserError

    if os.path.exists(args.out):
        raise UserError("already exists; exporting never overwrites a file", where=args.out)
    recipe, weights = load_model_dir(args.model)
    tensors = to_reference(weights, recipe.model, args.fmt)
    write_ckpt(tensors, args.out)
    print(f"exported {len(tensors)} tensors -> {args.out}")
    return 0
