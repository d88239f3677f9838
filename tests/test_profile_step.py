"""examples/profile_step.py's per-kernel-class table (issue 28): kernel names as an H200 decode step's
CUDA-graph replay recorded them (examples/results/h200-2026-11-30/profile_b1_524a919.json) fall into
their classes, and each class's bytes, GB/s and share of the copy bandwidth follow from its time."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
import profile_step as ps  # noqa: E402

RECORDED = ROOT / "examples" / "results" / "h200-2026-11-30" / "profile_b1_524a919.json"


def test_recorded_kernel_names_fall_into_their_classes():
    names = [r["name"] for r in json.loads(RECORDED.read_text())["full"]["kernels"]]
    by = {n: ps.kernel_class(n) for n in names}
    assert by["_moe_gemm_kernel"] == by["_act_fp8_kernel"] == "routed experts"
    assert by["_attn_split_kernel"] == by["_combine_kernel"] == by["_v4_compress_kernel"] == "attention and caches"
    gemms = [n for n in names if n.startswith("nvjet") or "splitKreduce" in n or "gemvx" in n]
    assert len(gemms) >= 8 and all(by[n] == "dense GEMMs and head" for n in gemms)
    assert by["_rms_norm_kernel"] == by["_hc_mix_rows_kernel"] == by["_rope_kernel"] == "other"
    assert ps.kernel_class("_gemv13_kernel") == ps.kernel_class("_moe_combine_kernel") == "routed experts"
    assert ps.kernel_class("_gemv_kernel") == "dense GEMMs and head"  # the FP8 dense GEMV, not the experts'
    assert ps.kernel_class("_fp8_grouped_kernel") == "dense GEMMs and head"  # V4's FP8 wo_a (was "other" to run57)


def test_every_dsv4c_kernel_has_a_class_on_purpose():
    """Each Triton kernel of kernels/ is named in exactly one of CLASS_EXACT's classes or CLASS_OTHER: a new kernel
    (or a renamed one) fails here instead of landing in "other" unnoticed, as V4's FP8 wo_a kernel did until run57."""
    import ast

    found = set()
    for path in sorted((ROOT / "kernels").glob("*.py")):
        for f in ast.parse(path.read_text()).body:
            if (isinstance(f, ast.FunctionDef) and f.name.endswith("_kernel")
                    and any(ast.unparse(d).startswith(("triton.jit", "jit")) for d in f.decorator_list)):
                found.add(f.name)
    assert len(found) >= 40 and {"_fp8_grouped_kernel", "_gemv13_kernel", "_hc_post_mix_kernel"} <= found
    named = [n for names in ps.CLASS_EXACT.values() for n in names] + list(ps.CLASS_OTHER)
    assert len(named) == len(set(named)), "a kernel named in two classes"
    assert found - set(named) == set(), f"kernels without a class: {sorted(found - set(named))}"
    assert set(named) - found == set(), f"classes name kernels that no longer exist: {sorted(set(named) - found)}"


def test_class_table_sets_each_class_time_beside_its_bytes():
    rows = [{"name": "_moe_gemm_kernel", "count": 6, "us": 300.0},
            {"name": "nvjet_sm90_x", "count": 9, "us": 150.0},
            {"name": "_attn_split_kernel", "count": 3, "us": 30.0},
            {"name": "_rms_norm_kernel", "count": 12, "us": 24.0}]
    sb = {"routed_experts": 400e6, "non_expert_weights": 180e6, "head": 20e6, "kv": 3e6}
    table = {r["class"]: r for r in ps.class_table(rows, 3, sb, 4e12)}
    ex = table["routed experts"]
    assert ex["kernels"] == 2 and ex["us"] == 100 and ex["gb_s"] == pytest.approx(4000) and ex["of_bandwidth"] == 1.0
    dense = table["dense GEMMs and head"]
    assert dense["bytes"] == 200e6 and dense["gb_s"] == pytest.approx(4000)
    assert table["attention and caches"]["of_bandwidth"] == pytest.approx(0.075)
    assert table["other"]["bytes"] == 0 and table["other"]["gb_s"] is None and table["other"]["us"] == 8
    assert ps.expected_unique(256, 6, 1) == pytest.approx(6)


def test_expert_bytes_per_format_against_bf16():
    """The routed experts' bytes as stored, per weight against bf16's 2: FP8 1 + a 128x128 block's fp32
    scale, MXFP4 half a byte + an e8m0 per 32, NVFP4 half a byte + an e4m3 per 16 (quant_formats.md)."""
    f = ps.EXPERT_BYTE_FACTOR
    assert f["fp8_block"] * 2 == pytest.approx(1 + 4 / 16384)
    assert f["mxfp4_w4a16"] * 2 == pytest.approx(0.53125) and f["nvfp4_w4a16"] * 2 == pytest.approx(0.5625)


