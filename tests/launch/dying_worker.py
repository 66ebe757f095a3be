"""Worker script for test_msrun_failure: rank 1 dies after the cluster forms.

DIE=exit makes it call sys.exit(1); DIE=kill makes it SIGKILL itself.  Other ranks
sleep far longer than the test allows, so only msrun killing them ends the job.
"""
import os
import signal
import sys
import time

import mindspore as ms
from mindspore.communication import get_rank, init

ms.set_device("CPU")
init()
rank = get_rank()
print(f"rank {rank} joined", flush=True)
if rank == 1:
    time.sleep(1)
    print("rank 1 is about to die", flush=True)
    if os.environ.get("DIE") == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    sys.exit(1)
time.sleep(300)
