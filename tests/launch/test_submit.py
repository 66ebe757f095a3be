"""`naohai submit` against a local recording ModelArts + OBS server (the real SDKs talk to it)."""
import json
import logging
import os
import re
import shutil
import socket
import subprocess
import sys

import pytest

from naohai.cli import main
from naohai.errors import UserError
from naohai.launch import submission
from naohai.launch.modelarts import JobPlatform
from naohai.launch.obs_upload import parse_obs_path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fake_cloud import FakeCloud  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
AK, SK, PID = "AKFAKE0123456789", "sk-Very-Secret-9f8e7d6c5b4a", "proj-0a1b2c3d"
AUTH_RE = re.compile(r"^SDK-HMAC-SHA256 Access=AKFAKE0123456789, SignedHeaders=[a-z0-9;-]+, "
                     r"Signature=[0-9a-f]{64}$")


@pytest.fixture
def cloud():
    with FakeCloud() as fc:
        yield fc


@pytest.fixture
def creds(monkeypatch):
    monkeypatch.setenv("HUAWEICLOUD_SDK_AK", AK)
    monkeypatch.setenv("HUAWEICLOUD_SDK_SK", SK)
    monkeypatch.setenv("HUAWEICLOUD_SDK_PROJECT_ID", PID)


@pytest.fixture
def code(tmp_path):
    """A code tree with files to keep and files the excludes must drop."""
    root = tmp_path / "code"
    (root / "recipes").mkdir(parents=True)
    shutil.copy(os.path.join(ROOT, "recipes", "tiny.yaml"), root / "recipes" / "tiny.yaml")
    (root / "strategies").mkdir()
    # data 2 needs a global batch that is a multiple of 2 x micro-batch: the copied tiny recipe has 16 x 16
    (root / "strategies" / "dp2.yaml").write_text("name: dp2\nmesh: {data: 2}\n")
    tiny = (root / "recipes" / "tiny.yaml").read_text().replace("micro_batch_size: 16", "micro_batch_size: 8")
    (root / "recipes" / "tiny.yaml").write_text(tiny)
    (root / "run").mkdir()
    (root / "run" / "modelarts_boot.sh").write_text("#!/bin/sh\n")
    (root / "pkg").mkdir()
    (root / "pkg" / "mod.py").write_text("x = 1\n")
    for junk in (".git/HEAD", "runs/a/log.txt", "pkg/__pycache__/mod.cpython-311.pyc", "ckpt/step1.ckpt",
                 "data/train.npy", "naohai.egg-info/PKG-INFO", ".pytest_cache/v/x"):
        p = root / junk
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text("junk")
    return root


def create_args(cloud, code, *extra):
    return ["submit", str(code / "recipes" / "tiny.yaml"), "train.steps=7", "--strategy",
            str(code / "strategies" / "dp2.yaml"), "--name", "naohai-tiny", "--flavor", "modelarts.p3.large.8",
            "--nodes", "2", "--engine-name", "MindSpore", "--engine-version", "2.10.0",
            "--code-obs", "/naohai-bkt/code/", "--output-obs", "/naohai-bkt/out/", "--log-obs",
            "obs://naohai-bkt/logs", "--pool-id", "pool-9", "--workspace-id", "ws-1",
            "--endpoint", cloud.url, "--obs-endpoint", cloud.url, "--code-dir", str(code), *extra]


EXPECTED_BODY = {
    "kind": "job",
    "metadata": {"name": "naohai-tiny", "description": "naohai training job", "workspace_id": "ws-1"},
    "algorithm": {
        "code_dir": "/naohai-bkt/code/",
        "boot_file": "/naohai-bkt/code/run/modelarts_boot.sh",
        "parameters": [{"name": "recipe", "value": "recipes/tiny.yaml"},
                       {"name": "strategy", "value": "strategies/dp2.yaml"},
                       {"name": "overrides", "value": "train.steps=7"},
                       {"name": "device", "value": "Ascend"}],   # --device default: ModelArts nodes are Ascend
        "inputs": [],
        "outputs": [{"name": "output", "remote": {"obs": {"obs_url": "/naohai-bkt/out/"}}}],
        "environments": {"PYTHONUNBUFFERED": "1"},
        "engine": {"engine_name": "MindSpore", "engine_version": "2.10.0"},
    },
    "spec": {"resource": {"flavor_id": "modelarts.p3.large.8", "node_count": 2, "pool_id": "pool-9"},
             "log_export_path": {"obs_url": "/naohai-bkt/logs/"}},
}


