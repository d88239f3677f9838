"""examples/bench_moe_kernels.py's sweep plot, from a synthetic sweep result (no kernel runs)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def _res() -> dict:
    rows = []
    for fmt in ("fp8_block", "mxfp4"):
        for t in (1, 8):
            rows.append({"format": fmt, "tokens": t, "candidate": "default", "graph_us": 100.0 * t, "status": "ok"})
            rows.append({"format": fmt, "tokens": t, "candidate": "direct", "graph_us": 60.0 * t, "bw_ratio": 0.6,
                         "status": "ok"})
            rows.append({"format": fmt, "tokens": t, "candidate": "broken", "graph_us": 1.0, "status": "WRONG"})
    return {"device": "test", "copy_bw_Bps": 4e12, "rows": rows}


def test_plot_from_a_saved_sweep(tmp_path):
    src, png = tmp_path / "sweep.json", tmp_path / "sweep.png"
    src.write_text(json.dumps(_res()))
    subprocess.run([sys.executable, str(EXAMPLES / "bench_moe_kernels.py"), "--plot-from", str(src), "--plot", str(png)],
                   check=True, capture_output=True)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000


def test_plot_from_needs_an_output(tmp_path):
    src = tmp_path / "sweep.json"
    src.write_text(json.dumps(_res()))
    r = subprocess.run([sys.executable, str(EXAMPLES / "bench_moe_kernels.py"), "--plot-from", str(src)],
                       capture_output=True, text=True)
    assert r.returncode == 2 and "--plot-from needs --plot" in r.stderr
