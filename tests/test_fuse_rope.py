"""The interleaved RoPE kernel (kernels/rope.py), its custom op and the fuse_rope pass (V4 and V3)."""
from __future__ import annotations

import pytest
import torch

from dsv4c.kernels.rope import rope_interleaved, rope_interleaved_ref
from dsv4c.model import register_ops
from dsv4c.passes import PassContext, run_pipeline, verify
from dsv4c.passes.fuse_rope import fuse_rope
from dsv4c.passes.split_at_routers import OP_CAPTURE, host_sync_ops, plan_segments, reference_impl
from fusion_cases import (assert_same as _assert_same, exported as _exported, inputs as _inputs, model as _model,
                           rel as _rel, run as _run)

register_ops()

# Kernel vs an fp64 reference, relative norm ||k - r|| / ||r||, by x's dtype. fp32: the same products
# and sums (measured <= 6e-8, FMA contraction on CUDA aside). Low precision: one rounding of the
# rotated channels, which the Triton interpreter truncates (< 1 ulp: 2^-7 bf16, 2^-10 fp16).
KERNEL_REL = {torch.float32: 1e-6, torch.bfloat16: 1e-2, torch.float16: 1.5e-3}
GRAPH_REL = 2e-6  # decode graph with the Triton kernel (interpreter) in place of each op, fp32 model


def _rope64(x, cos, sin, inverse):
    r = 2 * cos.shape[-1]
    xd = x.double()
    a, b = xd[..., -r::2], xd[..., -r + 1::2]
    s = -sin.double() if inverse else sin.double()
    c = cos.double()
    out = xd.clone()
    out[..., -r::2] = a * c - b * s
    out[..., -r + 1::2] = a * s + b * c
    return out


def _angles(shape, seed):
    g = torch.Generator().manual_seed(seed)
    ang = 6.3 * torch.rand(shape, generator=g)
    return ang.cos(), ang.sin()


# ---- the kernel (Triton interpreter on CPU) ---------------------------------------------------------
@pytest.mark.parametrize("x_shape,cs_shape,dtype,inverse", [
    ((2, 1, 64), (2, 1, 8), torch.bfloat16, False),         # V4 kv row [B, T, d]
    ((2, 3, 4, 64), (2, 3, 1, 8), torch.float32, True),     # V4 o, inverse, per-head broadcast
    ((3, 1, 16, 32), (3, 1, 1, 8), torch.bfloat16, False),  # indexer q: half the row rotated
    ((2, 2, 3, 16), (2, 2, 1, 8), torch.float32, False),    # all channels rotated (V3 q_pe): no pass-through
    ((5, 24), (5, 6), torch.float16, True),                 # non-power-of-two widths
    ((4, 1, 100), (1, 1, 10), torch.float32, False),        # cos broadcast over the batch too
    ((0, 1, 64), (0, 1, 8), torch.float32, False),          # no rows: no launch
])
def test_kernel_matches_fp64(x_shape, cs_shape, dtype, inverse):
    g = torch.Generator().manual_seed(sum(x_shape))
    x = (2 * torch.randn(x_shape, generator=g)).to(dtype)
    cos, sin = _angles(cs_shape, seed=len(x_shape))
    got = rope_interleaved(x, cos, sin, inverse)
    want = _rope64(x, cos, sin, inverse)
    assert got.shape == x.shape and got.dtype == dtype
    assert _rel(got, want) <= KERNEL_REL[dtype]
    assert _rel(rope_interleaved_ref(x, cos, sin, inverse), want) <= KERNEL_REL[dtype]
    if got.numel():  # direction matters, and the pass-through channels are exact
        assert _rel(got, _rope64(x, cos, sin, not inverse)) > 0.05
        keep = x.shape[-1] - 2 * cos.shape[-1]
        assert torch.equal(got[..., :keep], x[..., :keep])


