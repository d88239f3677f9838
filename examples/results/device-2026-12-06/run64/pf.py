"""Run an example script with the L2 prefetch's settings changed: `python pf.py BYTES MODE EVICT -- SCRIPT ARGS...`:
the h100 / h200 targets' `l2_prefetch_bytes` = BYTES (passes/prefetch_weights.py), kernels/l2_prefetch.MODE = MODE
(0: bulk prefetch, 1: per line) and kernels/fp8_gemv.W_EVICT_FIRST = EVICT (a knob of the tree that ran, `b4887d9`;
removed after run64: evict_first did no better; MODE too, after run64: only call A ran MODE 1, piecewise). The same
tree otherwise."""
import dataclasses
import runpy
import sys
from pathlib import Path

from dsv4c import targets
from dsv4c.kernels import fp8_gemv, l2_prefetch

sep = sys.argv.index("--")
nbytes, mode, evict = (int(v) for v in sys.argv[1:sep])
for name in ("h100", "h200"):
    targets.TARGETS[name] = dataclasses.replace(targets.TARGETS[name], l2_prefetch_bytes=nbytes)
l2_prefetch.MODE = mode
fp8_gemv.W_EVICT_FIRST = evict
sys.argv = sys.argv[sep + 1:]
sys.path.insert(0, str(Path(sys.argv[0]).resolve().parent))
runpy.run_path(sys.argv[0], run_name="__main__")
