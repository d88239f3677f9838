"""Grouped MoE kernels (dsv4c.kernels.moe_grouped) vs their reference, per weight format.

CPU: Triton interpreter, small shapes, large blocks. GPU tests: -m gpu on the device machine.
"""
from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from dsv4c.kernels import _tl as U
from dsv4c.kernels import moe_grouped as M
from dsv4c.kernels.tolerances import FORMAT_VS_FP32_REL_ERR, KERNEL_REL_ERR, rel_err

import dsv4c.model.moe  # noqa: F401  (registers torch.ops.dsv4c.moe_experts)
from dsv4c.model.moe import moe_experts_loop
from moe_cases import float_weights, inputs, routing

FORMATS = {c.format: c for c in (M.Bf16Experts, M.Fp8BlockExperts, M.Mxfp4Experts, M.Nvfp4Experts,
                                 M.Nvfp4W4A4Experts)}
LIMIT = 0.6


# (T, K, E, D, I): T not a multiple of BLOCK_M=16, D not of BLOCK_K=128, I not of BLOCK_N=128,
# except for fp8_block whose format needs D, I % 128 == 0.
SHAPES = {"bf16": (9, 2, 6, 160, 96), "mxfp4": (9, 2, 6, 160, 96), "nvfp4": (9, 2, 6, 160, 96),
          "nvfp4_w4a4": (9, 2, 6, 160, 96), "fp8_block": (9, 2, 6, 256, 128)}


@pytest.mark.parametrize("case", ["random", "empty_experts", "one_expert_all", "repeated_ids"])
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_moe_grouped_matches_ref(fmt, case):
    t, k, e, d, i = SHAPES[fmt]
    if case == "one_expert_all":
        t = 37                            # several M-blocks of one expert
    experts = FORMATS[fmt].from_float(*float_weights(e, i, d))
    x = inputs(t, d)
    idx, weight = routing(case, t, k, e)
    y = M.moe_grouped(x, idx, weight, experts, LIMIT)
    ref = M.moe_grouped_ref(x, idx, weight, experts, LIMIT)
    assert y.dtype == torch.bfloat16 and y.shape == (t, d)
    assert rel_err(y, ref) < KERNEL_REL_ERR[fmt]


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_format_vs_unquantised_fp32(fmt):
    t, k, e, d, i = SHAPES[fmt]
    w1, w3, w2 = float_weights(e, i, d, seed=3)
    x = inputs(t, d, seed=4)
    idx, weight = routing("random", t, k, e, seed=5)
    y = M.moe_grouped(x, idx, weight, FORMATS[fmt].from_float(w1, w3, w2), LIMIT)
    exact = M.moe_grouped_ref(x, idx, weight, M.Bf16Experts(torch.cat((w1, w3), 1).bfloat16(), w2.bfloat16()), LIMIT)
    err = rel_err(y, exact)
    assert err < FORMAT_VS_FP32_REL_ERR[fmt]
    if fmt != "bf16":
        assert err > 1e-3               # the quantisation really happened


def test_ref_matches_the_model_loop_in_fp32():
    """The reference (weight before w2) equals moe_experts_loop (weight after w2) in fp32."""
    e, i, d, t, k = 5, 24, 32, 7, 3
    w1, w3, w2 = float_weights(e, i, d, seed=6)
    x = inputs(t, d, seed=7)
    idx, weight = routing("repeated_ids", t, k, e, seed=8)
    ex = M.Bf16Experts(torch.cat((w1, w3), 1).bfloat16(), w2.bfloat16())
    a, b, c = ex.dequantize()
    loop = moe_experts_loop(x.float(), idx, weight, a, b, c, LIMIT)
    assert rel_err(M.moe_grouped_ref(x, idx, weight, ex, LIMIT), loop) < 1e-6