def assert_no_secret(capsys, caplog):
    captured = capsys.readouterr()
    for text in (captured.out, captured.err, caplog.text):
        assert SK not in text
    return captured


def test_create_uploads_code_and_posts_body(cloud, creds, code, capsys, caplog):
    caplog.set_level(logging.DEBUG)
    assert main(create_args(cloud, code)) == 0
    out = assert_no_secret(capsys, caplog).out
    uploaded = sorted(k for k in cloud.objects)
    assert uploaded == ["naohai-bkt/code/pkg/mod.py", "naohai-bkt/code/recipes/tiny.yaml",
                        "naohai-bkt/code/run/modelarts_boot.sh", "naohai-bkt/code/strategies/dp2.yaml"]
    assert cloud.objects["naohai-bkt/code/strategies/dp2.yaml"] == b"name: dp2\nmesh: {data: 2}\n"
    for put in cloud.find("PUT", "/naohai-bkt/"):
        assert put.headers["Authorization"].startswith(f"AWS {AK}:")   # OBS v2 signature at a local server
    [create] = cloud.find("POST", "/training-jobs")
    assert create.path == f"/v2/{PID}/training-jobs"
    assert AUTH_RE.match(create.headers["Authorization"]), create.headers["Authorization"]
    assert create.headers["X-Project-Id"] == PID and create.headers["X-Sdk-Date"]
    assert create.json() == EXPECTED_BODY
    job_id = next(iter(cloud.jobs))
    assert f"id {job_id}" in out


def test_multipart_upload_of_large_data(cloud, creds, code, tmp_path, capsys, caplog):
    data = tmp_path / "shards"
    data.mkdir()
    blob = os.urandom(250 * 1024) * 12            # 3000 KiB -> 3 parts of 1 MiB
    (data / "train.bin").write_bytes(blob)
    (data / "meta.json").write_text("{}")
    opts = submission.SubmitOptions(
        recipe=str(code / "recipes" / "tiny.yaml"),
        platform=JobPlatform(name="j", flavor="f", image_url="swr.example/ns/img:1"),
        code_obs="/naohai-bkt/code/", output_obs="/naohai-bkt/out/", data=str(data),
        data_obs="/naohai-bkt/data/", endpoint=cloud.url, obs_endpoint=cloud.url, code_dir=str(code),
        excludes=(".git",), multipart_threshold=1024 * 1024, part_size=1024 * 1024)
    submission.submit(opts, os.environ)
    assert_no_secret(capsys, caplog)
    key = "/naohai-bkt/data/train.bin"
    [init] = [r for r in cloud.find("POST", key) if "uploads" in r.query]
    parts = [r for r in cloud.find("PUT", key) if "partNumber" in r.query]
    [done] = [r for r in cloud.find("POST", key) if "uploadId" in r.query]
    upload_id = parts[0].query["uploadId"][0]
    assert sorted(int(p.query["partNumber"][0]) for p in parts) == [1, 2, 3]
    assert all(p.query["uploadId"] == [upload_id] for p in parts) and done.query["uploadId"] == [upload_id]
    for n in (1, 2, 3):
        assert f"<PartNumber>{n}</PartNumber>" in done.body.decode() and f"etag-{n}" in done.body.decode()
    assert cloud.objects["naohai-bkt/data/train.bin"] == blob
    assert cloud.objects["naohai-bkt/data/meta.json"] == b"{}"
    assert init.headers["Authorization"].startswith(f"AWS {AK}:")
    body = cloud.find("POST", "/training-jobs")[0].json()
    assert body["algorithm"]["inputs"] == [{"name": "data", "remote": {"obs": {"obs_url": "/naohai-bkt/data/"}}}]
    assert body["algorithm"]["engine"] == {"image_url": "swr.example/ns/img:1"}


