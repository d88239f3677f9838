"""Run an example script with the deferred mHC Sinkhorn on or off: `python defer.py 0|1 [MODULE.NAME=INT ...] --
SCRIPT ARGS...`: the h100 / h200 targets' `defer_sinkhorn` (passes/defer_sinkhorn.py; off on every target in the
tree), then run52/knobs.py with the rest (int constants of dsv4c.kernels modules, then the script). The same tree
otherwise."""
import dataclasses
import runpy
import sys
from pathlib import Path

from dsv4c import targets

on = bool(int(sys.argv[1]))
for name in ("h100", "h200"):
    targets.TARGETS[name] = dataclasses.replace(targets.TARGETS[name], defer_sinkhorn=on)
knobs = Path(__file__).resolve().parents[2] / "device-2026-12-06" / "run52" / "knobs.py"
sys.argv = [str(knobs), *sys.argv[2:]]
runpy.run_path(str(knobs), run_name="__main__")
