"""Run an example script with the FP8 block experts' decode GEMV set: `python gemv.py MAX_ASSIGN early|late --
SCRIPT ARGS...`: moe_grouped.FP8_GEMV_MAX_ASSIGN (0: the tile) and Fp8GemvMoeConfig.early_weights (whether the
first K step's weights are requested before the PDL wait). The same tree otherwise."""
import functools
import runpy
import sys
from pathlib import Path

from dsv4c.kernels import moe_grouped as mg

sep = sys.argv.index("--")
max_assign, when = int(sys.argv[1]), sys.argv[2]
if when not in ("early", "late"):
    raise SystemExit(f"gemv.py: early or late, got {when!r}")
mg.FP8_GEMV_MAX_ASSIGN = max_assign
mg.Fp8GemvMoeConfig = functools.partial(mg.Fp8GemvMoeConfig, early_weights=when == "early")
sys.argv = sys.argv[sep + 1:]
sys.path.insert(0, str(Path(sys.argv[0]).resolve().parent))
runpy.run_path(sys.argv[0], run_name="__main__")
