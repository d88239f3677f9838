"""examples/bench_artifact.py (issue 4's benchmark) end to end on the tiny model and the cpu target:
release checkpoint, eager and HF transformers peers, `dsv4c compile`, `dsv4c bench`, summary. No
torch.compile (minutes on a CPU); the H200 run in BENCHMARKS.md uses it."""
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
                        "--no-torch-compile", "--long-context", "60", "80", "--work", str(tmp_path / "w"),
                        "--out", str(out)],
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
    # the HF transformers peer (transformers is in the test extra): both batches, fp32 on the CPU, its logits
    # equal eager's to fp32 rounding (the same weights in HF's DeepseekV4)
    hf = {p["batch"]: p for p in res["peers"]["hf"]}
    assert sorted(hf) == [1, 3] and all(p["step_ms"] > 0 for p in hf.values())
    assert res["hf_peer"]["snr_db"] > 60 and res["hf_peer"]["cast"] == "float32"
    assert all(row["speedup_vs_hf"] == hf[row["batch"]]["step_ms"] / row["artifact_step_ms"] for row in res["summary"])
    assert "HF peer: transformers" in r.stdout
    eager = {p["batch"]: p for p in res["peers"]["eager"]}
    assert all(len(eager[b]["tokens"]) == b and eager[b]["unique_experts"] for b in (1, 3))
    assert "| batch | artifact ms/step |" in r.stdout
    # the long prompt's step and the prefill workload (--quick: 64 tokens), timed through `dsv4c bench`
    assert [lc["prompt"] for lc in res["long_context_summary"]] == [60, 80]
    assert all(lc["artifact_step_ms"] > 0 for lc in res["long_context_summary"])
    default, chunked = res["prefill_summary"]  # --quick: the Session's chunk, then 32 tokens per call
    assert default["calls"] == 1 and default["chunk"] >= 64 and (chunked["chunk"], chunked["calls"]) == (32, 2)
    for pre in (default, chunked):
        assert pre["prompt"] == 64 and pre["prefill_ms"] > 0
        assert pre["tokens_per_s"] == pytest.approx(64e3 / pre["prefill_ms"])
        assert pre["tflop"] * 1e12 == res["prefill_flops"]["64"]["total"] > 0
    assert "| tokens | chunk | calls |" in r.stdout


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


