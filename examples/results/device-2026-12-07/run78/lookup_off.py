"""Run an example script with the hash layers' table lookup left as the ATen gather before `route_hashed`
(fuse_router refuses every `route_hashed_ids` site), as before the thirty-ninth session:
`python lookup_off.py SCRIPT ARGS...`. The same tree otherwise."""
import runpy
import sys
from pathlib import Path

from dsv4c.passes import fuse_router

fuse_router._hashed_ids_ok = lambda site, k: False
sys.argv = sys.argv[1:]
sys.path.insert(0, str(Path(sys.argv[0]).resolve().parent))
runpy.run_path(sys.argv[0], run_name="__main__")