def test_bf16_kernel_matches_model_op():
    t, k, e, d, i = SHAPES["bf16"]
    w1, w3, w2 = float_weights(e, i, d, seed=9)
    ex = M.Bf16Experts.from_float(w1, w3, w2)
    a, b, c = ex.dequantize()
    x = inputs(t, d, seed=10)
    idx, weight = routing("random", t, k, e, seed=11)
    op = torch.ops.dsv4c.moe_experts(x, idx, weight, a.bfloat16(), b.bfloat16(), c.bfloat16(), LIMIT)
    assert rel_err(M.moe_grouped(x, idx, weight, ex, LIMIT), op) < KERNEL_REL_ERR["bf16_vs_model_op"]


def test_mxfp4_converted_to_nvfp4_is_the_same_moe():
    t, k, e, d, i = SHAPES["mxfp4"]
    w1, w3, w2 = float_weights(e, i, d, seed=12)
    w3 = w3 * 8                                                      # w1 and w3 ranges differ
    mx = M.Mxfp4Experts.from_float(w1, w3, w2)
    nv = M.Nvfp4Experts.from_mxfp4(mx)
    assert nv.w13_global.shape == (e,)                               # one global scale per expert for w1+w3
    x = inputs(t, d, seed=13)
    idx, weight = routing("random", t, k, e, seed=14)
    assert torch.equal(M.moe_grouped_ref(x, idx, weight, mx, LIMIT), M.moe_grouped_ref(x, idx, weight, nv, LIMIT))
    y_mx = M.moe_grouped(x, idx, weight, mx, LIMIT)
    y_nv = M.moe_grouped(x, idx, weight, nv, LIMIT)
    assert rel_err(y_nv, y_mx) < KERNEL_REL_ERR["nvfp4"]


def test_route_prep_invariants():
    e, bm = 7, 16
    idx, _ = routing("empty_experts", 45, 3, e, seed=15)
    r = M.route_prep(idx, e, bm)
    n = idx.numel()
    ids, bexp = r.ids.long(), r.block_expert.long()
    assert ids.numel() == r.block_expert.numel() * bm
    valid = ids < n
    assert sorted(ids[valid].tolist()) == list(range(n))             # each assignment once
    row_expert = bexp.repeat_interleave(bm)
    assert torch.equal(row_expert[valid], idx.reshape(-1)[ids[valid]])
    assert torch.equal(r.inv[ids[valid]], valid.nonzero().squeeze(1))
    assert set(bexp.tolist()) == {-1, 1, e - 2}                      # empty experts own no block


# (T, K, E, block_m): Flash's top-6 of 256 at 1 / 64 / 256 tokens, experts not a power of two, more experts than
# assignments, block_m 1 and 64, assignment counts around the kernel's chunk (ROUTE_PREP_CHUNK 64)
ROUTE_SHAPES = [(1, 6, 256, 16), (64, 6, 256, 16), (256, 6, 256, 16), (45, 3, 7, 16), (3, 2, 300, 16),
                (7, 4, 4, 1), (64, 6, 256, 64), (16, 4, 12, 32), (13, 5, 9, 16)]


