"""Run an example script with the deterministic attention's fixed split at S programs per (token, head block)
(`V4AttnConfig.invariant_split`; 8 in the tree): `python det_split.py 4|8 SCRIPT ARGS...`. The op reads the
module's BATCH_INVARIANT at call time; the same tree otherwise (a row's bits change with S, at every M alike)."""
import dataclasses
import runpy
import sys

import dsv4c.kernels.v4_attention as A

if sys.argv[1] not in ("2", "4", "8"):
    raise SystemExit("det_split.py 2|4|8 SCRIPT ARGS...")
A.BATCH_INVARIANT = dataclasses.replace(A.BATCH_INVARIANT, invariant_split=int(sys.argv[1]))
sys.argv = sys.argv[2:]
sys.path.insert(0, str(__import__("pathlib").Path(sys.argv[0]).resolve().parent))
runpy.run_path(sys.argv[0], run_name="__main__")
