"""Run an example script with passes/overlap_early_ops.py left out of the load-time stream passes (its
MIN_BETWEEN set past any graph's kernel count), the shared experts still on the side stream:
`python early_off.py SCRIPT ARGS...`. The same tree otherwise."""
import runpy
import sys
from pathlib import Path

from dsv4c.passes import overlap_early_ops

overlap_early_ops.MIN_BETWEEN = 10**9
sys.argv = sys.argv[1:]
sys.path.insert(0, str(Path(sys.argv[0]).resolve().parent))
runpy.run_path(sys.argv[0], run_name="__main__")
