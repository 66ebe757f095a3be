"""msrun argv building and plan validation (no processes started)."""
import re
import socket
from pathlib import Path

import pytest

from naohai.cli import build_parser, main
from naohai.errors import UserError
from naohai.launch.devices import worker_count
from naohai.launch.msrun import MsrunPlan, build_msrun_command, build_rank_table_processes, diagnose
from tests.conftest import folder_locked

ROOT = Path(__file__).resolve().parents[2]


def test_single_node_argv():
    plan = MsrunPlan(recipe="recipes/tiny.yaml", strategy="strategies/dp2.yaml", workers=2,
                     log_dir="logs", overrides=["train.steps=3"])
    assert build_msrun_command(plan) == [
        "msrun", "--worker_num", "2", "--local_worker_num", "2", "--master_addr", "127.0.0.1",
        "--master_port", "8118", "--node_rank", "0", "--log_dir", "logs", "--join", "True",
        "--cluster_time_out", "600", "python", "-m", "naohai.cli", "train", "recipes/tiny.yaml",
        "train.steps=3", "--strategy", "strategies/dp2.yaml"]


def test_entry_is_accepted_by_the_train_parser():
    plan = MsrunPlan(recipe="tiny", strategy="s.yaml", workers=2, overrides=["train.steps=3", "train.lr=0.1"])
    argv = build_msrun_command(plan)
    entry = argv[argv.index("naohai.cli") + 1:]
    args = build_parser().parse_args(entry)
    assert (args.command, args.recipe, args.strategy, args.overrides) == (
        "train", "tiny", "s.yaml", ["train.steps=3", "train.lr=0.1"])


def test_two_node_argv_second_node():
    plan = MsrunPlan(recipe="r.yaml", strategy=None, workers=16, nodes=2, node_rank=1,
                     master_addr="10.1.2.3", master_port="9000", log_dir="/cache/log", join=False,
                     cluster_time_out=300, bind_core=True, rank_table_file="/user/config/jobstart_hccl.json")
    assert build_msrun_command(plan) == [
        "msrun", "--worker_num", "16", "--local_worker_num", "8", "--master_addr", "10.1.2.3",
        "--master_port", "9000", "--node_rank", "1", "--log_dir", "/cache/log", "--join", "False",
        "--cluster_time_out", "300", "--bind_core", "True",
        "--rank_table_file", "/user/config/jobstart_hccl.json",
        "python", "-m", "naohai.cli", "train", "r.yaml"]
    assert plan.ranks() == [8, 9, 10, 11, 12, 13, 14, 15]


def test_rank_table_processes_env():
    plan = MsrunPlan(recipe="r.yaml", strategy="s.yaml", workers=4, nodes=2, node_rank=1,
                     master_addr="node0", rank_table_file="rt.json", rank_table_mode="processes")
    procs = build_rank_table_processes(plan)
    assert [env for _, env in procs] == [
        {"RANK_TABLE_FILE": "rt.json", "RANK_ID": "2", "DEVICE_ID": "0", "RANK_SIZE": "4"},
        {"RANK_TABLE_FILE": "rt.json", "RANK_ID": "3", "DEVICE_ID": "1", "RANK_SIZE": "4"}]
    assert procs[0][0] == ["python", "-m", "naohai.cli", "train", "r.yaml", "--strategy", "s.yaml"]


@pytest.mark.parametrize("changes, key", [
    (dict(nodes=2, node_rank=2, master_addr="a"), "node_rank"),
    (dict(node_rank=-1), "node_rank"),
    (dict(master_port="http"), "master_port"),
    (dict(master_port=70000), "master_port"),
    (dict(master_port=0), "master_port"),
    (dict(workers=6, nodes=4, master_addr="a"), "workers"),
    (dict(workers=0), "workers"),
    (dict(nodes=2, workers=4), "master_addr"),
    (dict(master_addr="bad host!"), "master_addr"),
    (dict(local_workers=3), "local_workers"),
    (dict(rank_table_mode="processes"), "rank_table_file"),
    (dict(node_time_out=0), "node_time_out"),
])
def test_validation_errors_name_the_key(changes, key):
    base = dict(recipe="r.yaml", strategy=None, workers=4)
    base.update(changes)
    with pytest.raises(UserError) as info:
        build_msrun_command(MsrunPlan(**base))
    assert info.value.key == key


