"""run86: where a Session decode step's time goes outside its CUDA graph (bench_artifact.step_breakdown: the
interval between consecutive steps' ends against the graph's own span) on an artifact already built, with the
runtime as the tree has it. run.sh runs this with the staged decode inputs reversed and as committed.

    python ab.py ART LABEL OUT.json
"""
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # examples/
from bench_artifact import step_breakdown  # noqa: E402

art, label, out = Path(sys.argv[1]), sys.argv[2], Path(sys.argv[3])
rows = step_breakdown(art, [1, 8, 64], 1024, 27, torch.device("cuda"), None)[0]
for r in rows:
    print(f"{label}: batch {r['batch']}: step {r['step_ms']:.3f} ms, replay {r['replay_ms']:.3f} ms, "
          f"outside the graph {1e3 * r['host_wait_ms']:.1f} us", flush=True)
prev = json.loads(out.read_text()) if out.exists() else []
out.write_text(json.dumps(prev + [{"label": label, "rows": rows}], indent=1))