def test_quick_run_with_fp8_dense_counts_the_rewritten_weights_as_stored(tmp_path):
    """`--dense-format fp8_block_w8a16` on the CPU (tiny model): quantize_dense rewrites the FP8-stored
    linears (the grouped wo_a among them), and the dense bytes drop by what those weights save as stored."""
    import torch

    import bench_segments as bs

    out = tmp_path / "p.json"
    assert ps.main(["--device", "cpu", "--quick", "--dense-format", "fp8_block_w8a16", "--out", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["fp8_dense_linears"] > 0 and r["dense_format"] == "fp8_block_w8a16" and not r["deterministic"]
    model = bs.build("v4-tiny-a", torch.device("cpu"), torch.float32)
    cfg = model.config
    bf16 = bs.step_bytes(model, 1, 40, [ps.expected_unique(cfg.n_routed_experts, cfg.num_experts_per_tok, 1)]
                         * cfg.num_hidden_layers)
    saved = bs.stored_bytes_saved(model)
    assert 0 < saved["wo_a_saved"] < saved["saved"]
    for key in ("non_expert_weights", "total"):
        assert r["step_bytes"][key] == bf16[key] - saved["saved"]


def test_deterministic_with_fp8_experts_runs_their_batch_invariant_op(tmp_path):
    """`--deterministic --expert-format fp8_block` (CPU, tiny model): the deterministic lowering of FP8 experts
    leaves no blocker (make_batch_invariant swaps them for `moe_experts_fp8_bi`, tests/test_deterministic.py;
    the formats without such a kernel are refused by compile.deterministic_target)."""
    out = tmp_path / "d.json"
    assert ps.main(["--device", "cpu", "--quick", "--deterministic", "--expert-format", "fp8_block",
                    "--out", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["deterministic"] and r["expert_format"] == "fp8_block" and r["blockers"] == []


def test_quick_run_of_a_deterministic_verify_graph(tmp_path):
    """`--verify 2 --deterministic` on the CPU (tiny model): the verify graph of 3 tokens per row is lowered
    deterministically and profiled; the experts' bytes count the unique experts of 3 tokens per row."""
    out = tmp_path / "v.json"
    assert ps.main(["--device", "cpu", "--quick", "--deterministic", "--bf16-experts", "--verify", "2", "--batch", "2",
                    "--out", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["tokens_per_row"] == 3 and r["deterministic"] and r["blockers"] == []
    assert r["eager"]["step_ms"] > 0
    import torch

    import bench_segments as bs

    model = bs.build("v4-tiny-a", torch.device("cpu"), torch.float32)
    cfg = model.config
    unique = [ps.expected_unique(cfg.n_routed_experts, cfg.num_experts_per_tok, 2 * 3)] * cfg.num_hidden_layers
    assert r["step_bytes"]["routed_experts"] == bs.step_bytes(model, 2, 40, unique)["routed_experts"]  # 6 tokens


def test_timeline_takes_the_last_step_and_measures_gaps_from_the_latest_end():
    """`--timeline`: the last n spans, starts from the first of them, and each gap from the latest end
    before it (an overlap under programmatic dependent launch is negative, idle GPU time positive)."""
    spans = [("old", 0.0, 5.0), ("a", 10.0, 20.0), ("b", 18.0, 19.0), ("c", 25.0, 30.0), ("d", 29.0, 31.0)]
    rows = ps.timeline(spans, 4)
    assert [r["name"] for r in rows] == ["a", "b", "c", "d"]
    assert [r["start"] for r in rows] == [0.0, 8.0, 15.0, 19.0]
    assert [r["us"] for r in rows] == [10.0, 1.0, 5.0, 2.0]
    assert [r["gap"] for r in rows] == [0.0, -2.0, 5.0, -1.0]  # c waits on a's end (20), not b's (19)
    assert ps.timeline(spans, 0) == []


def test_critical_rows_count_only_how_far_each_kernel_moves_the_end():
    """A kernel launched early under PDL (b starts inside a and ends 4 us later) is charged 4 us, not its 10;
    one inside another's span nothing; an idle gap nobody. The shares add up to the busy time."""
    rows = ps.timeline([("a", 0.0, 10.0), ("b", 4.0, 14.0), ("c", 5.0, 6.0), ("b", 20.0, 23.0)], 4)
    crit = {r["name"]: (r["count"], r["us"]) for r in ps.critical_rows(rows)}
    assert crit == {"a": (1, 10.0), "b": (2, 7.0), "c": (1, 0.0)}
    assert sum(u for _, u in crit.values()) == 17.0  # 23 us spanned, 6 of them idle
    table = {r["class"]: r for r in ps.class_table(ps.critical_rows(
        ps.timeline([("_moe_gemm_kernel", 0.0, 50.0), ("_act_fp8_kernel", 10.0, 60.0)], 2)), 1,
        {"routed_experts": 60e3 * 3e3, "non_expert_weights": 0, "head": 0, "kv": 0}, 3e12)}
    assert table["routed experts"]["us"] == 60.0 and table["routed experts"]["of_bandwidth"] == pytest.approx(1.0)


def test_a_step_that_cannot_be_one_graph_says_so(tmp_path, capsys):
    """With the reference routed experts (a host sync per call) some segments are not capturable: the run says the
    step would replay piecewise and why, in its output and its JSON; the default quick run has no such note."""
    out = tmp_path / "p.json"
    assert ps.main(["--device", "cpu", "--quick", "--kernels", "moe_experts=reference", "--out", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["capturable"] < r["segments"] and any("moe_experts" in b for b in r["not_one_graph"]), r
    assert "not as one graph" in capsys.readouterr().out
    assert ps.main(["--device", "cpu", "--quick", "--out", str(out)]) == 0
    assert "not_one_graph" not in json.loads(out.read_text()) and "not as one graph" not in capsys.readouterr().out
