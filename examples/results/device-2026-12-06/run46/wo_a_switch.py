"""Run an example script with quantize_dense's FP8 rewrite of V4's grouped wo_a on or off:
`python wo_a_switch.py on|off SCRIPT ARGS...`. "off" makes `_grouped_site` match nothing, so wo_a stays on the
bf16 `grouped_linear` as before this change while every other FP8 dense linear is rewritten as usual: an A/B
of the change alone, same tree."""
import runpy
import sys

import dsv4c.passes.quantize_dense as QD

if sys.argv[1] == "off":
    QD._grouped_site = lambda n: None
elif sys.argv[1] != "on":
    raise SystemExit("wo_a_switch.py on|off SCRIPT ARGS...")
sys.argv = sys.argv[2:]
sys.path.insert(0, str(__import__("pathlib").Path(sys.argv[0]).resolve().parent))
runpy.run_path(sys.argv[0], run_name="__main__")
