"""`naohai bench` flags: a bad one is exit 2 with one paragraph, no traceback, before any work."""
import pytest

from naohai.cli import main


@pytest.mark.parametrize("argv, words", [
    (["--models", "tiny,huge"], "unknown model 'huge'"),
    (["--models", "tiny,tiny"], "listed twice"),
    (["--models", ","], "comma-separated"),
    (["--rounds", "0"], "--rounds"),
    (["--rounds", "nan"], "--rounds"),
    (["--steps", "1"], "--steps"),
    (["--steps", "1e99"], "--steps"),
    (["--torch-threads", "-1"], "--torch-threads"),
    (["--compile-layers", "4,x"], "[1, 512]"),
    (["--compile-layers", "4,4"], "listed twice"),
    (["--compile-layers", "100000"], "[1, 512]"),
    (["--compile-forms", "loop,fused"], "not one of loop, shared, separate"),
    (["--compile-forms", "loop,loop"], "twice"),
    (["--cpu-reductions", "fast"], "invalid choice: 'fast'"),
    (["--bogus"], "unrecognized arguments"),
])
def test_bad_flags_exit_2_without_traceback(capsys, argv, words):
    assert main(["bench", *argv]) == 2
    err = capsys.readouterr().err
    assert words in err and "Traceback" not in err and err.startswith("naohai: error:")


def test_out_that_is_a_file_is_refused(tmp_path, capsys):
    f = tmp_path / "file"
    f.write_text("x")
    assert main(["bench", "--out", str(f)]) == 2
    assert "not a folder" in " ".join(capsys.readouterr().err.split())      # the message is wrapped to the terminal


def test_flags_become_options():
    from naohai.cli import build_parser
    from naohai.commands.bench import options
    args = build_parser().parse_args(["bench", "--quick"])
    o = options(args)
    assert [m.name for m in o.models] == ["tiny"] and o.rounds == 1 and tuple(o.compile_layers) == (4, 16)
    assert not o.torch_compile and tuple(o.compile_forms) == ("loop",)
    o = options(build_parser().parse_args(["bench", "--models", "42m,tiny", "--compile-layers", "none",
                                           "--rounds", "2"]))
    assert [m.name for m in o.models] == ["42m", "tiny"] and o.compile_layers == () and o.rounds == 2
    assert o.torch_compile and tuple(o.compile_forms) == ("loop", "shared", "separate")
    o = options(build_parser().parse_args(["bench", "--compile-forms", "shared,loop"]))
    assert o.compile_forms == ("shared", "loop")
    assert o.finetune
    assert not options(build_parser().parse_args(["bench", "--no-finetune"])).finetune
    assert o.matmul_floor and not options(build_parser().parse_args(["bench", "--quick"])).matmul_floor
    assert not options(build_parser().parse_args(["bench", "--no-matmul-floor"])).matmul_floor
    assert o.cpu_reductions == "fused"           # naohai at its fastest documented setting (train.cpu_reductions)
    assert options(build_parser().parse_args(["bench", "--cpu-reductions", "mindspore"])).cpu_reductions == "mindspore"
