"""examples/compare_passes.py --quick on the CPU: the ladder is complete, its numbers are sane, plots exist."""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RUNGS = ["eager", "fusion", "piecewise", "full", "fp8", "fp4", "mtp1", "mtp2", "mtp3"]


@pytest.fixture(scope="module")
def ladder(tmp_path_factory):
    sys.path.insert(0, str(ROOT / "examples"))
    import compare_passes

    out = tmp_path_factory.mktemp("ladder")
    res = compare_passes.main(["--quick", "--device", "cpu", "--out-dir", str(out)])
    return res, out


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def test_every_rung_has_a_row_measured_or_with_a_reason(ladder):
    res, out = ladder
    rows = {r["rung"]: r for r in res["ladder"]["rows"]}
    assert list(rows) == RUNGS
    for key in ("eager", "fusion", "piecewise", "full"):  # these need nothing but the tree as it is
        assert rows[key]["available"], rows[key]
    for r in rows.values():
        if not r["available"]:
            assert r["reason"].startswith(("not available: ", "skipped in --quick")) and len(r["reason"]) > 25
    md = (out / "results.md").read_text()
    for r in rows.values():  # the table names every rung, and every reason
        assert r["label"] in md
        if not r["available"]:
            assert r["reason"] in md
    assert json.loads((out / "results.json").read_text())["ladder"]["rows"][0]["rung"] == "eager"


def test_fusion_is_numerically_the_eager_model_and_numbers_are_finite(ladder):
    res, _ = ladder
    rows = {r["rung"]: r for r in res["ladder"]["rows"]}
    assert rows["fusion"]["snr_db"] > 60, rows["fusion"]  # fp32: the fused GEMMs are the same products
    assert abs(rows["fusion"]["loss"] - rows["eager"]["loss"]) < 1e-3
    # eager prefill + decode on the windows equals the training path's held-out loss (the test's figure)
    assert abs(rows["eager"]["loss"] - rows["eager"]["evaluate_loss"]) < 1e-3
    assert rows["eager"]["ppl"] < 200  # trained model; a random one is near 4096
    for r in rows.values():
        if not r["available"]:
            continue
        if r.get("mtp"):
            acc = r["acceptance"]
            assert all(a is None or 0 <= a <= 1 for a in acc["alpha"]), acc
            assert all(x["greedy_equal_k0"] for x in r["speed"] if "greedy_equal_k0" in x)  # MTP is exact
        else:
            assert _finite(r["loss"]) and _finite(r["ppl"])
            assert r["snr_db"] == math.inf or r["snr_db"] > 10, r  # an accuracy collapse is a bug
        for sp in r["speed"]:
            for k in ("prefill_tokens_per_s", "decode_tokens_per_s", "decode_ms_per_step", "prefill_ms"):
                assert _finite(sp[k]) and sp[k] > 0, (r["rung"], sp)
        assert _finite(r["load_s"])
        if r["rung"] != "eager":
            assert _finite(r["compile_s"]) and r["compile_s"] > 0
            assert r["artifact_bytes"] > 1e6
        assert r["memory"].get("rss_bytes", 0) > 0


def test_plots_exist(ladder):
    res, out = ladder
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert res["plots"] == [] and "matplotlib" in res["plots_skipped"]
        return
    for name in ("throughput.png", "speed_vs_accuracy.png"):
        p = out / name
        assert p.is_file() and p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 5000
