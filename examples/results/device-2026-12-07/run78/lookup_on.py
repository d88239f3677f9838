"""Run an example script with the hash layers' table lookup inside the router's launch
(`fuse_router.HASH_LOOKUP = True`: `route_hashed_ids`) instead of the ATen gather before `route_hashed` (the
default): `python lookup_on.py SCRIPT ARGS...`. The same tree otherwise."""
import runpy
import sys
from pathlib import Path

from dsv4c.passes import fuse_router

fuse_router.HASH_LOOKUP = True
sys.argv = sys.argv[1:]
sys.path.insert(0, str(Path(sys.argv[0]).resolve().parent))
runpy.run_path(sys.argv[0], run_name="__main__")
