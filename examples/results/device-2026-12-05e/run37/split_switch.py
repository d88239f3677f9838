"""Run an example script with the deterministic mode's K split on or off: `python split_switch.py on|off
SCRIPT ARGS...`. "off" makes `kernels.batch_invariant.bi_split` return 1 (make_batch_invariant reads it
when it lowers a graph), so the decode graphs' linears walk all of K in one program per tile, as before
`1b1480d`. Same tree, same process setup: an A/B of the change alone."""
import runpy
import sys

import dsv4c.kernels.batch_invariant as BI

if sys.argv[1] == "off":
    BI.bi_split = lambda n, k: 1
elif sys.argv[1] != "on":
    raise SystemExit("split_switch.py on|off SCRIPT ARGS...")
sys.argv = sys.argv[2:]
sys.path.insert(0, str(__import__("pathlib").Path(sys.argv[0]).resolve().parent))
runpy.run_path(sys.argv[0], run_name="__main__")
