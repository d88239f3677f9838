"""Run an example script with the deferred mHC Sinkhorn on or off: `python defer.py 0|1 [MODULE.NAME=INT ...] --
SCRIPT ARGS...`: the h100 / h200 targets' `defer_sinkhorn` (passes/defer_sinkhorn.py; off on every target in the
tree) and, as run52/knobs.py, int constants of dsv4c.kernels modules. The same tree otherwise."""
import dataclasses
import importlib
import runpy
import sys
from pathlib import Path

from dsv4c import targets

sep = sys.argv.index("--")
on = bool(int(sys.argv[1]))
for name in ("h100", "h200"):
    targets.TARGETS[name] = dataclasses.replace(targets.TARGETS[name], defer_sinkhorn=on)
for item in sys.argv[2:sep]:
    target, value = item.split("=")
    mod, const = target.rsplit(".", 1)
    module = importlib.import_module(f"dsv4c.kernels.{mod}")
    if not isinstance(getattr(module, const), int):
        raise SystemExit(f"defer.py: {target} is not an int constant")
    setattr(module, const, int(value))
sys.argv = sys.argv[sep + 1:]
sys.path.insert(0, str(Path(sys.argv[0]).resolve().parent))
runpy.run_path(sys.argv[0], run_name="__main__")