def test_status_list_logs_stop(cloud, creds, code, capsys, caplog):
    caplog.set_level(logging.DEBUG)
    assert main(create_args(cloud, code)) == 0
    job_id = next(iter(cloud.jobs))
    ep = ["--endpoint", cloud.url]
    capsys.readouterr()
    assert main(["submit", "status", job_id, *ep]) == 0
    assert "phase: Running / Running" in capsys.readouterr().out
    assert main(["submit", "list", *ep, "--limit", "5"]) == 0
    listing = capsys.readouterr().out
    assert job_id in listing and "naohai-tiny" in listing
    assert main(["submit", "logs", job_id, "--task", "worker-1", *ep]) == 0
    assert capsys.readouterr().out == f"log of {job_id} task worker-1\nstep 1 loss 10.4\n"
    assert main(["submit", "stop", job_id, *ep]) == 0
    assert "Terminating" in capsys.readouterr().out
    assert_no_secret(capsys, caplog)
    pid_path = f"/v2/{PID}/training-jobs/{job_id}"
    [show] = [r for r in cloud.find("GET") if r.path == pid_path]
    [search] = cloud.find("POST", "/training-job-searches")
    assert search.path == f"/v2/{PID}/training-job-searches"
    assert search.json() == {"limit": 5, "offset": 0, "sort_by": "create_time", "order": "desc"}
    [logs] = cloud.find("GET", "/logs/preview")
    assert logs.path == f"{pid_path}/tasks/worker-1/logs/preview"
    [stop] = cloud.find("POST", "/actions")
    assert stop.path == f"{pid_path}/actions" and stop.json() == {"action_type": "terminate"}
    for rec in (show, search, logs, stop):
        assert AUTH_RE.match(rec.headers["Authorization"])


def test_4xx_names_platform_error(cloud, creds, code, capsys, caplog):
    caplog.set_level(logging.DEBUG)
    cloud.fail[("POST", f"/v2/{PID}/training-jobs")] = (
        400, {"error_code": "ModelArts.2601", "error_msg": f"flavor not found (key {SK})"})
    assert main(create_args(cloud, code)) == 2
    err = assert_no_secret(capsys, caplog).err
    assert "ModelArts.2601" in err and "flavor not found" in err and "req-fake-4xx" in err
    assert "status 400" in err and "Traceback" not in err
    assert main(["submit", "status", "job-missing", "--endpoint", cloud.url]) == 2
    err = assert_no_secret(capsys, caplog).err
    assert "ModelArts.2762" in err and "req-fake-404" in err


def test_refused_connection_is_clear(creds, code, capsys):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    assert main(["submit", "status", "job-1", "--endpoint", dead]) == 2
    err = capsys.readouterr().err
    assert "cannot connect to ModelArts" in err and SK not in err
    with pytest.raises(UserError, match="cannot connect to OBS"):
        submission.submit(submission.SubmitOptions(
            recipe=str(code / "recipes" / "tiny.yaml"), platform=JobPlatform(name="j", flavor="f", image_url="img"),
            code_obs="/naohai-bkt/c/", output_obs="/naohai-bkt/o/", endpoint=dead, obs_endpoint=dead,
            code_dir=str(code)), os.environ)


def test_dry_run_prints_body_and_sends_nothing(cloud, creds, code, capsys, caplog):
    assert main(create_args(cloud, code, "--dry-run")) == 0
    out = assert_no_secret(capsys, caplog).out
    assert cloud.requests == []
    assert '"boot_file": "/naohai-bkt/code/run/modelarts_boot.sh"' in out
    assert "(4 files," in out                       # the excludes are applied to the plan too
    listed = [line.split(" (")[0].strip() for line in out.split("files that would be uploaded:\n")[1].splitlines()
              if line.startswith("  ")][:4]
    assert listed == ["pkg/mod.py", "recipes/tiny.yaml", "run/modelarts_boot.sh", "strategies/dp2.yaml"]
    assert "HUAWEICLOUD_SDK_AK=AKFA****" in out and "HUAWEICLOUD_SDK_SK=<redacted>" in out
    assert AK not in out


