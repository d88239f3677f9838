"""Run an example script with each shared expert forked onto the side stream after its layer's router, right
before the routed experts' op (`overlap_shared_experts.FORK_BEFORE_ROUTER = 0`), instead of before the router:
`python fork_after_router.py SCRIPT ARGS...`. The same tree otherwise."""
import runpy
import sys
from pathlib import Path

from dsv4c.passes import overlap_shared_experts

overlap_shared_experts.FORK_BEFORE_ROUTER = 0
sys.argv = sys.argv[1:]
sys.path.insert(0, str(Path(sys.argv[0]).resolve().parent))
runpy.run_path(sys.argv[0], run_name="__main__")
