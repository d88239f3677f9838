"""Run an example script with the fused attention's combine head block set: `python attn.py PROGRAMS -- SCRIPT
ARGS...`: V4AttnConfig.combine_programs for every default-mode call (0: the split kernel's 16 heads per combine
program). The same tree otherwise; deterministic graphs (BATCH_INVARIANT) keep 16 either way."""
import functools
import runpy
import sys
from pathlib import Path

from dsv4c.kernels import v4_attention as va

sep = sys.argv.index("--")
va.V4AttnConfig = functools.partial(va.V4AttnConfig, combine_programs=int(sys.argv[1]))
sys.argv = sys.argv[sep + 1:]
sys.path.insert(0, str(Path(sys.argv[0]).resolve().parent))
runpy.run_path(sys.argv[0], run_name="__main__")
