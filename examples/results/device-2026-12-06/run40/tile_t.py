"""Run an example script with the deterministic decode tile's token rows set: `python tile_t.py T SCRIPT ARGS...`
(T = 16, as committed, or 32 / 64). A decode-kind graph's batch-invariant linears then put T token rows on the
MMA's columns: each weight tile is read once per T tokens. Any fixed T keeps a row's bits independent of the
batch (the tile does not depend on M); the bits differ between T's."""
import runpy
import sys

import dsv4c.kernels.batch_invariant as BI

BI.DECODE_BLOCK_T = int(sys.argv[1])
sys.argv = sys.argv[2:]
sys.path.insert(0, str(__import__("pathlib").Path(sys.argv[0]).resolve().parent))
runpy.run_path(sys.argv[0], run_name="__main__")
