"""Thin CLI subcommands; each module has register(subparsers) and sets args.run."""
