"""Run an example script with fuse_hc's head fusion on or off: `python head_switch.py on|off SCRIPT ARGS...`.
"off" makes `_head_ok` refuse every site, so the collapse before the LM head stays the ~12 ATen ops it was
before this session's `dsv4c::hc_head`; the mHC sites are fused as always. Same tree, same process setup."""
import runpy
import sys

import dsv4c.passes.fuse_hc as F

if sys.argv[1] == "off":
    F._head_ok = lambda site, n: False
elif sys.argv[1] != "on":
    raise SystemExit("head_switch.py on|off SCRIPT ARGS...")
sys.argv = sys.argv[2:]
sys.path.insert(0, str(__import__("pathlib").Path(sys.argv[0]).resolve().parent))
runpy.run_path(sys.argv[0], run_name="__main__")