def test_layout_the_device_cannot_run_is_refused_before_upload(cloud, creds, code, capsys):
    shutil.copy(os.path.join(ROOT, "strategies", "tiny-dp2-mp2.yaml"), code / "strategies" / "mp.yaml")
    args = create_args(cloud, code, "--device", "CPU")
    args[args.index("--strategy") + 1] = str(code / "strategies" / "mp.yaml")
    assert main(args) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "cannot execute on CPU" in err and "mp.yaml" in err and "Traceback" not in err
    assert cloud.requests == []        # nothing uploaded, no job created


def test_missing_project_id(cloud, monkeypatch, code, capsys):
    monkeypatch.setenv("HUAWEICLOUD_SDK_AK", AK)
    monkeypatch.setenv("HUAWEICLOUD_SDK_SK", SK)
    monkeypatch.delenv("HUAWEICLOUD_SDK_PROJECT_ID", raising=False)
    assert main(create_args(cloud, code)) == 2
    err = capsys.readouterr().err
    assert "HUAWEICLOUD_SDK_PROJECT_ID" in err and SK not in err
    assert cloud.requests == []


def test_missing_sdk_says_how_to_install(cloud, creds, code, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "huaweicloudsdkmodelarts.v1", None)
    assert main(["submit", "list", "--endpoint", cloud.url]) == 2
    assert "pip install 'naohai[modelarts]'" in capsys.readouterr().err


@pytest.mark.parametrize("argv, key", [
    (["--engine-name", "MindSpore", "--engine-version", "2.10.0", "--image-url", "x"], "--image-url"),
    (["--name", "bad name!"], "--name"),
    (["--code-obs", "bucket/path"], "--code-obs"),
    (["--output-obs", "/B!/x/"], "--output-obs"),
    (["--data", "/nonexistent"], "--data-obs"),
])
def test_bad_create_flags(cloud, creds, code, argv, key, capsys):
    with pytest.raises(UserError) as info:
        args = create_args(cloud, code, *argv)
        from naohai.cli import build_parser
        ns = build_parser().parse_args(args)
        ns.run(ns)
    assert info.value.key == key
    assert cloud.requests == []


def test_recipe_outside_code_dir(cloud, creds, code, tmp_path):
    outside = tmp_path / "elsewhere.yaml"
    shutil.copy(code / "recipes" / "tiny.yaml", outside)
    with pytest.raises(UserError, match="inside the uploaded code directory"):
        submission.build_request(submission.SubmitOptions(
            recipe=str(outside), platform=JobPlatform(name="j", flavor="f", image_url="img"),
            code_obs="/naohai-bkt/c/", output_obs="/naohai-bkt/o/", code_dir=str(code)))


def test_obs_path_forms():
    assert parse_obs_path("/bkt/a/b", "--x").api_form == "/bkt/a/b/"
    assert parse_obs_path("obs://bkt/a/", "--x").api_form == "/bkt/a/"
    assert parse_obs_path("/bkt", "--x").api_form == "/bkt/"
    assert parse_obs_path("/bkt/a/", "--x").child("run/x.sh").key == "a/run/x.sh"


def test_git_checkout_uploads_what_git_keeps(tmp_path):
    """In a git checkout the upload is the tracked and not-ignored files; the repository's own .gitignore
    keeps MindSpore's compiler leftovers (akg_kernel_meta/, dsa_transfrom.log, kernel_build_tmp.key) out."""
    from naohai.launch.obs_upload import collect_files
    root = tmp_path / "repo"
    root.mkdir()
    shutil.copy(os.path.join(ROOT, ".gitignore"), root / ".gitignore")
    for rel in ("naohai/a.py", "notes.txt", "akg_kernel_meta/Fused_AddN_1.so", "dsa_transfrom.log",
                "kernel_build_tmp.key", "runs/tiny/metrics.jsonl", "kernel_meta/x.o", "scratch/big.bin"):
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text("x")
    run = lambda *a: subprocess.run(["git", "-C", str(root), *a], check=True, capture_output=True)  # noqa: E731
    run("init", "-q")
    (root / ".git" / "info" / "exclude").write_text("scratch/\n")
    run("add", ".gitignore", "naohai/a.py")
    assert [rel for _, rel in collect_files(str(root))] == [".gitignore", "naohai/a.py", "notes.txt"]


