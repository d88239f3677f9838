"""examples/bench_artifact.py (issue 4's benchmark) end to end on the tiny model and the cpu target:
release checkpoint, eager peer, `dsv4c compile`, `dsv4c bench`, summary. No torch.compile (minutes on
a CPU); the H200 run in BENCHMARKS.md uses it."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


@pytest.mark.slow
def test_bench_artifact_quick_run(tmp_path):
    out = tmp_path / "res.json"
    r = subprocess.run([sys.executable, str(EXAMPLES / "bench_artifact.py"), "--quick", "--device", "cpu",
                        "--no-torch-compile", "--work", str(tmp_path / "w"), "--out", str(out)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    res = json.loads(out.read_text())
    assert res["rounded"]["fp4"] > 0 and res["rounded"]["fp8"] > 0  # the release formats were applied
    assert res["artifact"]["expert_format"] == "reference" and res["artifact"]["bytes"] > 0
    assert [r["batch"] for r in res["summary"]] == [1, 3]
    for row in res["summary"]:
        assert row["artifact_step_ms"] > 0 and row["eager_step_ms"] > 0
        assert row["speedup_vs_eager"] == row["eager_step_ms"] / row["artifact_step_ms"]
        # fp32 cpu artifact, reference experts: pinned routing leaves only op-order rounding
        assert row["pinned_snr_db"] > 60 and row["pinned_snr_db"] == res["accuracy"]["pinned_snr_db"]
    eager = {p["batch"]: p for p in res["peers"]["eager"]}
    assert all(len(eager[b]["tokens"]) == b and eager[b]["unique_experts"] for b in (1, 3))
    assert "| batch | artifact ms/step |" in r.stdout


def test_routing_flips_quick_run(tmp_path):
    """examples/routing_flips.py on v4-tiny-b: the W8A8 activation quantisation moves the logits, and the
    hash layers (routed by token id) never change their experts."""
    out = tmp_path / "flips.json"
    r = subprocess.run([sys.executable, str(EXAMPLES / "routing_flips.py"), "--quick", "--out", str(out)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads(out.read_text())
    flips = res["expert_set_changed_per_layer"]
    assert len(flips) == 5 and flips[:3] == [0.0, 0.0, 0.0]  # v4-tiny-b: 5 MoE layers, 3 hash layers
    assert all(0.0 <= f <= 1.0 for f in flips) and 0 < res["logits_rel_err"] < 10
