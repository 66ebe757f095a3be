"""The PyTorch rows: the peer in ``run/bench/torch_peer.py``, eager and ``torch.compile``.

PyTorch is optional (``pip install -e ".[bench]"``); :func:`peer_module` returns
``(module, None)`` or ``(None, why not)`` -- PyTorch missing, or the peer file absent
(it ships with the source tree, not in the package).  :class:`TorchRun` trains the
peer on the same batches naohai's loader gives (same random-token folder, batch, sequence,
float32, AdamW with naohai's decay groups and betas, clip 1.0); a round returns the
seconds of each step but the first (the compile, in the first round of ``torch.compile``).
"""
from __future__ import annotations

import importlib.util
import os
import time
from typing import List, Optional, Tuple

import naohai
from naohai.bench.models import BenchModel

PEER_PATH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(naohai.__file__))), "run", "bench",
                         "torch_peer.py")


def peer_module(path: str = PEER_PATH) -> Tuple[Optional[object], Optional[str]]:
    try:
        import torch  # noqa: F401
    except ImportError:
        return None, "PyTorch is not installed (pip install -e \".[bench]\"); only naohai's rows were measured"
    if not os.path.isfile(path):
        return None, f"the PyTorch peer {path} is not here (it ships with the source tree, run/bench/)"
    spec = importlib.util.spec_from_file_location("naohai_bench_torch_peer", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module, None


class TorchRun:
    def __init__(self, peer, bm: BenchModel, prepared_dir: str, train, compiled: bool, seed: int = 0):
        import torch
        from naohai.data.loader import TokenWindowLoader

        self.torch = torch
        if os.environ.get("NAOHAI_BENCH_TORCH_THREADS"):
            torch.set_num_threads(int(os.environ["NAOHAI_BENCH_TORCH_THREADS"]))
        torch.manual_seed(seed)
        self.model = peer.make_peer(bm.model, seed=seed)
        opt = train.optimizer
        self.step = peer.make_train_step(self.model, lr=train.lr_schedule.lr, weight_decay=opt.weight_decay,
                                         betas=(opt.adam_beta1, opt.adam_beta2), eps=opt.adam_eps,
                                         grad_clip=opt.grad_clip, compile=compiled)
        self.loader = TokenWindowLoader(prepared_dir, "train", bm.batch, seed=1)
        self.first_step_s: Optional[float] = None

    def _batch(self):
        batch = self.torch.from_numpy(self.loader.next_batch().astype("int64"))
        return batch[:, :-1], batch[:, 1:]

    def round(self, steps: int) -> List[float]:
        times = []
        for i in range(int(steps)):
            t0 = time.perf_counter()
            self.step(*self._batch())
            times.append(time.perf_counter() - t0)
        if self.first_step_s is None:
            self.first_step_s = times[0]
        return times[1:]
