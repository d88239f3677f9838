"""examples/compare_passes.py --quick on the CPU: the ladder is complete, its numbers are sane, plots exist;
the HF transformers peer row agrees with the eager model; --budget-s bounds the run."""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
RUNGS = ["eager", "hf", "fusion", "piecewise", "full", "fp8", "fp4", "mtp1", "mtp2", "mtp3"]
REASONS = ("not available: ", "skipped in --quick", "skipped: time budget")


def _examples():
    if str(ROOT / "examples") not in sys.path:
        sys.path.insert(0, str(ROOT / "examples"))


@pytest.fixture(scope="module")
def ladder(tmp_path_factory):
    _examples()
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
    # these need nothing but the tree as it is (the MTP rungs were silently "not available" for days: an import
    # of a helper another example had dropped)
    for key in ("eager", "fusion", "piecewise", "full", "mtp1", "mtp2", "mtp3"):
        assert rows[key]["available"], rows[key]
    for r in rows.values():
        if not r["available"]:
            assert r["reason"].startswith(REASONS) and len(r["reason"]) > 25
    md = (out / "results.md").read_text()
    for r in rows.values():  # the table names every rung, and every reason
        assert r["label"] in md
        if not r["available"]:
            assert r["reason"] in md
    saved = json.loads((out / "results.json").read_text())
    assert saved["ladder"]["rows"][0]["rung"] == "eager" and saved["status"] == "complete"


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
            assert len(acc["alpha"]) == r["mtp"] and acc["mean_accepted_length"] >= 1, acc
            assert all(x["greedy_equal_k0"] for x in r["speed"] if "greedy_equal_k0" in x)  # MTP is exact
        else:
            assert _finite(r["loss"]) and _finite(r["ppl"])
            assert r["snr_db"] == math.inf or r["snr_db"] > 10, r  # an accuracy collapse is a bug
        for sp in r["speed"]:
            for k in ("prefill_tokens_per_s", "decode_tokens_per_s", "decode_ms_per_step", "prefill_ms"):
                assert _finite(sp[k]) and sp[k] > 0, (r["rung"], sp)
        assert _finite(r["load_s"])
        if r["rung"] not in ("eager", "hf"):
            assert _finite(r["compile_s"]) and r["compile_s"] > 0
            assert r["artifact_bytes"] > 1e6
        assert r["memory"].get("rss_bytes", 0) > 0


def test_hf_peer_row_agrees_with_the_eager_model(ladder):
    """fp32 on the CPU: HF's DeepseekV4 with the bundled weights is the oracle of the parity tests, so its
    held-out loss, logits and greedy tokens must match our eager model's on the same windows/prompts."""
    import hf_peer

    res, out = ladder
    rows = {r["rung"]: r for r in res["ladder"]["rows"]}
    hf = rows["hf"]
    if hf_peer.unavailable_reason() is not None:  # a transformers without DeepseekV4: the row says so
        assert not hf["available"] and hf["reason"].startswith("not available: ")
        return
    assert hf["available"], hf
    assert abs(hf["loss"] - rows["eager"]["loss"]) < 1e-4, (hf["loss"], rows["eager"]["loss"])
    assert hf["snr_db"] > 80, hf["snr_db"]  # fp32 rounding only
    assert hf["hf"]["dtype"] == "float32" and hf["hf"]["dropped"] > 0  # the bundle's MTP block has no HF home
    assert [x["batch"] for x in hf["speed"]] == [x["batch"] for x in rows["eager"]["speed"]]
    assert all(x["greedy_equal_eager"] for x in hf["speed"]), hf["speed"]
    md = (out / "results.md").read_text()
    assert "against HF transformers" in md and hf["transformers"] in md


def test_hf_mapping_fails_loudly_on_a_missing_or_unknown_tensor():
    _examples()
    import hf_peer

    assert hf_peer.unavailable_reason() is None  # transformers is in the test extra: a missing peer fails
    from dsv4c import load_model

    model = load_model(ROOT / "examples" / "models" / "v4-tiny-pystdlib", dtype=torch.float32)
    sd = model.state_dict()
    mapped, dropped = hf_peer.hf_state_dict(sd)
    assert dropped and all(n.startswith("mtp.") for n in dropped)
    g = mapped["model.layers.0.mlp.experts.gate_up_proj"]
    w1, w3 = sd["layers.0.ffn.experts.w1"], sd["layers.0.ffn.experts.w3"]
    assert torch.equal(g[:, : w1.shape[1]], w1) and torch.equal(g[:, w1.shape[1]:], w3)

    class Missing:
        config = model.config

        @staticmethod
        def state_dict():
            return {k: v for k, v in sd.items() if k != "layers.1.attn.attn_sink"}

    with pytest.raises(hf_peer.PeerError, match="without a checkpoint value"):
        hf_peer.build(Missing(), "cpu", torch.float32)
    with pytest.raises((hf_peer.PeerError, KeyError)):
        hf_peer.hf_state_dict({**sd, "layers.0.attn.bogus.weight": torch.zeros(1)})


def test_budget_skips_with_reasons_and_still_writes_the_table(tmp_path):
    """--budget-s 1: no compile starts, the eager reference still runs, every other row says why not."""
    _examples()
    import compare_passes

    res = compare_passes.main(["--quick", "--device", "cpu", "--budget-s", "1", "--mtp-max", "1",
                               "--out-dir", str(tmp_path)])
    rows = res["ladder"]["rows"]
    assert rows[0]["rung"] == "eager" and rows[0]["available"]
    assert [r["rung"] for r in rows[1:]] == ["hf", "fusion", "piecewise", "full", "fp8", "fp4", "mtp1"]
    for r in rows[1:]:
        assert not r["available"] and r["reason"].startswith(REASONS), r
    assert rows[1]["reason"].startswith("skipped: time budget")
    assert rows[2]["reason"].startswith("skipped: time budget")
    md = (tmp_path / "results.md").read_text()
    assert "skipped: time budget" in md and json.loads((tmp_path / "results.json").read_text())["budget_s"] == 1


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


def test_slice_part_is_stopped_by_the_budget(tmp_path, monkeypatch):
    """The slice runs in this process; a part that overruns --budget-s is stopped and torch.compile skipped
    (a stand-in for bench_segments that would run for a minute)."""
    _examples()
    import time

    import bench_segments
    import compare_passes

    def forever(argv):
        while True:  # `except Exception` inside the timed code must not swallow the stop
            try:
                time.sleep(0.05)
            except Exception:  # noqa: BLE001, S110 - the point: such handlers are in the timed code
                pass

    monkeypatch.setattr(bench_segments, "main", forever)
    a = compare_passes.parse(["--device", "cpu"])
    t0 = time.perf_counter()
    res = compare_passes.run_slice(a, tmp_path, compare_passes.Budget(compare_passes.TAIL_S + 2))
    assert time.perf_counter() - t0 < 10
    assert res["segments_error"].startswith("stopped by --budget-s")
    assert res["torch_compile"]["skipped"].startswith("time budget")