@pytest.mark.parametrize("case", ["random", "empty_experts", "one_expert_all", "repeated_ids"])
@pytest.mark.parametrize("shape", ROUTE_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_route_prep_fused_equals_the_torch_ops(shape, case):
    """`route_prep_fused` (one Triton program, interpreted here) gives route_prep_ref's ids, M-block experts
    and inverse rows exactly, for int64 and int32 ids."""
    t, k, e, bm = shape
    idx, _ = routing(case, t, k, e, seed=t + e)
    for dt in (torch.int64, torch.int32):
        want = M.route_prep_ref(idx.to(dt), e, bm)
        got = M.route_prep_fused(idx.to(dt), e, bm)
        assert torch.equal(got.ids, want.ids) and got.ids.dtype == torch.int32
        assert torch.equal(got.block_expert, want.block_expert) and got.block_expert.dtype == torch.int32
        assert torch.equal(got.inv, want.inv) and got.inv.dtype == torch.int64
        assert (got.n_assign, got.block_m, got.direct) == (want.n_assign, want.block_m, False)


def test_route_prep_takes_the_kernel_up_to_its_limit(monkeypatch):
    """ROUTE_PREP_KERNEL_MAX_ASSIGN: route_prep launches the kernel up to that many assignments and the torch ops
    above; moe_grouped's output is bit-identical either way."""
    t, k, e, d, i = SHAPES["fp8_block"]
    ex = M.Fp8BlockExperts.from_float(*float_weights(e, i, d))
    x = inputs(t, d)
    idx, weight = routing("random", t, k, e)
    cfg = M.MoeKernelConfig(16, 64, 128, 4, 4)   # sorted routing at this size (not the direct path)
    calls = []
    real = M.route_prep_fused
    monkeypatch.setattr(M, "route_prep_fused", lambda *a: calls.append(a) or real(*a))
    monkeypatch.setattr(M, "ROUTE_PREP_KERNEL_MAX_ASSIGN", 0)
    y0 = M.moe_grouped(x, idx, weight, ex, LIMIT, config=cfg)
    assert calls == []
    monkeypatch.setattr(M, "ROUTE_PREP_KERNEL_MAX_ASSIGN", idx.numel())
    y1 = M.moe_grouped(x, idx, weight, ex, LIMIT, config=cfg)
    assert len(calls) == 1 and torch.equal(y1, y0)
    monkeypatch.setattr(M, "ROUTE_PREP_KERNEL_MAX_ASSIGN", idx.numel() - 1)
    M.route_prep(idx, e, 16)
    assert len(calls) == 1


def test_route_prep_fused_names_bad_arguments():
    idx = torch.zeros(4, 2, dtype=torch.int64)
    with pytest.raises(ValueError, match="idx: expected an integer tensor"):
        M.route_prep_fused(idx.float(), 4, 16)
    with pytest.raises(ValueError, match="idx: expected a contiguous"):
        M.route_prep_fused(torch.zeros(2, 4, dtype=torch.int64).t(), 4, 16)
    with pytest.raises(ValueError, match="block_m: expected a power of two, got 12"):
        M.route_prep_fused(idx, 4, 12)


def test_custom_op_and_fake():
    t, k, e, d, i = SHAPES["nvfp4"]
    ex = M.Nvfp4Experts.from_float(*float_weights(e, i, d, seed=16))
    x = inputs(t, d, seed=17)
    idx, weight = routing("random", t, k, e, seed=18)
    args = (x, idx, weight, ex.format, ex.w13, ex.w13_scale, ex.w13_global, ex.w2, ex.w2_scale, ex.w2_global,
            None, None, LIMIT)
    y = torch.ops.dsv4c.moe_experts_q(*args)
    if x.device.type == "cpu":  # CPU tensors (emulated artifacts): the op computes the reference math
        assert torch.equal(y, M.moe_grouped_ref(x, idx, weight, ex, LIMIT).to(x.dtype))
    else:
        assert torch.equal(y, M.moe_grouped(x, idx, weight, ex, LIMIT))
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode(allow_non_fake_inputs=True):
        fake = torch.ops.dsv4c.moe_experts_q(*args)
    assert fake.shape == (t, d) and fake.dtype == torch.bfloat16


def test_errors_name_the_input():
    t, k, e, d, i = SHAPES["bf16"]
    ex = M.Bf16Experts.from_float(*float_weights(e, i, d))
    x = inputs(t, d)
    idx, weight = routing("random", t, k, e)
    with pytest.raises(ValueError, match="idx: expert ids must be in"):
        M.moe_grouped(x, idx + e, weight, ex, LIMIT)
    with pytest.raises(ValueError, match="weight: expected fp32"):
        M.moe_grouped(x, idx, weight.double(), ex, LIMIT)
    with pytest.raises(ValueError, match="x: expected bf16"):
        M.moe_grouped(x.float(), idx, weight, ex, LIMIT)
    with pytest.raises(ValueError, match="fp8_block.w13: I = 96"):
        M.Fp8BlockExperts.from_float(*float_weights(e, i, d))
    with pytest.raises(ValueError, match="nvfp4.w13_global"):
        nv = M.Nvfp4Experts.from_float(*float_weights(e, i, d))
        M.Nvfp4Experts(nv.w13, nv.w13_scale, torch.ones(1), nv.w2, nv.w2_scale, nv.w2_global)


# ---------------------------------------------------------------------------------------------
# decode variants: fp4_split (nibble decode by bit placement, even/odd half-K dots), split_k (w2)


@triton.jit
def _decode_e2m1_f16(p_ptr, lo_ptr, hi_ptr):
    r = tl.arange(0, 256)
    p = tl.load(p_ptr + r).to(tl.int32)
    tl.store(lo_ptr + r, U.e2m1_lo_f16(p).to(tl.float32))
    tl.store(hi_ptr + r, U.e2m1_hi_f16(p).to(tl.float32))


def test_e2m1_f16_decode_every_byte():
    """U.e2m1_lo_f16 / e2m1_hi_f16 give fp4(code) * 2^-14 exactly for all 256 packed bytes."""
    p = torch.arange(256, dtype=torch.uint8)
    lo, hi = torch.empty(256), torch.empty(256)
    _decode_e2m1_f16[(1,)](p, lo, hi)
    mags = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6])
    codes = torch.arange(256)
    want_lo = mags[codes & 7] * torch.where(codes & 8 > 0, -1.0, 1.0)
    want_hi = mags[(codes >> 4) & 7] * torch.where(codes & 128 > 0, -1.0, 1.0)
    assert torch.equal(lo * 2.0 ** 14, want_lo) and torch.equal(hi * 2.0 ** 14, want_hi)
    assert torch.signbit(lo[8]) and torch.signbit(hi[128])         # code 8 is -0