def test_strided_x_and_expanded_cos():
    x = torch.randn(4, 3, 2, 48).transpose(0, 1)  # [3, 4, 2, 48], not contiguous
    cos, sin = _angles((3, 4, 1, 12), seed=5)
    assert _rel(rope_interleaved(x, cos, sin), _rope64(x, cos, sin, False)) <= KERNEL_REL[torch.float32]
    cos_e, sin_e = cos.expand(3, 4, 2, 12), sin.expand(3, 4, 2, 12)  # stride-0 dim
    assert _rel(rope_interleaved(x, cos_e, sin_e), _rope64(x, cos, sin, False)) <= KERNEL_REL[torch.float32]


@pytest.mark.parametrize("inverse", [False, True])
def test_column_slices_are_read_in_place_with_the_same_bits(inverse):
    """The indexer's q and the kv row as column slices of a fused projection's output at several tokens:
    both kernels read them through their strides and give the bits of their contiguous copies."""
    from dsv4c.kernels.rope import head_rms_rope

    fused = (2 * torch.randn(3, 2, 5 * 48 + 24)).to(torch.bfloat16)
    x = fused[..., 24:].unflatten(-1, (5, 48))               # [3, 2, 5, 48] inside a wider row
    cos, sin = _angles((3, 2, 1, 8), seed=2)
    assert not x.is_contiguous() and x.stride(-1) == 1
    got = rope_interleaved(x, cos, sin, inverse)
    assert got.is_contiguous() and torch.equal(got, rope_interleaved(x.contiguous(), cos, sin, inverse))
    got = head_rms_rope(x, cos[:, :, 0], sin[:, :, 0], 1e-6)
    assert got.is_contiguous() and torch.equal(got, head_rms_rope(x.contiguous(), cos[:, :, 0], sin[:, :, 0], 1e-6))


@pytest.mark.parametrize("x,cs,err", [
    (torch.zeros(2, 8, dtype=torch.float64), torch.zeros(2, 2), "float32/bfloat16/float16"),
    (torch.zeros(2, 8), torch.zeros(2, 5), "rotates 10 channels"),
    (torch.zeros(2, 1, 1, 1, 8), torch.zeros(2, 1, 1, 1, 2), "at most 3 leading dims"),
    (torch.zeros(1, 8), torch.zeros(3, 2), "would broadcast x"),
    (torch.zeros(2, 8), torch.zeros(3, 2), "do not broadcast"),
])
def test_wrapper_rejects_bad_input(x, cs, err):
    with pytest.raises(ValueError, match=err):
        rope_interleaved(x, cs, cs.clone())


# ---- the custom op ---------------------------------------------------------------------------------
@pytest.mark.parametrize("inverse", [False, True])
def test_op_is_the_model_function_on_cpu_fake_and_capture_safe(inverse):
    x = torch.randn(2, 3, 4, 40).to(torch.bfloat16)
    cos, sin = _angles((2, 3, 1, 8), seed=0)
    assert torch.equal(torch.ops.dsv4c.rope_interleaved(x, cos, sin, inverse), rope_interleaved_ref(x, cos, sin, inverse))
    with torch._subclasses.FakeTensorMode() as mode:
        fake = torch.ops.dsv4c.rope_interleaved(*(mode.from_tensor(t) for t in (x, cos, sin)), inverse)
    assert fake.shape == x.shape and fake.dtype == x.dtype
    assert OP_CAPTURE["dsv4c.rope_interleaved"] is None
    assert host_sync_ops(reference_impl("dsv4c.rope_interleaved"), x, cos, sin, inverse) == []


# ---- the pass -----------------------------------------------------------------------------------
def _expected(name, kind) -> tuple[int, int]:
    """(rope calls, of them inverse) in the step: V4 q, kv and inverse o per layer + the indexer q of
    CSA layers; V3 q_pe and k_pe per layer."""
    cfg = _model(name).config
    if name != "v4":
        return 2 * (1 if kind == "mtp" else cfg.num_hidden_layers), 0
    ratios = [0] if kind == "mtp" else [cfg.layer_ratio(i) for i in range(cfg.num_hidden_layers)]
    return sum(3 + (m == 4) for m in ratios), len(ratios)


