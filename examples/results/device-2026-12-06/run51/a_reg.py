"""Run an example script with the deterministic decode tile's weights fed to the MMAs from registers from G
token groups (`DECODE_A_REG_MIN_GROUPS`; 0: never, the committed default): `python a_reg.py 0|4 SCRIPT ARGS...`.
`_launch_bi` reads the module's value at call time; the same tree otherwise."""
import runpy
import sys

import dsv4c.kernels.batch_invariant as bi

if sys.argv[1] not in ("0", "2", "4"):
    raise SystemExit("a_reg.py 0|2|4 SCRIPT ARGS...")
bi.DECODE_A_REG_MIN_GROUPS = int(sys.argv[1])
sys.argv = sys.argv[2:]
sys.path.insert(0, str(__import__("pathlib").Path(sys.argv[0]).resolve().parent))
runpy.run_path(sys.argv[0], run_name="__main__")