DECODE_CFGS = {
    "split": M.MoeKernelConfig(16, 32, 64, fp4_split=True),                 # D=160, I=96: K tails at 64
    "split_sk2": M.MoeKernelConfig(16, 64, 64, fp4_split=True, split_k=2),  # w2 K=96 -> chunks 64 + 32
    "split_k3": M.MoeKernelConfig(16, 64, 32, split_k=3),                   # legacy dot, 3 K chunks
}


@pytest.mark.parametrize("case", ["random", "empty_experts", "one_expert_all"])
@pytest.mark.parametrize("variant", list(DECODE_CFGS))
@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
def test_fp4_decode_variants_match_ref(fmt, variant, case):
    t, k, e, d, i = SHAPES[fmt]
    if case == "one_expert_all":
        t = 37
    cfg = DECODE_CFGS[variant]
    if fmt == "mxfp4" and cfg.fp4_split and cfg.block_k < 64:
        pytest.skip("mxfp4 split needs block_k >= 64")
    experts = FORMATS[fmt].from_float(*float_weights(e, i, d, seed=20))
    x = inputs(t, d, seed=21)
    idx, weight = routing(case, t, k, e, seed=22)
    y = M.moe_grouped(x, idx, weight, experts, LIMIT, cfg)
    assert y.dtype == torch.bfloat16 and y.shape == (t, d)
    assert rel_err(y, M.moe_grouped_ref(x, idx, weight, experts, LIMIT)) < KERNEL_REL_ERR[fmt]


def _direct_cfg(fmt: str, **kw) -> M.MoeKernelConfig:
    return M.MoeKernelConfig(16, 64, 128 if fmt == "fp8_block" else 64, direct=True, **kw)