@pytest.mark.parametrize("name,kind,dtype", [
    ("v4", "decode", torch.float32),
    ("v4", "verify", torch.bfloat16),
    ("v4", "mtp", torch.float32),
    ("v4", "prefill", torch.float32),
    ("v3-tiny", "decode", torch.bfloat16),
    ("v32-tiny", "mtp", torch.float32),
])
def test_pass_fuses_every_rope_bit_exact(name, kind, dtype):
    model = _model(name, dtype)
    ctx = PassContext(model.config, "cpu", graph_kind=kind)
    ref_gm = _exported(name, kind, dtype)
    res = fuse_rope(_exported(name, kind, dtype), ctx)
    gm = res.graph
    verify(gm, ctx, after="fuse_rope")
    n, inv = _expected(name, kind)
    assert res.changed and res.stats == {"sites": n, "inverse": inv}
    assert sum(nd.target is torch.ops.dsv4c.rope_interleaved.default for nd in gm.graph.nodes) == n
    assert not [nd for nd in gm.graph.nodes if nd.target is torch.ops.aten.stack.default]  # only RoPE stacks
    args = _inputs(name, kind, dtype)
    _assert_same(_run(gm, args), _run(ref_gm, args))  # CPU: the op is the model's function: exact
    again = fuse_rope(gm, ctx)
    assert not again.changed and again.stats["sites"] == 0


def test_fused_graph_with_the_triton_kernel_matches():
    ctx = PassContext(_model("v4").config, "cpu", graph_kind="verify")
    ref_gm = _exported("v4", "verify")
    gm = fuse_rope(_exported("v4", "verify"), ctx).graph
    for nd in gm.graph.nodes:
        if nd.target is torch.ops.dsv4c.rope_interleaved.default:
            nd.target = rope_interleaved
    gm.recompile()
    args = _inputs("v4", "verify")
    _assert_same(_run(gm, args), _run(ref_gm, args), rel=GRAPH_REL)


def test_in_the_pipeline_ropes_sit_in_capturable_segments():
    """In default_pipeline (after fuse_projections took the main q RoPE into head_rms_rope): the
    outputs equal the pipeline without it; on h200 the ops sit in capturable static segments."""
    ctx = PassContext(_model("v4").config, "h200", graph_kind="decode")
    args = _inputs("v4", "decode")
    skip = ("quantize_experts", "quantize_dense")  # lossy (tests/test_quantize_experts.py, test_quantize_dense.py)
    unfused, _ = run_pipeline(_exported("v4", "decode"), ctx, skip=skip + ("fuse_rope",))
    gm, recs = run_pipeline(_exported("v4", "decode"), ctx, skip=skip)
    n, inv = _expected("v4", "decode")
    layers = _model("v4").config.num_hidden_layers
    assert next(r for r in recs if r.name == "fuse_rope").stats == {"sites": n - layers, "inverse": inv}
    _assert_same(_run(gm, args), _run(unfused, args))
    plan = plan_segments(gm, ctx)
    names = {nd.name for nd in gm.graph.nodes if nd.target is torch.ops.dsv4c.rope_interleaved.default}
    holding = [s for s in plan.segments if names & set(s.nodes)]
    assert sum(len(names & set(s.nodes)) for s in holding) == len(names) == n - layers
    assert all(s.kind == "static" and s.capturable for s in holding), [(s.index, s.reason) for s in holding]


# ---- CUDA (the device) ------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("batch", [1, 8, 64])
@pytest.mark.parametrize("x_tail,cs_tail,dtype,inverse", [
    ((1, 512), (1, 32), torch.bfloat16, False),      # V4-Flash kv row (d 512, rope 64)
    ((1, 64, 512), (1, 1, 32), torch.float32, True),  # V4-Flash o: 64 heads, fp32, inverse
    ((1, 64, 128), (1, 1, 32), torch.bfloat16, False),  # indexer q (dI 128)
])
def test_kernel_on_cuda(batch, x_tail, cs_tail, dtype, inverse):
    g = torch.Generator().manual_seed(batch)
    x = (2 * torch.randn(batch, *x_tail, generator=g)).to(dtype).cuda()
    cos, sin = (t.cuda() for t in _angles((batch, *cs_tail), seed=batch))
    got = torch.ops.dsv4c.rope_interleaved(x, cos, sin, inverse)
    tol = {torch.float32: 1e-6, torch.bfloat16: 5e-3}[dtype]  # round to nearest on the device
    assert _rel(got, _rope64(x, cos, sin, inverse)) <= tol
    assert _rel(got, rope_interleaved_ref(x, cos, sin, inverse)) <= 2 * tol
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = torch.ops.dsv4c.rope_interleaved(x, cos, sin, inverse)
    x.copy_(torch.randn_like(x))
    graph.replay()
    assert _rel(out, _rope64(x, cos, sin, inverse)) <= tol


