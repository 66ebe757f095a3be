"""Compiling a step in its layout: the ``AutoParallel`` wrapper, the parameter strategy file, compile inputs.

:func:`compile_parallel` returns a cell as it must be called: unchanged outside
semi-auto, else wrapped in MindSpore's ``AutoParallel`` with the pipeline
scheduler, each rank's data-parallel slice of the batch
(``dataset_strategy((dp, 1), (dp, 1))``) and optimizer parallel (``hsdp``).
:func:`save_strategy_file` has MindSpore write the compiled step's parameter
layouts (what checkpoints and reshards read); :func:`skip_parameter_init_in_compile`
and :func:`compile_inputs` serve a compile without data or parameter values.
"""
from __future__ import annotations

from typing import Any, Tuple

import mindspore as ms

from naohai.strategy.resolve import ResolvedStrategy
from naohai.strategy.runtime import Runtime, hsdp_args, optimizer_sharded


def compile_parallel(cell, resolved: ResolvedStrategy, runtime: Runtime, *, train: bool, inputs: int = 2):
    """``cell`` as it must be called in this layout: wrapped in ``AutoParallel`` for semi-auto; each of
    its ``inputs`` graph inputs is split over data parallel on its first (batch) axis."""
    if runtime.mode != "semi_auto":
        return cell
    from mindspore.parallel.auto_parallel import AutoParallel

    parallel = AutoParallel(cell, parallel_mode="semi_auto")
    if runtime.stages > 1:
        # eval graphs: the last stage's loss is broadcast to every stage (MindSpore skips the
        # broadcast for training graphs, whose loss GlobalMeanLoss reduces in the graph)
        parallel.pipeline(stages=runtime.stages, interleave=int(resolved.virtual_chunks) > 1,
                          scheduler=str(resolved.scheduler), output_broadcast=not train)
    dp = int(resolved.data)
    # every model-parallel rank and every stage of a data-parallel group reads the same rows
    parallel.dataset_strategy(tuple((dp, 1) for _ in range(inputs)))
    if optimizer_sharded(resolved):
        parallel.hsdp(**hsdp_args(resolved))
    return parallel


def save_strategy_file(network, path: str) -> None:
    """Have MindSpore write the parameter strategy file of ``network``'s compile to ``path`` (an
    ``AutoParallel`` wrapper's own setting; otherwise the parallel context's)."""
    from mindspore.parallel.auto_parallel import AutoParallel
    if isinstance(network, AutoParallel):
        network.save_param_strategy_file(path)
    else:
        ms.set_auto_parallel_context(strategy_ckpt_config={"save_file": path})


def skip_parameter_init_in_compile(network) -> None:
    """A semi-auto graph built for a compile-only check: MindSpore initialises no parameter slice while
    compiling it (``AutoParallel.no_init_parameters_in_compile``), so host memory holds none."""
    from mindspore.parallel.auto_parallel import AutoParallel
    if isinstance(network, AutoParallel):
        network.no_init_parameters_in_compile()


def compile_inputs(rows: int, seq_length: int) -> Tuple[Any, Any]:
    """Zero ``(input_ids, labels)`` of this rank's shape, for compiling without data."""
    import numpy as np
    from mindspore import Tensor
    ids = Tensor(np.zeros((rows, seq_length), np.int32))
    return ids, Tensor(np.zeros((rows, seq_length), np.int32))
