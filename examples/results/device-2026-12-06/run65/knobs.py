"""run52/knobs.py with target fields too: `python knobs.py SETTING=INT ... -- SCRIPT ARGS...`. A setting
`target.FIELD` sets that field of the h100 and h200 targets (e.g. target.swiglu_in_gemv=1, cast to the field's
type); the others (`MODULE.NAME`, an int constant of dsv4c.kernels.MODULE) and the script go to run52/knobs.py."""
import dataclasses
import runpy
import sys
from pathlib import Path

from dsv4c import targets

sep = sys.argv.index("--")
rest = []
for item in sys.argv[1:sep]:
    key, value = item.split("=")
    if not key.startswith("target."):
        rest.append(item)
        continue
    name = key.split(".", 1)[1]
    for t in ("h100", "h200"):
        cur = getattr(targets.TARGETS[t], name)
        targets.TARGETS[t] = dataclasses.replace(targets.TARGETS[t], **{name: type(cur)(int(value))})
base = Path(__file__).resolve().parents[1] / "run52" / "knobs.py"
sys.argv = [str(base), *rest, *sys.argv[sep:]]
runpy.run_path(str(base), run_name="__main__")