# ---------------------------------------------------------------------- --dry-run of every action, unread flags
JOB = "job-123"
ACTION_ARGV = {            # action -> (argv after `submit`, method, path after the endpoint, JSON body or None)
    "stop": (["stop", JOB], "POST", f"/v2/{PID}/training-jobs/{JOB}/actions", {"action_type": "terminate"}),
    "status": (["status", JOB], "GET", f"/v2/{PID}/training-jobs/{JOB}", None),
    "logs": (["logs", JOB, "--task", "worker-1"], "GET",
             f"/v2/{PID}/training-jobs/{JOB}/tasks/worker-1/logs/preview", None),
    "list": (["list", "--limit", "5"], "POST", f"/v2/{PID}/training-job-searches",
             {"limit": 5, "offset": 0, "sort_by": "create_time", "order": "desc"}),
}


@pytest.fixture
def job(cloud):
    """A running job the fake platform knows, so a real stop/status/logs of it would succeed."""
    cloud.jobs[JOB] = {"kind": "job", "metadata": {"id": JOB, "name": "naohai-tiny"},
                       "status": {"phase": "Running"}}
    return JOB


def _printed_request(out: str):
    """(method, url, body) from a dry run's output: the line after the header, and the JSON line after it."""
    lines = out.splitlines()
    [at] = [i for i, line in enumerate(lines) if "dry run, nothing sent" in line]
    method, url = lines[at + 1].split(" ", 1)
    body = json.loads(lines[at + 2]) if lines[at + 2].startswith("{") else None
    return method, url, body


@pytest.mark.parametrize("action", sorted(ACTION_ARGV))
def test_action_dry_run_prints_the_request_and_sends_nothing(action, cloud, creds, job, capsys, caplog):
    """Found by a probe: `submit stop JOB --dry-run` sent POST .../actions {"action_type": "terminate"}."""
    caplog.set_level(logging.DEBUG)
    argv, method, path, body = ACTION_ARGV[action]
    assert main(["submit", *argv, "--dry-run", "--endpoint", cloud.url]) == 0
    out = assert_no_secret(capsys, caplog).out
    assert cloud.requests == []                       # the server received nothing
    assert cloud.jobs[JOB]["status"] == {"phase": "Running"}
    assert _printed_request(out) == (method, cloud.url + path, body)
    assert f"{method} {cloud.url}{path}" in out
    assert "HUAWEICLOUD_SDK_AK=AKFA****" in out and "HUAWEICLOUD_SDK_SK=<redacted>" in out and AK not in out
    assert "stop requested" not in out
    if action == "stop":
        assert f"job {JOB} is not stopped" in out


