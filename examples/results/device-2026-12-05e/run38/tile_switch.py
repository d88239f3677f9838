"""Run an example script with the deterministic decode tile on or off: `python tile_switch.py on|off SCRIPT
ARGS...`. "off" makes `bi_matmul` ignore `decode=True`, so the decode graphs' batch-invariant linears run the
64 x 64 tile with their K split, as run37's `split on` rows (before c1fa12a). Same tree, same process setup."""
import runpy
import sys

import dsv4c.kernels.batch_invariant as BI

if sys.argv[1] == "off":
    _orig = BI.bi_matmul
    BI.bi_matmul = lambda x, w, bias=None, out_dtype=None, split=1, decode=False: _orig(x, w, bias, out_dtype, split)
elif sys.argv[1] != "on":
    raise SystemExit("tile_switch.py on|off SCRIPT ARGS...")
sys.argv = sys.argv[2:]
sys.path.insert(0, str(__import__("pathlib").Path(sys.argv[0]).resolve().parent))
runpy.run_path(sys.argv[0], run_name="__main__")