def _eager_weight_flops(model, P: int) -> tuple[int, int]:
    """(linear, routed-expert) FLOPs the eager model spends on a P-token prompt, read from the ops it runs:
    every mm / bmm whose right operand is a `layers.*` parameter's storage, and the expert op's assignments."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    cfg = model.config
    weights = {p.untyped_storage().data_ptr() for n, p in model.named_parameters() if n.startswith("layers.")}
    seen = {"linear": 0, "experts": 0}

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = str(func)
            if name in ("aten.mm.default", "aten.bmm.default") and args[1].untyped_storage().data_ptr() in weights:
                a, b = args[0].shape, args[1].shape
                seen["linear"] += 2 * (a[0] if len(a) == 3 else 1) * a[-2] * a[-1] * b[-1]
            if name == "dsv4c.moe_experts.default":
                seen["experts"] += 2 * 3 * cfg.hidden_size * cfg.moe_intermediate_size * args[1].numel()
            return func(*args, **(kwargs or {}))

    ids = torch.randint(0, cfg.vocab_size, (1, P), generator=torch.Generator().manual_seed(0))
    with Count(), torch.no_grad():
        model(ids)
    return seen["linear"], seen["experts"]


def _attention_flops_by_query(cfg, P: int) -> tuple[int, int]:
    """(attention, indexer) FLOPs per deepseek_v4.md §4.1, one query at a time: the window's rows, plus
    for ratio m the entries w with (w+1)m <= t+1 (HCA all, CSA the indexer's top-k after scoring all)."""
    attn = index = 0
    for m in cfg.compress_ratios[:cfg.num_hidden_layers]:
        for t in range(P):
            keys = min(t + 1, cfg.sliding_window)
            visible = sum(1 for w in range(P) if (w + 1) * m <= t + 1) if m else 0
            if m == 4:
                index += visible * cfg.index_n_heads * cfg.index_head_dim * 2
                keys += min(visible, cfg.index_topk)
            else:
                keys += visible
            attn += keys * cfg.num_attention_heads * cfg.head_dim * 2 * 2  # QK^T and PV
    return attn, index


@pytest.mark.parametrize("P", [1, 9, 40])
def test_prefill_flops_match_the_eager_models_ops(P):
    """bench_segments.prefill_flops (the prefill compute roofline's numerator): its linear and expert FLOPs
    equal what the eager model multiplies on a P-token prompt, its attention and indexer FLOPs equal a
    per-query count of the spec's key sets; the FP8 share is the release's FP8 dense plus the experts."""
    import torch

    sys.path.insert(0, str(EXAMPLES))
    from bench_segments import prefill_flops

    from dsv4c import ModelConfig
    from dsv4c.checkpoint import release_format
    from dsv4c.model import build_model

    cfg = ModelConfig.preset("v4-tiny-a")
    model = build_model(cfg, torch.device("cpu"), torch.float32)
    got = prefill_flops(model, P)
    linear, experts = _eager_weight_flops(model, P)
    assert (got["linear"], got["experts"]) == (linear, experts)
    assert (got["attention"], got["indexer"]) == _attention_flops_by_query(cfg, P)
    assert got["head"] == 2 * cfg.vocab_size * cfg.hidden_size  # the last row's logits
    fp8 = sum(p.numel() for n, p in model.named_parameters()
              if n.startswith("layers.") and ".experts." not in n and release_format(cfg, n) == "fp8")
    assert got["fp8"] == 2 * P * fp8 + experts and 0 < got["fp8"] < got["total"]
    assert got["total"] == sum(got[k] for k in ("linear", "experts", "head", "attention", "indexer"))


def test_prefill_chunk_bound_counts_each_calls_flops_and_bytes():
    """bench_segments.prefill_chunk_bound: one call of all P tokens is max(the prefill's FLOPs, one read of the
    weights and the experts P tokens touch); in calls of c tokens the FLOPs add one head row per call and the
    bytes one read per call, each call's max summed."""
    import torch

    sys.path.insert(0, str(EXAMPLES))
    from bench_segments import expected_unique, prefill_chunk_bound, prefill_flops, step_bytes

    from dsv4c import ModelConfig
    from dsv4c.model import build_model

    cfg = ModelConfig.preset("v4-tiny-a")
    model = build_model(cfg, torch.device("cpu"), torch.float32)
    P, head = 40, 2 * cfg.vocab_size * cfg.hidden_size
    by = step_bytes(model, 1, 0, [1] * cfg.num_hidden_layers)
    one_expert = by["routed_experts"] / cfg.num_hidden_layers / 2  # factor 0.5 below

    def reads(n):
        return by["non_expert_weights"] + by["head"] + cfg.num_hidden_layers * expected_unique(
            cfg.n_routed_experts, cfg.num_experts_per_tok, n) * one_expert

    flops = prefill_flops(model, P)["total"]
    whole = prefill_chunk_bound(model, P, 64, 1e12, 1e9, 0.5)
    assert whole["flops_ms"] == pytest.approx(flops / 1e12 * 1e3) and whole["bytes_ms"] == pytest.approx(reads(P) / 1e6)
    assert whole["ms"] == pytest.approx(max(whole["flops_ms"], whole["bytes_ms"]))
    calls = prefill_chunk_bound(model, P, 16, 1e12, 1e9, 0.5)  # 16 + 16 + 8 tokens
    assert calls["flops_ms"] == pytest.approx((flops + 2 * head) / 1e9)
    assert calls["bytes_ms"] == pytest.approx((2 * reads(16) + reads(8)) / 1e6)
    F = [prefill_flops(model, n)["total"] - head for n in (0, 16, 32, 40)]  # FLOPs before each call, no head
    per_call = [max((F[i + 1] - F[i] + head) / 1e9, reads(n) / 1e6) for i, n in enumerate((16, 16, 8))]
    assert calls["ms"] == pytest.approx(sum(per_call))
