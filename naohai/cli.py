"""The `naohai` console command: parses arguments and dispatches to subcommands.

Each subcommand lives in ``naohai/commands/<name>.py`` with two functions:
``register(subparsers)`` adds its parser and ``run(args) -> int`` does the work by
calling library code.  A :class:`naohai.errors.UserError` anywhere becomes one
paragraph on stderr and exit code 2.
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys
import textwrap

from naohai.errors import UserError
from naohai.interrupt import Interrupted

# Subcommands in the order `naohai --help` lists them.
COMMANDS = ("train", "generate", "eval", "harness", "plot", "ckpt", "data", "plan", "check", "launch", "submit", "bench")


def version_text() -> str:
    """``naohai --version``: naohai's version and where it is imported from, MindSpore's version, and the
    device ``train.device: auto`` finds here."""
    import os

    import naohai
    lines = [f"naohai {naohai.__version__} ({os.path.dirname(os.path.abspath(naohai.__file__))})"]
    try:
        import mindspore
    except ImportError as exc:
        lines.append(f"MindSpore: not importable ({exc})")
        return "\n".join(lines)
    lines.append(f"MindSpore {mindspore.__version__}")
    from naohai.devices import resolve_device
    lines.append(f"device: {resolve_device('auto', where='--version', key='auto')} (what train.device: auto "
                 f"picks here: Ascend, else GPU, else CPU)")
    return "\n".join(lines)


class _VersionAction(argparse.Action):
    """``--version``: print :func:`version_text` and exit 0 (MindSpore is imported only here)."""

    def __init__(self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, help=None):  # noqa: A002
        super().__init__(option_strings, dest=dest, default=default, nargs=0, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        print(version_text())
        parser.exit(0)


class _Parser(argparse.ArgumentParser):
    """argparse, but bad flags are UserErrors (exit 2, one paragraph)."""

    def error(self, message):  # noqa: D401
        raise UserError(f"{message}. See '{self.prog} --help'.", where="command line")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="naohai", description="Train PanGu-alpha / PengCheng-Mind style LLMs with MindSpore.")
    parser.add_argument("--version", action=_VersionAction,
                        help="print naohai's and MindSpore's versions and the device found, then exit")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    for name in COMMANDS:
        try:
            module = importlib.import_module(f"naohai.commands.{name}")
        except ModuleNotFoundError as exc:
            if exc.name == f"naohai.commands.{name}":
                continue  # subcommand not shipped in this build
            raise
        module.register(sub)
    return parser


def _stopped(code: int, as_program: bool) -> int:
    """The exit of a run stopped by a signal.  As the program, exit at once: MindSpore's threads may be
    mid-operation and the interpreter's shutdown can abort on them (measured: SIGABRT instead of 143)."""
    if as_program:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


def _check_switches() -> None:
    """A wrong ``NAOHAI_CPU_KERNELS`` or ``NAOHAI_STOP_GRACE`` stops a command here, before any work (the cells
    read the first when they are built, after data preparation; the loop reads the second only when a stop
    signal has come, too late to say it is wrong without losing the steps since the last checkpoint); no
    MindSpore is imported."""
    from naohai import interrupt
    from naohai.model import cpu_kernels
    cpu_kernels.enabled()
    interrupt.grace_seconds()


def _given_here(err: UserError, args) -> str:
    """Where a key an error names came from, when it was a command-line override of the recipe (the error
    names the recipe file, where the user would look for it in vain)."""
    if "command line" in str(err.where or ""):
        return ""
    given = [o for o in (getattr(args, "overrides", None) or []) if isinstance(o, str) and "=" in o]
    match = [o for o in given if err.key and o.split("=", 1)[0].strip() == err.key]
    return f" [{err.key} was set on the command line: {match[-1]}]" if match else ""


def main(argv=None) -> int:
    as_program = argv is None
    argv = list(sys.argv[1:] if argv is None else argv)
    args = None
    try:
        if argv[:1] == ["lm-eval"]:          # every later word is lm-eval's own (argparse cannot pass "--x" on)
            from naohai.commands import harness
            _check_switches()
            return int(harness.run(argparse.Namespace(args=argv[1:])) or 0)
        parser = build_parser()
        args = parser.parse_args(argv)
        if not getattr(args, "command", None):
            parser.print_help()
            return 2
        _check_switches()
        return int(args.run(args) or 0)
    except UserError as err:
        # one paragraph, wrapped at 100 columns on a terminal; one line elsewhere (logs, pipes), so that
        # where it breaks never depends on the length of a path in it
        text = textwrap.fill(f"naohai: error: {err}{_given_here(err, args)}",
                             width=100 if sys.stderr.isatty() else 1 << 30,
                             break_long_words=False, break_on_hyphens=False)
        print(text, file=sys.stderr)
        return err.exit_code
    except Interrupted as stop:
        print(f"naohai: {stop}", file=sys.stderr)
        return _stopped(stop.exit_code, as_program)
    except KeyboardInterrupt:
        from naohai import interrupt
        req = interrupt.current()
        print(f"naohai: {req.stopped_now_message() if req.requested else 'interrupted'}", file=sys.stderr)
        return _stopped(128 + int(req.signum) if req.requested else 130, as_program)
    except BrokenPipeError:  # output piped into e.g. `head`: stop quietly
        sys.stderr.close()
        return 0


if __name__ == "__main__":
    sys.exit(main())
