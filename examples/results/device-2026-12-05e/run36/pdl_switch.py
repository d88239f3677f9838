"""Run an example script with dsv4c's step-wide PDL on or off: `python pdl_switch.py on|off SCRIPT ARGS...`.
"off" makes `_tl.pdl_launch` return PDL=False before any kernel module binds it, so every kernel but the
FP4 GEMV chain and its combine (PDL-chained before this change, untouched by it) launches as before
`e17debf`. Same tree, same process setup: an A/B of the change alone."""
import runpy
import sys

import dsv4c.kernels._tl as U

assert not [m for m in sys.modules if m.startswith("dsv4c.kernels.") and m != "dsv4c.kernels._tl"]
if sys.argv[1] == "off":
    U.pdl_launch = lambda t: U._PDL_OFF
elif sys.argv[1] != "on":
    raise SystemExit("pdl_switch.py on|off SCRIPT ARGS...")
sys.argv = sys.argv[2:]
sys.path.insert(0, str(__import__("pathlib").Path(sys.argv[0]).resolve().parent))
runpy.run_path(sys.argv[0], run_name="__main__")