def test_worker_count_from_mesh(tmp_path):
    s = tmp_path / "s.yaml"
    s.write_text("mesh: {data: 2, model: 4, pipeline: 2}\n")
    assert worker_count(str(s), None, 2) == 16
    assert worker_count(str(s), 8, 2) == 16
    with pytest.raises(UserError, match="needs 16 devices"):
        worker_count(str(s), 4, 2)
    plain = tmp_path / "p.yaml"
    plain.write_text("name: x\n")
    assert worker_count(str(plain), 8, 3) == 24
    bad = tmp_path / "b.yaml"
    bad.write_text("mesh: {data: two}\n")
    with pytest.raises(UserError) as info:
        worker_count(str(bad), None, 1)
    assert info.value.key == "mesh.data"


def test_cli_dry_run_prints_command(tmp_path, capsys):
    s = tmp_path / "s.yaml"
    s.write_text("mesh: {data: 2}\n")
    code = main(["launch", "tiny", "train.micro_batch_size=8", "--strategy", str(s), "--log-dir", "L",
                 "--node-time-out", "7", "--dry-run"])
    out = capsys.readouterr().out.strip()
    assert code == 0
    # one node, no --master-port: a free port from the kernel's ephemeral range, not 8118 where MindSpore's
    # workers listen; train.device auto is decided here (this machine: CPU) and passed to every worker
    port = int(re.search(r"--master_port (\d+) ", out).group(1))
    low, high = _ephemeral_ports()
    assert low <= port <= high
    assert out == ("MS_NODE_TIMEOUT=7 msrun --worker_num 2 --local_worker_num 2 --master_addr 127.0.0.1 "
                   f"--master_port {port} --node_rank 0 --log_dir L --join True --cluster_time_out 600 "
                   f"python -m naohai.cli train tiny train.micro_batch_size=8 --strategy {s} --device CPU")


