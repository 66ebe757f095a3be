"""The `naohai` command itself: `--help` without MindSpore, `--version`."""
import os
import subprocess
import sys

import mindspore

from naohai.cli import COMMANDS, main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _python(code: str) -> str:
    env = dict(os.environ, PYTHONPATH=ROOT)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True,
                          timeout=300).stdout


def test_help_does_not_import_mindspore_or_numpy():
    """Building the whole parser (every subcommand's flags) imports neither MindSpore nor numpy: the
    subcommands import their library code when they run, so `naohai --help` answers at once."""
    out = _python("import sys\nfrom naohai.cli import build_parser\np = build_parser()\n"
                  "names = sorted(p._subparsers._group_actions[0].choices)\n"
                  "print(' '.join(names))\nprint('mindspore' in sys.modules, 'numpy' in sys.modules)")
    names, imported = out.strip().splitlines()
    # every command module registered (naohai.commands.harness is `naohai lm-eval`)
    assert sorted(names.split()) == sorted("lm-eval" if m == "harness" else m for m in COMMANDS)
    assert imported == "False False"


def test_version_names_naohai_mindspore_and_device(capsys):
    import naohai
    try:
        main(["--version"])
    except SystemExit as stop:
        assert stop.code == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith(f"naohai {naohai.__version__} (")
    assert out[1] == f"MindSpore {mindspore.__version__}"
    assert out[2].split()[1] in ("CPU", "GPU", "Ascend")
