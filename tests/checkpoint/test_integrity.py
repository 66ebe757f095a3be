"""Every checkpoint reader verifies; manifests stay inside their folder; wrong types are integrity
errors (exit 2, one paragraph); merge/export never touch a name they did not create."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest

from naohai.checkpoint import store
from naohai.cli import main


@pytest.fixture
def copy(ckpt, tmp_path):
    dst = tmp_path / "ckpt"
    shutil.copytree(ckpt, dst)
    return dst


def _edit(folder, fn):
    path = Path(folder) / store.MANIFEST
    man = json.loads(path.read_text())
    fn(man)
    path.write_text(json.dumps(man))


def _err(capsys):
    err = " ".join(capsys.readouterr().err.split())
    assert "Traceback" not in err
    return err


def _flip(path):
    data = bytearray(Path(path).read_bytes())
    data[len(data) // 2] ^= 0x01
    Path(path).write_bytes(bytes(data))


@pytest.mark.parametrize("name", ["../../etc/passwd", "/etc/passwd", "strategy/../../x", "a//b", "./rank_0.ckpt"])
def test_manifest_names_outside_the_folder_are_refused(copy, capsys, name):
    entry = {"sha256": "0" * 64, "bytes": 1}
    _edit(copy, lambda m: m["files"].__setitem__(name, entry))
    assert main(["ckpt", "verify", str(copy)]) == 2
    assert "leaves the checkpoint folder" in _err(capsys)


def test_a_rank_file_that_links_out_of_the_folder_is_refused(copy, tmp_path, capsys):
    outside = tmp_path / "elsewhere.ckpt"
    shutil.copyfile(copy / "rank_0.ckpt", outside)        # same bytes: size and SHA-256 would pass
    (copy / "rank_0.ckpt").unlink()
    (copy / "rank_0.ckpt").symlink_to(outside)
    assert main(["ckpt", "verify", str(copy)]) == 2
    assert "outside the checkpoint folder" in _err(capsys)
    assert main(["ckpt", "inspect", str(copy)]) == 2
    assert "outside the checkpoint folder" in _err(capsys)



def test_inspect_of_a_cut_rank_file_is_an_integrity_error(copy, capsys):
    rank = copy / "rank_0.ckpt"
    rank.chmod(0o644)
    os.truncate(rank, rank.stat().st_size // 2)
    assert main(["ckpt", "inspect", str(copy)]) == 2
    err = _err(capsys)
    assert "integrity error: rank_0.ckpt cannot be read as a checkpoint" in err and "cut short" in err

@pytest.mark.parametrize("damage,key", [
    (lambda m: m.__setitem__("files", sorted(m["files"])), "files"),
    (lambda m: m["files"].__setitem__("rank_0.ckpt", "abc"), "files.rank_0.ckpt"),
    (lambda m: m.__setitem__("layout", "full"), "layout"),
    (lambda m: m["files"]["rank_0.ckpt"].__setitem__("bytes", "12"), "files.rank_0.ckpt.bytes"),
    (lambda m: m.__setitem__("step", [2]), "step"),
    (lambda m: m["layout"].__setitem__("ranks_with_files", "0"), "layout.ranks_with_files"),
])
@pytest.mark.parametrize("action", ["verify", "inspect", "merge"])
def test_wrong_types_in_a_manifest_are_integrity_errors(copy, tmp_path, capsys, damage, key, action):
    _edit(copy, damage)
    extra = ["--out", str(tmp_path / "merged")] if action == "merge" else []
    assert main(["ckpt", action, str(copy), *extra]) == 2
    err = _err(capsys)
    assert "integrity error" in err and f"key '{key}'" in err


@pytest.mark.parametrize("fmt", ["safetensors", "pangu-alpha"])
def test_export_refuses_a_checkpoint_that_does_not_verify(copy, tmp_path, capsys, fmt):
    _flip(copy / "rank_0.ckpt")
    out = tmp_path / f"model.{fmt}"
    assert main(["ckpt", "export", str(copy), "--format", fmt, "--out", str(out)]) == 2
    assert "SHA-256" in _err(capsys) and not out.exists()
    # the documented escape hatch: sizes only (the flipped byte is not seen)
    assert main(["ckpt", "export", str(copy), "--format", fmt, "--out", str(out), "--no-verify"]) == 0
    assert out.exists() and not list(tmp_path.glob(".model*.tmp-*"))


def test_merge_and_generate_refuse_a_corrupted_checkpoint(copy, tmp_path, capsys):
    from naohai.errors import UserError
    from naohai.checkpoint.weights import load_model
    _flip(copy / "rank_0.ckpt")
    assert main(["ckpt", "merge", str(copy), "--out", str(tmp_path / "merged")]) == 2
    assert "SHA-256" in _err(capsys) and not (tmp_path / "merged").exists()
    with pytest.raises(UserError, match="SHA-256"):
        load_model(str(copy))


def test_merge_never_touches_a_users_folder_named_out_tmp(ckpt, tmp_path, capsys):
    users = tmp_path / "merged.tmp"
    users.mkdir()
    (users / "notes.txt").write_text("mine")
    assert main(["ckpt", "merge", str(ckpt), "--out", str(tmp_path / "merged")]) == 0
    assert (users / "notes.txt").read_text() == "mine"
    assert main(["ckpt", "verify", str(tmp_path / "merged")]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["merged", "merged.tmp"]
    # an existing --out is refused, never replaced
    before = hashlib.sha256((tmp_path / "merged" / "rank_0.ckpt").read_bytes()).hexdigest()
    assert main(["ckpt", "merge", str(ckpt), "--out", str(tmp_path / "merged")]) == 2
    assert hashlib.sha256((tmp_path / "merged" / "rank_0.ckpt").read_bytes()).hexdigest() == before
