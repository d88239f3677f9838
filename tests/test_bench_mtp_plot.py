"""examples/bench_mtp.py's grid plot, from a synthetic result (no model runs)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def _res() -> dict:
    rows = []
    for T in (0.0, 0.7):
        for B in (1, 8):
            for k in (0, 1, 2):
                rows.append({"batch": B, "temperature": T, "k": k, "speedup": 1.0 + 0.2 * k / B})
            rows.append({"batch": B, "temperature": T, "k": "auto", "auto_k": 2 if B == 1 else 0})
    return {"device": "cpu", "gpu": None, "artifact": "art", "rows": rows}


def test_plot_from_a_saved_grid(tmp_path):
    src, png = tmp_path / "mtp.json", tmp_path / "mtp.png"
    src.write_text(json.dumps(_res()))
    subprocess.run([sys.executable, str(EXAMPLES / "bench_mtp.py"), "--plot-from", str(src), "--plot", str(png)],
                   check=True, capture_output=True)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000


def test_plot_from_needs_an_output(tmp_path):
    src = tmp_path / "mtp.json"
    src.write_text(json.dumps(_res()))
    r = subprocess.run([sys.executable, str(EXAMPLES / "bench_mtp.py"), "--plot-from", str(src)],
                       capture_output=True, text=True)
    assert r.returncode == 2 and "--plot-from needs --plot" in r.stderr
