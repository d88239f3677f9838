"""Run an example script with module constants set: `python knobs.py MODULE.NAME=INT ... -- SCRIPT ARGS...`
(MODULE under dsv4c.kernels, e.g. batch_invariant.SERIAL_SPLIT_MIN_TILES=0). The kernels' host wrappers read
these at call time; the same tree otherwise."""
import importlib
import runpy
import sys
from pathlib import Path

sep = sys.argv.index("--")
for item in sys.argv[1:sep]:
    target, value = item.split("=")
    mod, name = target.rsplit(".", 1)
    module = importlib.import_module(f"dsv4c.kernels.{mod}")
    if not isinstance(getattr(module, name), int):
        raise SystemExit(f"knobs.py: {target} is not an int constant")
    setattr(module, name, int(value))
sys.argv = sys.argv[sep + 1:]
sys.path.insert(0, str(Path(sys.argv[0]).resolve().parent))
runpy.run_path(sys.argv[0], run_name="__main__")
