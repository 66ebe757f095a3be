"""`naohai bench`: throughput, MFU, compile time, loader speed and memory, measured on this machine.

The modules each do one job: :mod:`.models` (the benchmarked configurations),
:mod:`.arith` (MFU and ratio arithmetic), :mod:`.randdata` (a prepared folder of random
tokens), :mod:`.naohai_row` (naohai through its trainer), :mod:`.torch_row` (the PyTorch
peer in ``run/bench/``), :mod:`.matmul_floor` (a step's matmuls alone, on both sides), :mod:`.compile_time`, :mod:`.loader_speed`, :mod:`.memory`,
:mod:`.report` (markdown and JSON), :mod:`.charts` (PNG bars) and :mod:`.suite` (runs them
in order).  Nothing here is imported by training code.
"""
