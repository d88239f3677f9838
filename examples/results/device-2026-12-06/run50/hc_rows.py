"""Run an example script with the deterministic hc_pre's row launch at R token rows per program (1: the
kernel before `HC_DET_ROWS`, 4: `4f9c240`'s value; reverted after run50,
so this runs on that tree only): `python hc_rows.py 1|4 SCRIPT ARGS...`.
`dsv4c::hc_pre_rows` reads the module's HC_DET_ROWS at call time; the same tree otherwise."""
import runpy
import sys

import dsv4c.kernels.mhc as mhc

if sys.argv[1] not in ("1", "4"):
    raise SystemExit("hc_rows.py 1|4 SCRIPT ARGS...")
mhc.HC_DET_ROWS = int(sys.argv[1])
sys.argv = sys.argv[2:]
sys.path.insert(0, str(__import__("pathlib").Path(sys.argv[0]).resolve().parent))
runpy.run_path(sys.argv[0], run_name="__main__")