# every routing case on bf16 and fp8_block; the FP4 formats (the interpreter's slowest) share direct's routing and
# masking, so they take two cases: a random one and every slot on one expert
DIRECT_CASES = [(f, c) for f in FORMATS for c in ("random", "empty_experts", "one_expert_all", "repeated_ids")
                if f in ("bf16", "fp8_block") or c in ("random", "one_expert_all")]


@pytest.mark.parametrize("fmt,case", DIRECT_CASES)
def test_direct_routing_matches_ref(fmt, case):
    """direct: one M-block per assignment, no sort; repeated ids and one expert taking every
    slot must still add up, and the masked rows 1..15 of each block must not be stored. one_expert_all keeps
    T = 9: direct gives each of the 18 assignments its own M-block, so one expert already spans many blocks
    (T = 37, as in test_moe_grouped_matches_ref whose sorted path packs 16 rows a block, only made 74)."""
    t, k, e, d, i = SHAPES[fmt]
    experts = FORMATS[fmt].from_float(*float_weights(e, i, d, seed=26))
    x = inputs(t, d, seed=27)
    idx, weight = routing(case, t, k, e, seed=28)
    y = M.moe_grouped(x, idx, weight, experts, LIMIT, _direct_cfg(fmt))
    assert y.shape == (t, d) and y.dtype == torch.bfloat16
    assert rel_err(y, M.moe_grouped_ref(x, idx, weight, experts, LIMIT)) < KERNEL_REL_ERR[fmt]


def test_direct_routing_launches_no_routing_ops():
    """route_direct is views only (the point of the direct path at decode)."""
    idx = torch.randint(0, 6, (3, 2))
    r = M.route_direct(idx, 16)
    assert r.direct and r.rows == 6 and r.inv is None
    assert r.block_expert.data_ptr() == idx.data_ptr()


@pytest.mark.parametrize("direct", [False, True])
def test_fp4_scaled_config_matches_ref(direct):
    """fp4_scaled (tl.dot_scaled on GPU; under the interpreter, which has no dot_scaled, the
    same kernel's dequantised-tile path) through both routings."""
    t, k, e, d, i = SHAPES["mxfp4"]
    experts = M.Mxfp4Experts.from_float(*float_weights(e, i, d, seed=29))
    x = inputs(t, d, seed=30)
    idx, weight = routing("random", t, k, e, seed=31)
    cfg = M.MoeKernelConfig(16, 32, 64, fp4_scaled=True, direct=direct)
    y = M.moe_grouped(x, idx, weight, experts, LIMIT, cfg)
    assert rel_err(y, M.moe_grouped_ref(x, idx, weight, experts, LIMIT)) < KERNEL_REL_ERR["mxfp4"]
    with pytest.raises(ValueError, match="fp4_split and fp4_scaled"):
        M.moe_grouped(x, idx, weight, experts, LIMIT, M.MoeKernelConfig(16, 32, 64, fp4_split=True, fp4_scaled=True))


@pytest.mark.parametrize("fmt", ["bf16", "fp8_block"])
def test_split_k_other_formats_match_ref(fmt):
    t, k, e, d, i = SHAPES[fmt]
    experts = FORMATS[fmt].from_float(*float_weights(e, i, d, seed=23))
    x = inputs(t, d, seed=24)
    idx, weight = routing("empty_experts", t, k, e, seed=25)
    cfg = M.MoeKernelConfig(16, 64, 128 if fmt == "fp8_block" else 32, split_k=2)
    y = M.moe_grouped(x, idx, weight, experts, LIMIT, cfg)
    assert rel_err(y, M.moe_grouped_ref(x, idx, weight, experts, LIMIT)) < KERNEL_REL_ERR[fmt]


