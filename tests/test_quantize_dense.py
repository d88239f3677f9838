"""passes/quantize_dense.py: the FP8-stored dense linears -> dsv4c::fp8_linear_w8a8 / w8a16.

A tiny V4 model (hidden 128 so that W8A8's 128-wide activation blocks apply), every parameter
random, fp32, the weights the release stores in FP8 rounded to FP8-block values (what loading the
release checkpoint gives). Graph level against the eager logits: W8A16 within `dense_w8a16`, W8A8
within `dense_w8a8` (kernels/tolerances.py), the right linears rewritten and the others kept with a
reason. The compile path (stored bytes in the artifact) is tested in tests/test_quantize_experts.py,
which compiles a release checkpoint for h200 already.
"""
from __future__ import annotations

import copy

import pytest
import torch
from dsv4c.kernels.fp8_gemm import fp8_gemm_w8a8_ref, fp8_gemm_w8a16_ref
from dsv4c.kernels.act_quant import act_quant_fp8_ref
from dsv4c.kernels.tolerances import KERNEL_REL_ERR, rel_err
from dsv4c.passes import PassContext, get_param, run_pipeline
from dsv4c.passes.fuse_projections import fuse_projections
from dsv4c.passes.quantize_dense import DenseFormatError, _why_not, quantize_dense, quantize_dense_as

from dsv4c import ModelConfig
from dsv4c import quant as Q
from dsv4c.checkpoint import release_format
from dsv4c.compare import _cases, _run, _run_tapped
from dsv4c.export import export_graph
from dsv4c.model import build_model, register_ops

register_ops()
OPS = {"w8a8": torch.ops.dsv4c.fp8_linear_w8a8.default, "w8a16": torch.ops.dsv4c.fp8_linear_w8a16.default}
TIGHT = 100  # W8A8's error must exceed its bound / TIGHT: activations really were quantised
CFG = ModelConfig.preset("v4-tiny-a").replace(hidden_size=128, q_lora_rank=128, o_lora_rank=64,
                                              moe_intermediate_size=128)


def _round_fp8_(model) -> int:
    """Round every weight the release stores in FP8 to its FP8-block value (in place); returns the count."""
    n = 0
    for name, p in model.named_parameters():
        if release_format(model.config, name) == "fp8":
            q, s = Q.quant_fp8_block(p.detach().float())
            p.data.copy_(Q.dequant_fp8_block(q, Q.e8m0_to_float(s)))
            n += 1
    return n


@pytest.fixture(scope="module")
def fused():
    """(case with eager logits, the decode graph after fuse_projections, the fp32 weights by graph name)."""
    torch.manual_seed(0)
    m = build_model(CFG)
    with torch.no_grad():
        assert _round_fp8_(m) > 10
        case = _cases(m, ["decode"], k=0, seed=0)[0]
        gm = export_graph(m, case.spec).module()
    gm, _ = run_pipeline(gm, PassContext(CFG, "h200", "decode"), passes=[("fuse_projections", fuse_projections)])
    weights = {n: t.detach().clone() for n, t in gm.named_parameters()}
    return case, gm, weights


def _rewrite(fused, fmt):
    case, gm0, weights = fused
    gm, recs = run_pipeline(copy.deepcopy(gm0), PassContext(CFG, "h200", "decode"),
                            passes=[("quantize_dense", quantize_dense_as(fmt))])
    return case, gm, weights, recs[0].stats


def _check_rewritten(gm, weights, st, kernel):
    names = {r["weight"] for r in st["linears"]}
    # every attention / shared-expert weight the release stores in FP8 that is not fused with bf16 members
    for layer in range(CFG.num_hidden_layers):
        pre = f"model.layers.{layer}."
        assert {pre + "attn.wo_b.weight", pre + "ffn.shared_experts.w2.weight",
                pre + "ffn.shared_experts.fused_w1__w3.weight"} <= names, layer
        assert any(n.startswith(pre + "attn.") and "wq_b" in n for n in names), layer
    assert "model.layers.0.attn.fused_wq_a__wkv.weight" in names  # no compressor: wq_a ‖ wkv only
    assert all(r["kernel"] == kernel for r in st["linears"])
    ops = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert ops.count(OPS[kernel]) == len(names)
    attrs = {n.target for n in gm.graph.nodes if n.op == "get_attr"}
    assert not names & attrs and "model.head.weight" in attrs  # the LM head stays as stored
    for r in st["linears"]:
        w_q, w_s = (get_param(gm, r["tensors"][f]) for f in ("w_q", "w_s"))
        assert w_q.dtype == torch.float8_e4m3fn and w_s.dtype == torch.uint8  # ue8m0 bytes
        # FP8-block values in: the FP8 form holds them exactly (no requantisation loss)
        assert torch.equal(Q.dequant_fp8_block(w_q, Q.e8m0_to_float(w_s.view(torch.float8_e8m0fnu))),
                           weights[r["weight"]]), r["weight"]


@torch.no_grad()
def test_w8a16_matches_eager_within_the_kernel_tolerance(fused):
    case, gm, weights, st = _rewrite(fused, "fp8_block_w8a16")
    _check_rewritten(gm, weights, st, "w8a16")
    err = rel_err(_run(gm, case), case.ref)
    assert err <= KERNEL_REL_ERR["dense_w8a16"], err


@torch.no_grad()
def test_w8a8_within_its_bound(fused):
    case, gm, weights, st = _rewrite(fused, "fp8_block")
    _check_rewritten(gm, weights, st, "w8a8")
    out, _ = _run_tapped(gm, case, pin=True)  # eager's routing: the bound is about the GEMMs, not flips
    bound = KERNEL_REL_ERR["dense_w8a8"]
    err = rel_err(out, case.ref)
    assert bound / TIGHT < err <= bound, err
    assert set(st["quant_map"]) == {r["weight"] for r in st["linears"]}
    assert {q["dense_format"] for q in st["quant_map"].values()} == {"fp8_block"}


