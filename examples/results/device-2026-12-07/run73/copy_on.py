"""Run an example script with the norm and RoPE kernels copying column-sliced inputs first (the tree before
they read rows through their strides): `python copy_on.py SCRIPT ARGS...`. The same tree otherwise."""
import runpy
import sys
from pathlib import Path

from dsv4c.kernels import norm, rope

norm.rows_view = lambda x: x.contiguous().view(-1, x.shape[-1])
rope._unit_inner = lambda x: x.contiguous()
sys.argv = sys.argv[1:]
sys.path.insert(0, str(Path(sys.argv[0]).resolve().parent))
runpy.run_path(sys.argv[0], run_name="__main__")