def test_launch_refuses_pipeline_on_cpu_before_any_worker(capsys, tmp_path):
    """The acceptance case: exit 2, one paragraph naming device, strategy and the check to run."""
    import subprocess
    import sys
    import time
    t0 = time.time()
    out = tmp_path / "run"        # not the checkout's runs/tiny, which the README's own commands use meanwhile
    res = subprocess.run([sys.executable, "-m", "naohai.cli", "launch", "tiny", "train.micro_batch_size=2",
                          f"train.output_dir={out}", "--strategy", "strategies/tiny-dp2-mp2-pp2.yaml",
                          "--log-dir", str(tmp_path / "logs")],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and "Traceback" not in res.stderr and "[WARNING]" not in res.stderr
    assert "cannot execute on CPU" in " ".join(res.stderr.split()) and "tiny-dp2-mp2-pp2.yaml" in res.stderr
    assert f"naohai check tiny train.micro_batch_size=2 train.output_dir={out} strategies/tiny-dp2-mp2-pp2.yaml " \
           "--compile" in " ".join(res.stderr.split())
    assert not (tmp_path / "logs").exists() and "msrun" not in res.stdout   # no worker started
    print(f"refused in {time.time() - t0:.1f} s")


def test_cli_bad_flag_is_exit_2(capsys):
    assert main(["launch", "tiny", "--nodes", "2", "--devices-per-node", "2", "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert "master address is required" in err and "Traceback" not in err


def test_diagnose_maps_pid_to_rank(tmp_path):
    (tmp_path / "worker_0.log").write_text("[WARNING] DISTRIBUTED(100,7f,python):x rank 0\nstep 1\n")
    (tmp_path / "worker_1.log").write_text("[WARNING] DISTRIBUTED(101,7f,python):x rank 1\nboom\n")
    out = "[ERROR] ME(99:1,MainProcess):t [x] Worker process 101 exit with exception. Error code: -9.\n"
    dead = diagnose(str(tmp_path), out)
    assert [(r, why) for r, why, _ in dead] == [(1, "killed by signal SIGKILL")]
    assert dead[0][2].endswith("boom")
    # no msrun output: fall back to logs holding a traceback
    (tmp_path / "worker_0.log").write_text("Traceback (most recent call last):\nValueError: x\n")
    assert [r for r, _, _ in diagnose(str(tmp_path), "")] == [0]


def test_default_log_dir_is_in_the_run_folder(capsys):
    assert main(["launch", "tiny", "train.micro_batch_size=8", "train.output_dir=runs/x", "--strategy",
                 str(ROOT / "strategies" / "tiny-dp2.yaml"), "--dry-run"]) == 0
    assert " --log_dir runs/x/msrun_logs " in capsys.readouterr().out


def test_follower_shows_naohai_lines_per_rank_and_hides_mindspore_logs(tmp_path):
    """msrun's worker logs mix MindSpore's logger with naohai's own lines: only the latter are shown,
    prefixed with the rank, each line once, an unfinished line when it is finished."""
    from naohai.launch.msrun import WorkerLogFollower
    shown = []
    follower = WorkerLogFollower(str(tmp_path), shown.append)
    w0, w1 = tmp_path / "worker_0.log", tmp_path / "worker_1.log"
    w0.write_text("[WARNING] ME(4242,7f3a,python):2026-11-25-03:40:00.1 [context.py:1] set_context] deprecated\n"
                  "[INFO] DEVICE(4242,7f3a,python):2026-11-25-03:40:00.2 [x.cc:3] Init] ok\n"
                  "device: CPU (train.device=CPU)\n03:40:05 step      5/50 | loss 7.1")
    w1.write_text("[WARNING] ME(4243,7f3b,python):2026-11-25-03:40:00.1 [a.py:1] f] noise\n")
    follower.poll()
    assert shown == ["[rank 0] device: CPU (train.device=CPU)\n"]
    with open(w0, "a") as fh:
        fh.write(" | lr 1e-3\n[ERROR] ME(4242,7f3a,python):2026 [b.py:2] g] hidden\n")
    with open(w1, "a") as fh:
        fh.write("Traceback (most recent call last):\n")
    follower.poll(final=True)
    assert shown[1:] == ["[rank 0] 03:40:05 step      5/50 | loss 7.1 | lr 1e-3\n",
                         "[rank 1] Traceback (most recent call last):\n"]


def test_machine_check_warns_and_refuses():
    from naohai.launch.devices import check_machine
    gib = 2 ** 30
    warned = []
    check_machine(2, "CPU", False, warned.append, resources=(2, 20 * gib))
    assert warned == []
    check_machine(3, "CPU", False, warned.append, resources=(2, 20 * gib))
    assert len(warned) == 1 and "3 CPU workers share 2 cores" in warned[0]
    with pytest.raises(UserError) as err:
        check_machine(64, "CPU", False, warned.append, resources=(2, 23 * gib))
    text = str(err.value)
    assert "64 CPU workers on 2 cores" in text and "76.8 GiB" in text and "--oversubscribe" in text
    with pytest.raises(UserError, match="need at least 9.6 GiB"):
        check_machine(8, "CPU", False, warned.append, resources=(8, 4 * gib))
    check_machine(64, "CPU", True, warned.append, resources=(2, 23 * gib))
    assert "WARNING (--oversubscribe): 64 CPU workers on 2 cores" in warned[-1]
    check_machine(64, "Ascend", False, warned.append, resources=(2, 1 * gib))    # accelerators: not counted here


def test_a_launch_on_a_folder_another_job_holds_exits_2_before_any_worker(tmp_path, capsys, monkeypatch):
    """The launcher takes the run folder's lock itself (its msrun workers share it as descendants): a
    second launch on the folder exits 2 naming the holder, and msrun is never started."""
    import subprocess
    import sys
    import naohai.commands.launch as launch_command
    out = tmp_path / "run"
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; sys.path.insert(0, sys.argv[1]); "
                               "from naohai.runfiles import lock_folder; lock_folder(sys.argv[2], 'x'); "
                               "print('held', flush=True); time.sleep(60)", str(ROOT), str(out)],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        monkeypatch.setattr(launch_command, "run_msrun", lambda *a, **k: pytest.fail("msrun started"))
        code = main(["launch", "tiny", "train.micro_batch_size=8", f"train.output_dir={out}", "--strategy",
                     str(ROOT / "strategies" / "tiny-dp2.yaml")])
        err = " ".join(capsys.readouterr().err.split())
        assert code == 2 and f"pid {holder.pid}" in err and "train.output_dir" in err and "Traceback" not in err
        # a recipe or strategy mistake is told as itself, busy folder or not (the rules come before the lock)
        code = main(["launch", "tiny", "train.micro_batch_size=3", f"train.output_dir={out}", "--strategy",
                     str(ROOT / "strategies" / "tiny-dp2.yaml")])
        err = " ".join(capsys.readouterr().err.split())
        assert code == 2 and "micro_batch" in err and "in use by another job" not in err and "Traceback" not in err
    finally:
        holder.kill()
        holder.wait()
    # once free, the launch holds the folder while msrun runs, and gives it back when it returns (in-process)
    monkeypatch.setattr(launch_command, "run_msrun",
                        lambda *a, **k: 0 if folder_locked(out) else pytest.fail("msrun ran without the lock"))
    assert main(["launch", "tiny", "train.micro_batch_size=8", f"train.output_dir={out}", "--strategy",
                 str(ROOT / "strategies" / "tiny-dp2.yaml"), "--oversubscribe"]) == 0
    assert not folder_locked(out)


def _ephemeral_ports():
    """The kernel's range for ports it hands out (``bind`` to port 0)."""
    with open("/proc/sys/net/ipv4/ip_local_port_range", encoding="ascii") as fh:
        low, high = map(int, fh.read().split())
    return low, high


def _listening():
    """A socket listening on a free port of 127.0.0.1 (what a running job's worker or scheduler holds)."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    return sock


def test_scheduler_port_is_free_and_off_the_workers_ports_on_one_node_and_checked_when_given():
    """MindSpore's workers listen from 8118 up whatever the scheduler's port: a one-node job's scheduler takes
    a free port from the kernel instead (CI: the README's launch on 8118 failed in MindSpore's cluster set-up
    after 600 s with the message a taken scheduler port gives).  A port given, or several nodes' 8118, is
    refused when in use, naming the holder."""
    import os
    from naohai.launch.msrun import DEFAULT_PORT, scheduler_port
    low, high = _ephemeral_ports()
    with _listening() as busy:
        port = busy.getsockname()[1]
        with pytest.raises(UserError) as info:
            scheduler_port("127.0.0.1", port, nodes=1)
        msg = str(info.value)
        assert info.value.key == "master_port" and f"port {port}" in msg and f"pid {os.getpid()}" in msg
        free = scheduler_port("127.0.0.1", None, nodes=1)
        assert free != port and free != DEFAULT_PORT and low <= free <= high
    assert scheduler_port("127.0.0.1", port, nodes=1) == port    # free again
    assert scheduler_port("192.0.2.1", port, nodes=2) == port    # not this machine's: not checked
    with socket.socket() as held:
        try:
            held.bind(("127.0.0.1", DEFAULT_PORT))
            held.listen()
        except OSError:
            pass                  # another process holds it: the refusal holds all the same
        with pytest.raises(UserError, match=f"port {DEFAULT_PORT} on 127.0.0.1 is in use"):
            scheduler_port("127.0.0.1", None, nodes=2)     # several nodes agree on msrun's default


def test_launch_takes_a_free_port_on_one_node_and_refuses_a_busy_given_one(tmp_path, capsys, monkeypatch):
    import naohai.commands.launch as launch_command
    ran = []
    monkeypatch.setattr(launch_command, "run_msrun", lambda plan, **k: ran.append(plan.master_port) or 0)
    args = ["launch", "tiny", "train.micro_batch_size=8", f"train.output_dir={tmp_path / 'run'}", "--strategy",
            str(ROOT / "strategies" / "tiny-dp2.yaml"), "--oversubscribe"]
    with _listening() as busy:
        port = busy.getsockname()[1]
        assert main(args + ["--master-port", str(port)]) == 2
        err = " ".join(capsys.readouterr().err.split())
        assert f"port {port} on 127.0.0.1 is in use by pid" in err and "Traceback" not in err and not ran
    assert main(args) == 0 and len(ran) == 1 and ran[0] != 8118
    assert main(args + ["--master-port", str(port)]) == 0 and ran[1] == port


@pytest.mark.parametrize("addr,nodes,words", [("no.such.host.invalid", 1, "does not resolve"),
                                               ("no.such.host.invalid", 2, "does not resolve"),
                                               ("192.0.2.1", 1, "not an address of this machine")])
def test_a_master_address_msrun_cannot_use_exits_2(tmp_path, capsys, monkeypatch, addr, nodes, words):
    """An unresolvable name raised socket.gaierror, another machine's address on one node OSError (tracebacks,
    found by a probe); on several nodes another machine's address is node 0's, as before."""
    import naohai.commands.launch as launch_command
    ran = []
    monkeypatch.setattr(launch_command, "run_msrun", lambda plan, **k: ran.append(plan) or 0)
    args = ["launch", "tiny", "train.micro_batch_size=8", f"train.output_dir={tmp_path / 'run'}", "--strategy",
            str(ROOT / "strategies" / "tiny-dp2.yaml"), "--oversubscribe", "--master-addr", addr]
    if nodes > 1:
        args += ["--nodes", str(nodes), "--node-rank", "0", "--devices-per-node", "1"]
    assert main(args) == 2 and not ran
    err = " ".join(capsys.readouterr().err.split())
    assert "key 'master_addr'" in err and words in err and "Traceback" not in err


@pytest.mark.parametrize("flags,key", [(["--cluster-time-out", "0"], "cluster_time_out"),
                                       (["--cluster-time-out", "99999999999999999999"], "cluster_time_out"),
                                       (["--node-time-out", "99999999999999999999"], "node_time_out"),
                                       (["--rank-table", "/no/such/rank_table.json"], "--rank-table")])
def test_launch_numbers_msrun_cannot_take_and_a_missing_rank_table_exit_2(tmp_path, capsys, monkeypatch, flags, key):
    """They were passed to msrun as given (a 0 s cluster time-out fails at once; 1e20 overflows its int)."""
    import naohai.commands.launch as launch_command
    ran = []
    monkeypatch.setattr(launch_command, "run_msrun", lambda plan, **k: ran.append(plan) or 0)
    args = ["launch", "tiny", "train.micro_batch_size=8", f"train.output_dir={tmp_path / 'run'}", "--strategy",
            str(ROOT / "strategies" / "tiny-dp2.yaml"), "--oversubscribe", *flags]
    assert main(args) == 2 and not ran
    err = " ".join(capsys.readouterr().err.split())
    assert f"key '{key}'" in err and "Traceback" not in err


def test_failure_report_says_why_the_cluster_did_not_form(tmp_path):
    """MindSpore's own lines (from a run with the scheduler's port held): the workers' error gets the causes to
    look at; with the scheduler's bind failure in scheduler.log, that one cause is named instead."""
    from naohai.launch.msrun import failure_report
    (tmp_path / "worker_0.log").write_text(
        "[WARNING] DISTRIBUTED(4215,7fac63095e40,python):2026-11-29-13:40:57.388.706 [mindspore/ccsrc/cluster/rpc/"
        "tcp/tcp_comm.cc:485] Connect] Connection 11 source: 127.0.0.1:60548, destination: 127.0.0.1:8118\n"
        "Traceback (most recent call last):\n  File \"w.py\", line 4, in <module>\n    init()\n"
        "RuntimeError: Failed to initialize distributed job cluster because some processes in the cluster are not "
        "successfully spawned.\n")
    report = failure_report(str(tmp_path), "", 1)
    assert "Dead rank(s): 0." in report and "The cluster did not form within --cluster-time-out" in report
    (tmp_path / "scheduler.log").write_text(
        "[WARNING] DISTRIBUTED(4214,7fc71a818e40,python):2026-11-29-13:40:57.304.210 [mindspore/ccsrc/cluster/rpc/"
        "tcp/socket_operation.cc:454] Listen] Failed to call bind, url: 127.0.0.1:8118 Address already in use\n")
    report = failure_report(str(tmp_path), "", 1)
    assert "msrun's scheduler could not listen on 127.0.0.1:8118" in report
    assert "did not form" not in report
