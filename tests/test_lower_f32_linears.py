"""passes/lower_f32_linears.py: fp32 linears of bf16 operands become dsv4c.linear_f32."""
from __future__ import annotations

import copy

import pytest
import torch

from dsv4c import ModelConfig
from dsv4c.export import GraphSpec, export_graph, flat_caches, graph_ops
from dsv4c.model import build_model, set_dtype_
from dsv4c.passes import PassContext, run_pipeline, verify
from dsv4c.passes.lower_f32_linears import lower_f32_linears
from dsv4c.model.static_ops import linear_f32


def _model(dtype):
    cfg = ModelConfig.preset("v4-tiny-a")
    model = build_model(cfg)
    set_dtype_(model, dtype)
    return model.eval()


def _step(gm, model, seed=0):
    g = torch.Generator().manual_seed(seed)
    cache = model.new_cache(3, max_len=32)
    model(torch.randint(0, model.config.vocab_size, (2, 9), generator=g), cache, slots=torch.arange(2))
    ids = torch.randint(0, model.config.vocab_size, (2, 1), generator=g)
    c = copy.deepcopy(cache)
    return gm(ids, torch.arange(2), c.pos[:2].clone(), torch.ones(2, dtype=torch.int64), flat_caches(c.layers))[0]


@torch.no_grad()
def test_bf16_head_and_gates_are_lowered_and_outputs_are_unchanged():
    model = _model(torch.bfloat16)
    cfg = model.config
    ep = export_graph(model, GraphSpec("decode", n_slots=3, max_len=32))
    gm0 = ep.module()
    gm, recs = run_pipeline(copy.deepcopy(gm0), PassContext(cfg, "h200", "decode"))
    rec = next(r for r in recs if r.name == "lower_f32_linears")
    # the head, one router gate per layer, and per compressed layer the compressor (+ indexer)
    # projections that fuse_projections stacked into one bf16 weight: nothing else in V4 is an fp32
    # linear of bf16 weights
    compressed = sum(cfg.layer_ratio(i) > 0 for i in range(cfg.num_hidden_layers))
    n_sites = 1 + cfg.num_hidden_layers + compressed
    assert rec.changed and rec.stats["sites"] == n_sites, rec.stats
    assert "model.head.weight" in rec.stats["weights"]
    assert sum(".fused_" in w for w in rec.stats["weights"]) == compressed
    assert graph_ops(gm)["linear_f32_fused.default"] == n_sites  # select_kernels: the h200 target's `fused`
    verify(gm, PassContext(cfg, "h200", "decode"), after="lower_f32_linears")
    # no fp32 copy of the head weight is left in the graph
    for n in gm.graph.nodes:
        if n.op == "call_function" and n.target is torch.ops.aten.to.dtype:
            assert not (n.args[0].op == "get_attr" and n.args[0].target == "model.head.weight"), n
    ref = _step(run_pipeline(copy.deepcopy(gm0), PassContext(cfg, "h200", "decode"), skip=["lower_f32_linears"])[0],
                model)
    out = _step(gm, model)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, ref, rtol=0, atol=0)  # CPU: the same fp32 math


def test_fp32_model_has_nothing_to_lower():
    model = _model(torch.float32)
    gm = export_graph(model, GraphSpec("decode", n_slots=3, max_len=32)).module()
    res = lower_f32_linears(gm, PassContext(model.config, "h200", "decode"))
    assert not res.changed and res.stats["sites"] == 0


def test_linear_f32_cpu_equals_fp32_reference():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 64, generator=g).bfloat16()
    w = torch.randn(40, 64, generator=g).bfloat16()
    out = linear_f32(x, w)
    assert out.shape == (2, 3, 40) and out.dtype == torch.float32
    torch.testing.assert_close(out, x.float() @ w.float().t(), rtol=0, atol=0)


@pytest.mark.gpu
def test_linear_f32_cuda_keeps_fp32_accuracy():
    """cuBLAS with an fp32 output against fp64. Hopper's tensor cores accumulate with fewer guard
    bits than a CUDA-core fp32 GEMM (measured on the H200: 1.4e-6 vs 1.6e-7 at K = 4096), so the bound
    is fp32-level (1e-5) and far below what a bf16 output would lose (checked: >= 100x smaller)."""
    g = torch.Generator().manual_seed(0)
    for m, n, k in [(1, 129280 // 64, 4096), (7, 1000, 320), (64, 256, 4096), (0, 16, 64)]:
        x = torch.randn(m, k, generator=g).bfloat16().cuda()
        w = torch.randn(n, k, generator=g).bfloat16().cuda()
        out = linear_f32(x, w)
        assert out.dtype == torch.float32 and out.shape == (m, n)
        if not m:
            continue
        exact = x.double() @ w.double().t()
        rel = lambda y: ((y.double() - exact).norm() / exact.norm()).item()  # noqa: E731
        err_out, err_bf16 = rel(out), rel(torch.nn.functional.linear(x, w))
        assert err_out < 1e-5 and err_out * 100 <= err_bf16, (m, n, k, err_out, err_bf16)
