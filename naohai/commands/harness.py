"""`naohai lm-eval ARGS...`: lm-evaluation-harness's own command line with the ``naohai`` model registered.

lm-eval 0.4 finds models only in its own table, so its ``lm_eval`` command cannot load
``--model naohai``; this runs the same command (``lm_eval run`` and every flag of it:
``--model_args path=RUN``, ``--tasks``, ``--log_samples``, ``--output_path``, ...) after
:mod:`naohai.downstream.backend` has registered the model; without an ``--include_path`` of
your own (lm-eval takes one folder) naohai's shipped tasks are on it.  Other models (``--model hf``) work as in ``lm_eval``.
"""
from __future__ import annotations

import argparse


def register(sub) -> None:
    p = sub.add_parser("lm-eval", help="lm-evaluation-harness's command line with --model naohai available",
                       description=__doc__.split("\n\n")[0], add_help=False)
    p.add_argument("args", nargs=argparse.REMAINDER, help="arguments for lm-eval (see 'naohai lm-eval --help')")
    p.set_defaults(run=run)


def run(args) -> int:
    import sys

    from naohai.downstream.tasks import SHIPPED, require_lm_eval

    require_lm_eval(key="naohai lm-eval")
    import naohai.downstream.backend  # noqa: F401  (registers 'naohai')
    from lm_eval.__main__ import cli_evaluate

    argv = list(args.args)
    if argv and argv[0].startswith("-") and argv[0] not in ("-h", "--help"):
        argv = ["run"] + argv
    if argv[:1] == ["run"] and not any(a.startswith("--include_path") for a in argv):
        argv += ["--include_path", SHIPPED]
    saved = sys.argv
    sys.argv = ["lm_eval"] + argv
    try:
        cli_evaluate()
    except SystemExit as exc:
        return int(exc.code or 0) if not isinstance(exc.code, str) else 2
    finally:
        sys.argv = saved
    return 0