def test_kept_linears_say_why_and_unquantised_formats_rewrite_nothing(fused):
    case, gm0, _ = fused
    _, _, _, st = _rewrite(fused, "fp8_block")
    kept = {k["weight"]: k["why"] for k in st["kept"]}
    # compressed layers fuse wq_a ‖ wkv with the bf16-stored compressor / indexer projections
    assert kept and all("does not store in FP8" in why for why in kept.values())
    assert all("compressor" in w for w in kept)
    for fmt in ("reference", "bf16"):
        res = quantize_dense_as(fmt)(copy.deepcopy(gm0), PassContext(CFG, "h200", "decode"))
        assert not res.changed and not res.stats["linears"]
    assert not quantize_dense(copy.deepcopy(gm0), PassContext(CFG, "cpu", "decode")).changed  # cpu: reference
    with pytest.raises(DenseFormatError, match="--dense-format"):
        quantize_dense(gm0, PassContext(CFG, "h200", "decode", dense_format="fp4"))
    names = ["model.layers.0.attn.wq_a.weight", "model.layers.0.attn.wkv.weight"]
    assert "align to 128" in _why_not(CFG, names, [96, 512], 1)  # scale tiles would straddle members
    assert _why_not(CFG, names, [128, 512], 1) is None
    assert _why_not(CFG, ["model.head.weight"], [None], 1) == ""  # not an FP8 weight: no candidate


def test_ops_cpu_path_is_the_reference():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 3, 256, generator=g)
    w_q, w_s = Q.quant_fp8_block(torch.randn(200, 256, generator=g) * 0.05)
    for s in (w_s, w_s.view(torch.uint8)):
        y = torch.ops.dsv4c.fp8_linear_w8a16(x, w_q, s)
        assert y.shape == (2, 3, 200) and y.dtype == x.dtype
        assert torch.equal(y.view(6, 200), fp8_gemm_w8a16_ref(x.view(6, 256), w_q, w_s))
        y8 = torch.ops.dsv4c.fp8_linear_w8a8(x, w_q, s)
        assert torch.equal(y8.view(6, 200), fp8_gemm_w8a8_ref(*act_quant_fp8_ref(x.view(6, 256)), w_q, w_s))
        assert 0 < rel_err(y8, y) <= KERNEL_REL_ERR["dense_w8a8"]


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 8, 64, 65])  # decode GEMVs up to 64 rows, tile GEMMs above
def test_ops_gpu_match_the_reference_and_capture(m):
    g = torch.Generator().manual_seed(2)
    x = torch.randn(m, 1024, generator=g).bfloat16().cuda()
    w_q, w_s = (t.cuda() for t in Q.quant_fp8_block(torch.randn(1536, 1024, generator=g) * 0.05))
    w_s = w_s.view(torch.uint8)
    for name, tol in (("fp8_linear_w8a16", "gemm_fp8_w_bf16_a"), ("fp8_linear_w8a8", "gemm_fp8")):
        op = getattr(torch.ops.dsv4c, name)
        ref = op(x.cpu().float(), w_q.cpu(), w_s.cpu())
        y = op(x, w_q, w_s)
        assert y.dtype == torch.bfloat16 and rel_err(y.float().cpu(), ref) < KERNEL_REL_ERR[tol], name
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            yg = op(x, w_q, w_s)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(yg, y), name


def test_bench_dense_formats_prep_roundtrip(tmp_path):
    """examples/bench_dense_formats.py --reuse: stages 1-2's results (roofline, eager's logits and routing)
    come back from prep.pt (weights_only, no pickled objects) for the same key only."""
    import argparse
    import sys
    from pathlib import Path

    from dsv4c.routing import IndexEntry, RoutingEntry, RoutingTable

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
    import bench_dense_formats as bench

    a = argparse.Namespace(preset="v4-tiny-b", prompt=40, steps=6, batches=[1, 3], device="cpu")
    routing = RoutingTable([RoutingEntry("layers.0", torch.tensor([[1, 2]]), torch.tensor([[0.5, 0.5]]), True),
                            RoutingEntry("layers.1", torch.tensor([[3, 0]]), torch.tensor([[0.7, 0.3]]), False,
                                         torch.tensor([0.25]))], [IndexEntry("layers.1", torch.tensor([[0, 3]]))])
    check = ([5, 6], torch.randn(7), [1, 2, 3, 4], torch.randn(2, 7), routing)
    res = {"copy_bandwidth_GBps": 4200.0, "rounded": {"fp8": 3}, "roofline": {1: {"stored_ms": 0.5}, 3: {"stored_ms": 0.7}}}
    bench.save_prep(tmp_path / "prep.pt", bench._prep_key(a), res, check)
    fields, back = bench.load_prep(tmp_path / "prep.pt", bench._prep_key(a))
    assert fields == res and back[0] == check[0] and back[2] == check[2]
    assert torch.equal(back[1], check[1]) and torch.equal(back[3], check[3])
    for e, f in zip(back[4].entries, routing.entries, strict=True):
        assert (e.name, e.hashed) == (f.name, f.hashed) and torch.equal(e.idx, f.idx) and torch.equal(e.weight, f.weight)
        assert (e.margins is None) == (f.margins is None)
    assert [(e.name, e.idx.tolist()) for e in back[4].index] == [("layers.1", [[0, 3]])]
    a.prompt = 41
    assert bench.load_prep(tmp_path / "prep.pt", bench._prep_key(a)) is None