def test_fp4_split_config_checked():
    t, k, e, d, i = SHAPES["mxfp4"]
    ex = M.Mxfp4Experts.from_float(*float_weights(e, i, d))
    x = inputs(t, d)
    idx, weight = routing("random", t, k, e)
    with pytest.raises(ValueError, match="config.block_k: fp4_split with mxfp4 needs >= 64"):
        M.moe_grouped(x, idx, weight, ex, LIMIT, M.MoeKernelConfig(16, 32, 32, fp4_split=True))
    with pytest.raises(ValueError, match="config.split_k"):
        M.moe_grouped(x, idx, weight, ex, LIMIT, M.MoeKernelConfig(split_k=0))


# ---------------------------------------------------------------------------------------------
# GPU


GPU_SHAPE = (200, 6, 32, 512, 384)   # T, K, E, D, I


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["bf16", "fp8_block", "mxfp4", "nvfp4"])
@pytest.mark.parametrize("t", [3, 200])
def test_gpu_moe_grouped_matches_ref(fmt, t):
    _, k, e, d, i = GPU_SHAPE
    ex = FORMATS[fmt].from_float(*float_weights(e, i, d, device="cuda"))
    x = inputs(t, d, device="cuda")
    idx, weight = (v.cuda() for v in routing("random", t, k, e))
    y = M.moe_grouped(x, idx, weight, ex, LIMIT)
    assert rel_err(y, M.moe_grouped_ref(x, idx, weight, ex, LIMIT)) < KERNEL_REL_ERR[fmt]


GPU_VARIANTS = {
    "direct": lambda fmt: M.MoeKernelConfig(16, 64, 128, 4, 4, direct=True),
    "direct_split": lambda fmt: M.MoeKernelConfig(16, 32, 256, 4, 4, fp4_split=True, direct=True),
    "scaled": lambda fmt: M.MoeKernelConfig(16, 64, 128, 4, 4, fp4_scaled=True),
    "scaled_direct": lambda fmt: M.MoeKernelConfig(16, 64, 256, 4, 4, fp4_scaled=True, direct=True),
}


@pytest.mark.gpu
@pytest.mark.parametrize("variant", list(GPU_VARIANTS))
@pytest.mark.parametrize("fmt", ["bf16", "fp8_block", "mxfp4", "nvfp4"])
@pytest.mark.parametrize("t", [1, 8, 64])
def test_gpu_decode_variants_match_ref(fmt, variant, t):
    """The decode variants on the GPU, where fp4_scaled really runs tl.dot_scaled."""
    if variant.startswith("scaled") and fmt != "mxfp4" or variant == "direct_split" and fmt not in ("mxfp4", "nvfp4"):
        pytest.skip("variant does not apply to this format")
    _, k, e, d, i = GPU_SHAPE
    ex = FORMATS[fmt].from_float(*float_weights(e, i, d, device="cuda"))
    x = inputs(t, d, device="cuda")
    idx, weight = (v.cuda() for v in routing("random", t, k, e))
    y = M.moe_grouped(x, idx, weight, ex, LIMIT, GPU_VARIANTS[variant](fmt))
    assert rel_err(y, M.moe_grouped_ref(x, idx, weight, ex, LIMIT)) < KERNEL_REL_ERR[fmt]


