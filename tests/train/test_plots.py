"""Figures of metrics.jsonl (naohai/train/plots.py, `naohai plot`), checked through matplotlib's objects."""
import json

import pytest
from PIL import Image

from naohai.cli import main
from naohai.train.plots import load_run, metrics_figure


def _write_run(folder, rows):
    folder.mkdir(parents=True)
    with open(folder / "metrics.jsonl", "w", encoding="utf-8") as fh:
        for row in rows:
            fh.write(json.dumps(row) + "\n")
    return folder


def _train(step, loss, lr=1e-3, tps=1000.0, norm=1.0):
    return {"split": "train", "step": step, "loss": loss, "lr": lr, "tokens_per_s": tps, "grad_norm": norm}


def _valid(step, loss):
    return {"split": "valid", "step": step, "loss": loss}


@pytest.fixture
def two_runs(tmp_path):
    a = _write_run(tmp_path / "runs" / "a", [_valid(0, 7.5), _train(10, 6.0, 5e-4, 1200, 2.0),
                                             _train(20, 5.0, 1e-3, 1300, 1.5), _valid(20, 5.2)])
    # b was interrupted after step 20 and resumed from its step-10 checkpoint: steps 20 and 30 appear
    # again; the rows written later belong to the weights that went on
    b = _write_run(tmp_path / "runs" / "b", [_valid(0, 7.5), _train(10, 6.5, 1e-3, 900, 3.0),
                                             _train(20, 9.9, 1e-3, 900, 9.0), _train(20, 5.5, 1e-3, 950, 1.0),
                                             _train(30, 4.5, 2e-4, 980, 0.8), _valid(30, 4.7)])
    return a, b


def test_figure_has_labelled_axes_ticks_legend_and_the_data(two_runs):
    a, b = two_runs
    fig = metrics_figure([load_run(str(a)), load_run(str(b))])
    loss, lr, tps, norm = fig.axes
    fig.canvas.draw()            # tick labels are filled in at draw time
    for ax, title in ((loss, "loss"), (lr, "learning rate"), (tps, "throughput"), (norm, "gradient norm")):
        assert ax.get_title() == title
        assert ax.get_xlabel() == "optimizer step" and ax.get_ylabel()
        xt = [t.get_text() for t in ax.get_xticklabels() if t.get_text()]
        yt = [t.get_text() for t in ax.get_yticklabels() if t.get_text()]
        assert len(xt) >= 3 and len(yt) >= 3, (title, xt, yt)
        assert ax.xaxis.get_gridlines()[0].get_visible()
    assert loss.get_ylabel() == "loss (nats per token)" and tps.get_ylabel() == "tokens / s"
    legend = [t.get_text() for t in loss.get_legend().get_texts()]
    assert legend == ["a: train loss", "a: held-out loss", "b: train loss", "b: held-out loss"]
    lines = {line.get_label(): line for line in loss.get_lines()}
    assert list(lines["a: train loss"].get_xdata()) == [10, 20]
    assert list(lines["a: train loss"].get_ydata()) == [6.0, 5.0]
    assert list(lines["a: held-out loss"].get_xdata()) == [0, 20]
    # the resumed run: each step once, the later row kept
    assert list(lines["b: train loss"].get_xdata()) == [10, 20, 30]
    assert list(lines["b: train loss"].get_ydata()) == [6.5, 5.5, 4.5]
    assert [list(line.get_ydata()) for line in tps.get_lines()] == [[1200, 1300], [900, 950, 980]]
    assert [list(line.get_ydata()) for line in lr.get_lines()][1] == [1e-3, 1e-3, 2e-4]
    assert [t.get_text() for t in lr.get_legend().get_texts()] == ["a", "b"]
    # the loss panel's y range holds the data
    low, high = loss.get_ylim()
    assert low <= 4.5 and high >= 7.5


def test_plot_command_overlays_runs(two_runs, tmp_path, capsys):
    a, b = two_runs
    out = tmp_path / "ab.png"
    assert main(["plot", str(a), str(b), "--out", str(out), "--label", "first", "--label", "second"]) == 0
    assert f"plot: {out}" in capsys.readouterr().out
    with Image.open(out) as img:
        assert img.format == "PNG" and img.size == (1200, 800)
    assert main(["plot", str(a)]) == 0           # one run: its own loss.png
    assert (a / "loss.png").stat().st_size > 10_000


def _err(capsys):
    return " ".join(capsys.readouterr().err.split())   # the message is wrapped to the terminal


def test_plot_command_errors(tmp_path, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["plot", str(empty)]) == 2
    assert "holds no metrics.jsonl" in _err(capsys)
    assert main(["plot", str(tmp_path / "nope")]) == 2
    assert "is not a folder" in _err(capsys)
    assert main(["plot", str(empty), "--label", "x", "--label", "y"]) == 2
    assert "2 --label for 1 runs" in _err(capsys)


def test_plot_out_that_cannot_be_a_png_file_is_named(two_runs, tmp_path, capsys):
    """A folder ending in .png or a path under a file raised IsADirectoryError / FileExistsError after the figure
    was drawn; an empty --out wrote RUN/loss.png (found by a probe)."""
    a, _ = two_runs
    (tmp_path / "dir.png").mkdir()
    (tmp_path / "afile.txt").write_text("mine")
    for out, words in ((tmp_path / "dir.png", "is a folder"), (tmp_path / "afile.txt" / "x.png", "is a file"),
                       ("", "is empty")):
        assert main(["plot", str(a), "--out", str(out)]) == 2
        err = _err(capsys)
        assert "key '--out'" in err and words in err and "Traceback" not in err
    assert (tmp_path / "afile.txt").read_text() == "mine" and not (a / "loss.png").exists()


def test_a_run_killed_while_logging_still_plots_and_a_broken_row_is_named(tmp_path, capsys):
    """A run killed in the middle of writing a row leaves a last line without its newline: the plot leaves it out,
    as a resumed run does.  Any other line that is not a row (text, a list, a step that is no whole number: 1e400
    read as infinity) was a traceback (JSONDecodeError, OverflowError); it is now exit 2 naming the file and the
    line."""
    run = tmp_path / "killed"
    run.mkdir()
    rows = [{"step": 1, "loss": 5.0, "lr": 1e-3}, {"step": 2, "loss": float("nan"), "lr": 1e-3}]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 3, "lo')
    assert main(["plot", str(run)]) == 0
    assert (run / "loss.png").exists()
    for n, bad in enumerate(['garbage', '[1, 2]', '{"step": 1e400, "loss": 1}', '{"step": 2.5}', '{"loss": 1}',
                             '{"step": -1}', '{"step": true}']):
        broken = tmp_path / f"broken{n}"
        broken.mkdir()
        (broken / "metrics.jsonl").write_text(json.dumps(rows[0]) + "\n" + bad + "\n" + json.dumps(rows[1]) + "\n")
        assert main(["plot", str(broken)]) == 2
        err = _err(capsys)
        assert f"{broken / 'metrics.jsonl'}: line 2 is not a metrics row" in err and "Traceback" not in err, err
        assert not (broken / "loss.png").exists()
