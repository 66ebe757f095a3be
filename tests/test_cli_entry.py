"""The `naohai` command itself: `--help` without MindSpore, `--version`, how a user error is printed."""
import os
import subprocess
import sys

import mindspore
import pytest

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


@pytest.mark.parametrize("terminal", [True, False])
def test_a_user_error_is_wrapped_on_a_terminal_only(capsys, monkeypatch, tmp_path, terminal):
    """Exit 2 and one paragraph: at most 100 columns a line on a terminal, one line in a log or pipe (so
    where it breaks never depends on the length of a path in it)."""
    missing = tmp_path / "nope.yaml"            # the message (with every shipped recipe's name) is > 100 columns
    monkeypatch.setattr(sys.stderr, "isatty", lambda: terminal)
    assert main(["train", str(missing)]) == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert lines[0].startswith("naohai: error:") and "Traceback" not in err and "\n\n" not in err.strip()
    if terminal:
        assert len(lines) > 1 and all(len(line) <= 100 for line in lines), lines
    else:
        assert len(lines) == 1 and f"{missing}: no such recipe file" in lines[0], lines


def test_a_wrong_kernel_switch_stops_the_command_before_it_starts(capsys, monkeypatch, tmp_path):
    """NAOHAI_CPU_KERNELS is read when the cells are built, after a command's first work (data preparation);
    a wrong value is refused first, `naohai lm-eval` included: exit 2, the variable named, not the recipe's own
    error."""
    monkeypatch.setenv("NAOHAI_CPU_KERNELS", "yes")
    assert main(["train", str(tmp_path / "nope.yaml")]) == 2
    err = capsys.readouterr().err
    assert "NAOHAI_CPU_KERNELS" in err and "no such recipe file" not in err and "Traceback" not in err
    assert main(["lm-eval", "--model", "naohai", "--model_args", f"path={tmp_path / 'no-run'}"]) == 2
    assert "NAOHAI_CPU_KERNELS" in capsys.readouterr().err
    monkeypatch.setenv("NAOHAI_CPU_KERNELS", "0")
    assert main(["train", str(tmp_path / "nope.yaml")]) == 2
    assert "no such recipe file" in capsys.readouterr().err


def test_an_error_on_a_key_set_on_the_command_line_says_so(capsys, monkeypatch, tmp_path):
    """Errors found after the recipe is read (the memory check, the run plan, the data) name the recipe file; a
    key the user set as an override is not in that file, so the message says where it came from."""
    from naohai import devices
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(devices, "machine_memory", lambda path=devices.MEMINFO: 1 << 30)
    assert main(["train", "tiny", "model.hidden_size=4096", "model.ffn_hidden_size=16384", "model.num_heads=32"]) == 2
    err = capsys.readouterr().err
    assert "recipes/tiny.yaml" in err and "cannot fit in this machine's memory" in err
    assert "[model.ffn_hidden_size was set on the command line: model.ffn_hidden_size=16384]" in err, err
    assert os.listdir(tmp_path) == []
    # a key from the recipe file itself gets no such remark; an error already about the override neither
    import pathlib
    text = (pathlib.Path(__file__).resolve().parents[1] / "recipes" / "tiny.yaml").read_text()
    wide = text.replace("  preset: tiny", "  preset: tiny\n  hidden_size: 4096\n  ffn_hidden_size: 16384\n"
                                           "  num_heads: 32", 1)
    (tmp_path / "wide.yaml").write_text(wide)
    assert main(["train", str(tmp_path / "wide.yaml")]) == 2
    err = capsys.readouterr().err
    assert "cannot fit in this machine's memory" in err and "was set on the command line" not in err, err
    assert main(["train", "tiny", "train.adam_eps=0"]) == 2
    err = capsys.readouterr().err
    assert "command line override 'train.adam_eps=0'" in err and "was set on the command line" not in err
