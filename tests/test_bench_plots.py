"""The benchmark scripts' plots (`--plot-from` a saved JSON), from synthetic results: no kernel or
model runs."""
from __future__ import annotations

import json
import runpy
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def _moe_sweep() -> dict:
    rows = []
    for fmt in ("fp8_block", "mxfp4"):
        for t in (1, 8):
            rows.append({"format": fmt, "tokens": t, "candidate": "default", "graph_us": 100.0 * t, "status": "ok"})
            rows.append({"format": fmt, "tokens": t, "candidate": "direct", "graph_us": 60.0 * t, "bw_ratio": 0.6,
                         "status": "ok"})
            rows.append({"format": fmt, "tokens": t, "candidate": "broken", "graph_us": 1.0, "status": "WRONG"})
    return {"device": "test", "copy_bw_Bps": 4e12, "rows": rows}


def _mtp_grid() -> dict:
    rows = []
    for T in (0.0, 0.7):
        for B in (1, 8):
            for k in (0, 1, 2):
                rows.append({"batch": B, "temperature": T, "k": k, "speedup": 1.0 + 0.2 * k / B})
            rows.append({"batch": B, "temperature": T, "k": "auto", "auto_k": 2 if B == 1 else 0})
    return {"device": "cpu", "gpu": None, "artifact": "art", "rows": rows}


SCRIPTS = [("bench_moe_kernels.py", _moe_sweep), ("bench_mtp.py", _mtp_grid)]


def _plot(script: str, *args: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(EXAMPLES / script), *args], capture_output=True, text=True, **kw)


@pytest.mark.parametrize("script, result", SCRIPTS, ids=[s for s, _ in SCRIPTS])
def test_plot_from_a_saved_result(tmp_path, script, result):
    src, png = tmp_path / "res.json", tmp_path / "res.png"
    src.write_text(json.dumps(result()))
    _plot(script, "--plot-from", str(src), "--plot", str(png), check=True)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000


@pytest.mark.parametrize("script, result", SCRIPTS, ids=[s for s, _ in SCRIPTS])
def test_plot_from_needs_an_output(tmp_path, script, result, monkeypatch, capsys):
    """In process (the script run as __main__, argparse's exit caught): the subprocess runs above already
    cover the scripts as commands, and each subprocess pays torch's import."""
    src = tmp_path / "res.json"
    src.write_text(json.dumps(result()))
    monkeypatch.setattr(sys, "argv", [str(EXAMPLES / script), "--plot-from", str(src)])
    monkeypatch.setattr(sys, "path", list(sys.path))  # whatever the script adds to it is undone
    with pytest.raises(SystemExit) as e:
        runpy.run_path(str(EXAMPLES / script), run_name="__main__")
    assert e.value.code == 2 and "--plot-from needs --plot" in capsys.readouterr().err