@pytest.mark.parametrize("action", sorted(ACTION_ARGV))
def test_an_action_word_is_the_action_even_beside_a_file_of_that_name(action, cloud, creds, job, capsys, tmp_path,
                                                                      monkeypatch):
    """A file named `stop` (or list, logs, status) in the current folder used to turn `naohai submit stop JOB`
    into the creation of a job from that file; the word is now always the action."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / action).write_text("name: not-a-recipe\n")
    argv, method, path, body = ACTION_ARGV[action]
    assert main(["submit", *argv, "--dry-run", "--endpoint", cloud.url]) == 0
    assert _printed_request(capsys.readouterr().out) == (method, cloud.url + path, body)


@pytest.mark.parametrize("action", sorted(ACTION_ARGV))
def test_action_dry_run_is_the_request_a_real_run_sends(action, cloud, creds, job, capsys):
    argv, _, _, _ = ACTION_ARGV[action]
    assert main(["submit", *argv, "--dry-run", "--endpoint", cloud.url]) == 0
    method, url, body = _printed_request(capsys.readouterr().out)
    assert cloud.requests == []
    assert main(["submit", *argv, "--endpoint", cloud.url]) == 0
    [sent] = cloud.requests
    assert (sent.method, cloud.url + sent.path, sent.json() if sent.body else None) == (method, url, body)


@pytest.mark.parametrize("action", sorted(ACTION_ARGV))
def test_action_dry_run_needs_no_sdk_client_and_no_credentials(action, cloud, monkeypatch, job, capsys):
    """No SDK client is built (so no credential lookup that could call IAM) and nothing is required."""
    for var in ("HUAWEICLOUD_SDK_AK", "HUAWEICLOUD_SDK_SK", "HUAWEICLOUD_SDK_PROJECT_ID"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setitem(sys.modules, "huaweicloudsdkmodelarts.v1", None)
    monkeypatch.setitem(sys.modules, "huaweicloudsdkcore.auth.credentials", None)

    def no_client(*a, **k):
        raise AssertionError("a dry run built an SDK client")
    monkeypatch.setattr(submission, "TrainingJobs", no_client)
    monkeypatch.setattr(submission, "jobs_client", no_client)
    argv, method, path, _ = ACTION_ARGV[action]
    assert main(["submit", *argv, "--dry-run", "--endpoint", cloud.url]) == 0
    out = capsys.readouterr().out
    assert cloud.requests == []
    assert f"{method} {cloud.url}{path.replace(PID, '{project_id}')}" in out
    assert "cannot be sent as is" in out and "export HUAWEICLOUD_SDK_PROJECT_ID" in out


def test_create_dry_run_names_method_and_url(cloud, creds, code, capsys):
    assert main(create_args(cloud, code, "--dry-run")) == 0
    out = capsys.readouterr().out
    assert f"POST {cloud.url}/v2/{PID}/training-jobs\n" in out
    assert cloud.requests == []


@pytest.mark.parametrize("argv, flag", [
    (["stop", JOB, "--task", "worker-1"], "--task"),
    (["status", JOB, "--limit", "5"], "--limit"),
    (["list", "--task", "worker-1"], "--task"),
    (["logs", JOB, "--limit", "3"], "--limit"),
    (["stop", JOB, "--name", "x"], "--name"),
    (["list", "--nodes", "1"], "--nodes"),
    (["status", JOB, "--device", "Ascend"], "--device"),
    (["logs", JOB, "--code-obs", "/naohai-bkt/code/"], "--code-obs"),
])
@pytest.mark.parametrize("dry", [False, True])
def test_flags_an_action_does_not_read_exit_2(argv, flag, dry, cloud, creds, job, capsys):
    assert main(["submit", *argv, "--endpoint", cloud.url, *(["--dry-run"] if dry else [])]) == 2
    err = capsys.readouterr().err
    assert f"key '{flag}'" in err and "would be ignored" in err and f"Drop {flag}" in err
    assert "(rule: " in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert cloud.requests == [] and cloud.jobs[JOB]["status"] == {"phase": "Running"}


@pytest.mark.parametrize("extra, flag", [(["--task", "worker-1"], "--task"), (["--limit", "-5"], "--limit"),
                                         (["--limit", "5"], "--limit")])
@pytest.mark.parametrize("dry", [False, True])
def test_create_refuses_the_flags_of_other_actions(extra, flag, dry, cloud, creds, code, capsys):
    assert main(create_args(cloud, code, *extra, *(["--dry-run"] if dry else []))) == 2
    err = capsys.readouterr().err
    assert f"key '{flag}'" in err and "creating a job" in err and "Traceback" not in err
    assert cloud.requests == [] and cloud.objects == {}


@pytest.mark.parametrize("limit", ["0", "-5", "51"])
@pytest.mark.parametrize("dry", [False, True])
def test_list_limit_is_1_to_50(limit, dry, cloud, creds, capsys):
    assert main(["submit", "list", "--limit", limit, "--endpoint", cloud.url,
                 *(["--dry-run"] if dry else [])]) == 2
    err = capsys.readouterr().err
    assert "key '--limit'" in err and f"got {limit}" in err and "1 <= --limit <= 50" in err
    assert "Traceback" not in err and cloud.requests == []


@pytest.mark.parametrize("argv, key", [(["stop", ""], None), (["logs", JOB, "--task", " "], "--task")])
def test_empty_job_or_task_id(argv, key, cloud, creds, capsys):
    assert main(["submit", *argv, "--endpoint", cloud.url]) == 2
    err = capsys.readouterr().err
    assert "empty" in err and (key is None or f"key '{key}'" in err)
    assert cloud.requests == []
