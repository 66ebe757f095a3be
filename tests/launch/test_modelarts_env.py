"""ModelArts platform variables -> naohai launch flags, and the boot script end to end."""
import os
import subprocess

import pytest

from naohai.errors import UserError
from naohai.launch.modelarts_env import flags_from_env

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FAKE_DNS = {"job-worker-0.job": "192.168.0.10"}.get


def resolve(host):
    return FAKE_DNS(host, host)


def test_one_node_defaults_to_8_devices_and_local_master():
    assert flags_from_env({"MA_NUM_HOSTS": "1"}, resolve) == [
        "--nodes", "1", "--node-rank", "0", "--devices-per-node", "8"]


def test_four_nodes_third_node():
    env = {"VC_WORKER_NUM": "4", "VC_TASK_INDEX": "2", "MA_NUM_GPUS": "8",
           "VC_WORKER_HOSTS": "job-worker-0.job,job-worker-1.job,job-worker-2.job,job-worker-3.job"}
    assert flags_from_env(env, resolve) == [
        "--nodes", "4", "--node-rank", "2", "--devices-per-node", "8", "--master-addr", "192.168.0.10"]


def test_ma_num_hosts_wins_over_vc_worker_num():
    env = {"MA_NUM_HOSTS": "2", "VC_WORKER_NUM": "9", "VC_TASK_INDEX": "0", "VC_WORKER_HOSTS": "a,b"}
    assert flags_from_env(env, resolve)[:2] == ["--nodes", "2"]


@pytest.mark.parametrize("env, var", [
    ({}, "MA_NUM_HOSTS"),
    ({"MA_NUM_HOSTS": "2", "VC_WORKER_HOSTS": "a,b"}, "VC_TASK_INDEX"),
    ({"MA_NUM_HOSTS": "2", "VC_TASK_INDEX": "1"}, "VC_WORKER_HOSTS"),
    ({"MA_NUM_HOSTS": "3", "VC_TASK_INDEX": "1", "VC_WORKER_HOSTS": "a,b"}, "VC_WORKER_HOSTS"),
    ({"MA_NUM_HOSTS": "two"}, "MA_NUM_HOSTS"),
    ({"VC_WORKER_NUM": "0"}, "VC_WORKER_NUM"),
    ({"MA_NUM_HOSTS": "1", "MA_NUM_GPUS": "eight"}, "MA_NUM_GPUS"),
    ({"MA_NUM_HOSTS": "2", "VC_TASK_INDEX": "2", "VC_WORKER_HOSTS": "a,b"}, "VC_TASK_INDEX"),
    ({"MA_NUM_HOSTS": "2", "VC_TASK_INDEX": "-1", "VC_WORKER_HOSTS": "a,b"}, "VC_TASK_INDEX"),
])
def test_bad_environment_names_the_variable(env, var):
    with pytest.raises(UserError) as info:
        flags_from_env(env, resolve)
    assert info.value.key == var
    assert var in str(info.value)


def _boot(env, *args):
    clean = {k: v for k, v in os.environ.items()
             if not k.startswith(("MA_", "VC_")) and k != "RANK_TABLE_FILE"}
    clean.update(env, DRY_RUN="1")
    return subprocess.run([os.path.join(ROOT, "run", "modelarts_boot.sh"), *args], env=clean,
                          capture_output=True, text=True, timeout=60)


STRATEGY = os.path.join(ROOT, "strategies", "tiny-dp2-mp2.yaml")   # data 2 x model 2: 4 workers


def test_boot_script_two_nodes(tmp_path):
    res = _boot({"MA_NUM_HOSTS": "2", "VC_TASK_INDEX": "1", "MA_NUM_GPUS": "2",
                 "VC_WORKER_HOSTS": "127.0.0.1,10.9.9.9", "RANK_TABLE_FILE": "/user/config/x.json"},
                "tiny", STRATEGY, "train.micro_batch_size=8", "--device", "Ascend")
    assert res.returncode == 0, res.stderr
    msrun = res.stdout.strip().splitlines()[-1]
    assert msrun == ("msrun --worker_num 4 --local_worker_num 2 --master_addr 127.0.0.1 --master_port 8118 "
                     "--node_rank 1 --log_dir runs/msrun_logs --join True --cluster_time_out 600 "
                     f"python -m naohai.cli train tiny train.micro_batch_size=8 --strategy {STRATEGY} "
                     "--device Ascend")


def test_boot_file_form_carries_the_device_to_the_workers():
    """The --name=value form ModelArts uses: the job's device parameter reaches every worker."""
    res = _boot({"MA_NUM_HOSTS": "1", "MA_NUM_GPUS": "4", "VC_WORKER_HOSTS": "127.0.0.1"},
                "--recipe=tiny", f"--strategy={STRATEGY}", "--overrides=train.micro_batch_size=8",
                "--device=Ascend")
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip().splitlines()[-1].endswith(
        f"python -m naohai.cli train tiny train.micro_batch_size=8 --strategy {STRATEGY} --device Ascend")


def test_boot_script_refuses_semi_auto_on_cpu_before_workers():
    res = _boot({"MA_NUM_HOSTS": "1", "MA_NUM_GPUS": "4", "VC_WORKER_HOSTS": "127.0.0.1"},
                "--recipe=tiny", f"--strategy={STRATEGY}", "--overrides=train.micro_batch_size=8",
                "--device=CPU")
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert "cannot execute on CPU" in " ".join(res.stderr.split())
    assert not any(line.startswith("msrun") for line in res.stdout.splitlines())


def test_boot_script_missing_variable_exits_2(tmp_path):
    res = _boot({"MA_NUM_HOSTS": "2", "VC_WORKER_HOSTS": "a,b"}, "r.yaml", "s.yaml")
    assert res.returncode == 2
    assert "VC_TASK_INDEX" in res.stderr and "Traceback" not in res.stderr
