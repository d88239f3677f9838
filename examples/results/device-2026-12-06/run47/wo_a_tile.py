"""Run an example script with `fp8_grouped_linear`'s token tile at 16 rows (the op's, measured) or 64 above 16
rows: `python wo_a_tile.py 16|64 SCRIPT ARGS...`. The op calls the module's `fp8_grouped_linear` at run time,
so wrapping it changes every call the script's graphs make; the same tree otherwise."""
import runpy
import sys

import dsv4c.kernels.grouped_linear as GL

if sys.argv[1] == "64":
    _kernel = GL.fp8_grouped_linear
    GL.fp8_grouped_linear = lambda x, w_q, w_s, dtype: _kernel(
        x, w_q, w_s, dtype, block_m=16 if x.shape[0] * x.shape[1] <= 16 else 64)
elif sys.argv[1] != "16":
    raise SystemExit("wo_a_tile.py 16|64 SCRIPT ARGS...")
sys.argv = sys.argv[2:]
sys.path.insert(0, str(__import__("pathlib").Path(sys.argv[0]).resolve().parent))
runpy.run_path(sys.argv[0], run_name="__main__")