@pytest.mark.gpu
@pytest.mark.parametrize("use_dot_scaled", [False, True])
def test_gpu_w4a4_paths(use_dot_scaled):
    """W4A4: below sm_100 the public wrapper refuses and the kernel's emulation path is checked
    against the reference; tl.dot_scaled itself only on sm_100+ (Triton 3.6's Hopper lowering of
    dot_scaled with e4m3 scales aborted in TritonGPUAccelerateMatmul on the H200)."""
    if use_dot_scaled and torch.cuda.get_device_capability() < (10, 0):
        pytest.skip("tl.dot_scaled NVFP4 needs capability 10.0")
    t, k, e, d, i = GPU_SHAPE
    ex = M.Nvfp4W4A4Experts.from_float(*float_weights(e, i, d, device="cuda"))
    x = inputs(t, d, device="cuda")
    idx, weight = (v.cuda() for v in routing("random", t, k, e))
    if torch.cuda.get_device_capability() < (10, 0):
        with pytest.raises(ValueError, match="capability >= 10.0"):
            M.moe_grouped(x, idx, weight, ex, LIMIT)
    cfg = M.default_config(ex.format, idx.numel(), e, x.device)
    y = M._moe_grouped_impl(x, idx, weight, ex, LIMIT, cfg, use_dot_scaled)
    assert rel_err(y, M.moe_grouped_ref(x, idx, weight, ex, LIMIT)) < KERNEL_REL_ERR["nvfp4_w4a4"]


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["fp8_block", "mxfp4"])
def test_gpu_cuda_graph_capture(fmt):
    t, k, e, d, i = 8, 6, 32, 512, 384
    ex = FORMATS[fmt].from_float(*float_weights(e, i, d, device="cuda"))
    x = inputs(t, d, device="cuda")
    idx, weight = (v.cuda() for v in routing("random", t, k, e))
    M.moe_grouped(x, idx, weight, ex, LIMIT)                        # compile before capture
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        M.moe_grouped(x, idx, weight, ex, LIMIT)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = M.moe_grouped(x, idx, weight, ex, LIMIT)
    idx2, w2 = (v.cuda() for v in routing("one_expert_all", t, k, e, seed=9))
    x.copy_(inputs(t, d, seed=5, device="cuda"))
    idx.copy_(idx2)
    weight.copy_(w2)
    graph.replay()
    torch.cuda.synchronize()
    assert rel_err(out, M.moe_grouped(x, idx, weight, ex, LIMIT)) < 1e-6


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 8, 64, 256])
def test_gpu_route_prep_fused_equals_the_torch_ops_and_replays(t):
    """On the device at Flash's top-6 of 256: the kernel's tensors equal route_prep_ref's, also from a captured
    CUDA graph replayed with new ids (the case of a decode step)."""
    e, k, bm = 256, 6, 16
    idx = routing("random", t, k, e, seed=t)[0].cuda()
    for dt in (torch.int64, torch.int32):
        want, got = M.route_prep_ref(idx.to(dt), e, bm), M.route_prep_fused(idx.to(dt), e, bm)
        assert torch.equal(got.ids, want.ids) and torch.equal(got.block_expert, want.block_expert)
        assert torch.equal(got.inv, want.inv)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        M.route_prep_fused(idx, e, bm)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = M.route_prep_fused(idx, e, bm)
    for case in ("one_expert_all", "empty_experts", "repeated_ids"):
        idx.copy_(routing(case, t, k, e, seed=3)[0].cuda())
        graph.replay()
        torch.cuda.synchronize()
        want = M.route_prep_ref(idx, e, bm)
        assert torch.equal(out.ids, want.ids) and torch.equal(out.block_expert, want.block_expert), case
        assert torch.equal(out.inv, want.inv), case


@pytest.mark.gpu
def test_gpu_moe_grouped_with_the_route_prep_kernel_is_bit_identical(monkeypatch):
    t, k, e, d, i = 64, 6, 32, 512, 384
    ex = M.Fp8BlockExperts.from_float(*float_weights(e, i, d, device="cuda"))
    x = inputs(t, d, device="cuda")
    idx, weight = (v.cuda() for v in routing("random", t, k, e))
    calls = []
    real = M.route_prep_fused
    monkeypatch.setattr(M, "route_prep_fused", lambda *a: calls.append(a) or real(*a))
    monkeypatch.setattr(M, "ROUTE_PREP_KERNEL_MAX_ASSIGN", 0)
    y0 = M.moe_grouped(x, idx, weight, ex, LIMIT)
    monkeypatch.setattr(M, "ROUTE_PREP_KERNEL_MAX_ASSIGN", 4096)
    assert torch.equal(M.moe_grouped(x, idx, weight, ex, LIMIT), y0) and len(calls) == 1