# ---- head_rms_rope: per-head RMS norm + RoPE in one launch (the `fused` implementation) -----------
def _head_rms_rope64(q, cos, sin, eps):
    """fp64 of the model op's order: rms in fp64, rounded to q's dtype, then the rotation in fp64."""
    qd = q.double()
    normed = (qd * torch.rsqrt(qd.pow(2).mean(-1, keepdim=True) + eps)).to(q.dtype)
    return _rope64(normed, cos[:, :, None], sin[:, :, None], False)


@pytest.mark.parametrize("shape,half,dtype", [
    ((1, 1, 4, 64), 8, torch.float32),
    ((3, 2, 5, 48), 8, torch.bfloat16),   # 48 channels: not a power of two
    ((2, 1, 3, 40), 4, torch.float32),
    ((2, 3, 2, 16), 8, torch.bfloat16),   # every channel rotated
])
def test_head_rms_rope_kernel_matches_fp64(shape, half, dtype):
    from dsv4c.kernels.rope import head_rms_rope, head_rms_rope_ref

    g = torch.Generator().manual_seed(sum(shape))
    q = (3 * torch.randn(shape, generator=g) + 0.5).to(dtype)
    cos, sin = _angles((shape[0], shape[1], half), seed=half)
    got = head_rms_rope(q, cos, sin, 1e-6)
    want = _head_rms_rope64(q, cos, sin, 1e-6)
    assert got.shape == q.shape and got.dtype == dtype
    assert _rel(got, want) <= KERNEL_REL[dtype]
    assert _rel(head_rms_rope_ref(q, cos, sin, 1e-6), want) <= KERNEL_REL[dtype]
    assert _rel(got, _rope64(q, cos[:, :, None], sin[:, :, None], False)) > 0.05  # the norm happened


def test_head_rms_rope_op_is_the_model_op_on_cpu_and_rejects_bad_input():
    from dsv4c.kernels.rope import head_rms_rope, head_rms_rope_ref

    q = torch.randn(2, 1, 3, 32)
    cos, sin = _angles((2, 1, 4), seed=1)
    assert torch.equal(torch.ops.dsv4c.head_rms_rope_fused(q, cos, sin, 1e-6), head_rms_rope_ref(q, cos, sin, 1e-6))
    assert "dsv4c.head_rms_rope_fused" in OP_CAPTURE and OP_CAPTURE["dsv4c.head_rms_rope_fused"] is None
    with pytest.raises(ValueError, match=r"q must be \[B, T, H, d\]"):
        head_rms_rope(q[0], cos, sin, 1e-6)
    with pytest.raises(ValueError, match="rotates 40 channels"):
        head_rms_rope(q, *_angles((2, 1, 20), seed=2), 1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("batch", [1, 8])
def test_head_rms_rope_on_cuda(batch):
    g = torch.Generator().manual_seed(batch)
    q = (2 * torch.randn(batch, 1, 64, 512, generator=g)).to(torch.bfloat16).cuda()  # V4-Flash q
    cos, sin = (t.cuda() for t in _angles((batch, 1, 32), seed=batch))
    got = torch.ops.dsv4c.head_rms_rope_fused(q, cos, sin, 1e-6)
    assert _rel(got, _head_rms_rope64(q, cos, sin, 1e-6)) <= 5e-3
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = torch.ops.dsv4c.head_rms_rope_fused(q, cos, sin, 1e-6)
    q.copy_(torch.randn_like(q))
    graph.replay()
    assert _rel(out, _head_rms_rope64(q, cos, sin, 1e-6)) <= 5e-3
