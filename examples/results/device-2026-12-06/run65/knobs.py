"""Run an example script with settings changed: `python knobs.py SETTING=INT ... -- SCRIPT ARGS...`. A setting
is `MODULE.NAME` (an int constant of dsv4c.kernels.MODULE, e.g. moe_grouped.FP8_GEMV_STAGES=3; the host wrappers
read these at call time) or `target.FIELD` (that field of the h100 and h200 targets, e.g.
target.swiglu_in_gemv=1, cast to the field's type). The same tree otherwise."""
import dataclasses
import importlib
import runpy
import sys
from pathlib import Path

from dsv4c import targets

sep = sys.argv.index("--")
for item in sys.argv[1:sep]:
    key, value = item.split("=")
    mod, name = key.rsplit(".", 1)
    if mod == "target":
        for t in ("h100", "h200"):
            cur = getattr(targets.TARGETS[t], name)
            targets.TARGETS[t] = dataclasses.replace(targets.TARGETS[t], **{name: type(cur)(int(value))})
        continue
    module = importlib.import_module(f"dsv4c.kernels.{mod}")
    if not isinstance(getattr(module, name), int):
        raise SystemExit(f"knobs.py: {key} is not an int constant")
    setattr(module, name, int(value))
sys.argv = sys.argv[sep + 1:]
sys.path.insert(0, str(Path(sys.argv[0]).resolve().parent))
runpy.run_path(sys.argv[0], run_name="__main__")
