"""The SwiGLU activation kernel (kernels/swiglu.py), its custom op, the fuse_swiglu pass, and the shared
expert's w1 ‖ w3 GEMM of fuse_projections."""
from __future__ import annotations

import dataclasses

import pytest
import torch
import triton
import triton.language as tl

from dsv4c.kernels import _tl as U
from dsv4c.kernels.swiglu import swiglu_act, swiglu_act_ref
from dsv4c.kernels.tolerances import rel_err
from dsv4c.model import register_ops
from dsv4c.passes import PassContext, verify
from dsv4c.passes.fuse_projections import fuse_projections
from dsv4c.passes.fuse_swiglu import fuse_swiglu
from dsv4c.passes.split_at_routers import OP_CAPTURE, host_sync_ops, reference_impl
from fusion_cases import assert_in_capturable_segments, pipeline_pair, swap_targets
from fusion_cases import (assert_same as _assert_same, exported as _exported, inputs as _inputs, model as _model,
                           run as _run)

register_ops()

OP = torch.ops.dsv4c.swiglu_act.default
aten = torch.ops.aten
# Kernel vs the model's function, rel_err (fp64). fp32: exp written out + IEEE division, a few ulp
# (measured <= 1.4e-8 under the interpreter); bf16: torch's rounding steps (measured: bit-equal).
F32_REL, BF16_REL = 1e-6, 1e-2
GRAPH_REL = 1e-6  # fp32 graphs, Triton kernel (interpreter) for the op, max-abs relative (measured 2.5e-7)
BF16_ULP = 2.0 ** -7  # one bf16 ulp, relative to the value's binade


def _halves(shape, seed, dtype, scale=4.0, beyond=0.0):
    """g, u: the two halves of one [..., 2I] tensor (row stride 2I), as the fused GEMM's split gives them;
    with `beyond` > 0 each row's first g and u are ±1.5·beyond (outside a clamp at `beyond`)."""
    gen = torch.Generator().manual_seed(seed)
    *lead, I = shape
    y = scale * torch.randn(*lead, 2 * I, generator=gen)
    if beyond > 0:
        y[..., 0], y[..., I] = 1.5 * beyond, -1.5 * beyond
    y = y.to(dtype)
    return y[..., :I], y[..., I:]


def _bf16_report(got: torch.Tensor, want: torch.Tensor) -> tuple[float, float]:
    """(fraction of bit-equal elements, largest difference in bf16 ulps of the reference's binade)."""
    eq = (got == want) | (got.isnan() & want.isnan())
    ulp = torch.ldexp(torch.ones_like(want.float()), torch.frexp(want.float()).exponent - 8).clamp_min(2.0 ** -133)
    diff = ((got.float() - want.float()).abs() / ulp).nan_to_num(0.0)
    return eq.float().mean().item(), diff.max().item()


# ---- the kernel (Triton interpreter on CPU) ----------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("limit", [0.0, 0.3, 10.0])
@pytest.mark.parametrize("shape", [(1, 1), (5, 37), (3, 1100), (2, 3, 96), (64,)])
def test_kernel_matches_the_model_function(dtype, limit, shape):
    """Halves of a fused output (row stride 2I) and contiguous tensors; I not a block multiple, I > one
    block (1100), 1-d and 3-d; values on both sides of the limit."""
    g, u = _halves(shape, seed=sum(shape) + int(10 * limit), dtype=dtype, scale=4.0 + limit, beyond=limit)
    assert not g.is_contiguous() or g.dim() == 1 or shape[-1] == 1  # a 1-d half is contiguous
    want = swiglu_act_ref(g, u, limit)
    for gg, uu in ((g, u), (g.contiguous(), u.contiguous())):
        got = swiglu_act(gg, uu, limit)
        assert got.dtype == dtype and got.shape == g.shape and got.is_contiguous()
        if dtype == torch.float32:
            assert rel_err(got, want) <= F32_REL
        else:
            frac, ulps = _bf16_report(got, want)
            assert rel_err(got, want) <= BF16_REL and ulps <= 1.0, (frac, ulps)
    if limit > 0:
        assert ((g > limit) | (u.abs() > limit)).any()  # the clamp is exercised ...
        assert not torch.equal(want, swiglu_act_ref(g, u, 0.0))  # ... and changes the result


def test_bf16_bit_equality_on_many_values():
    """bf16 with PyTorch's rounding steps: the fraction of elements equal bit for bit to the model's
    result, on 2^17 values across the interesting range (|g| up to ~24, the clamp at 10)."""
    g, u = _halves((64, 2048), seed=11, dtype=torch.bfloat16, scale=6.0)
    for limit in (0.0, 10.0):
        got, want = swiglu_act(g, u, limit), swiglu_act_ref(g, u, limit)
        frac, ulps = _bf16_report(got, want)
        print(f"bf16 limit {limit}: bit-equal {frac:.6f}, max {ulps} ulp, rel_err {rel_err(got, want):.2e}")
        assert frac >= 0.999 and ulps <= 1.0 and rel_err(got, want) <= BF16_REL


@triton.jit
def _exp_kernel(x_ptr, out_ptr, N, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = i < N
    tl.store(out_ptr + i, U.exp_f32(tl.load(x_ptr + i, mask=m, other=0.0)), mask=m)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy under the interpreter: overflow to inf is the point
def test_exp_is_accurate_over_the_fp32_range():
    """The written-out exp vs fp64, in ulps of the correctly rounded result (normal range), and its
    overflow and underflow ends."""
    x = torch.cat([torch.linspace(-87, 88.5, 40001), torch.linspace(-1, 1, 2001), torch.tensor([0.0, -0.0, 1e-30])])
    out = torch.empty_like(x)
    _exp_kernel[(triton.cdiv(x.numel(), 1024),)](x, out, x.numel(), BLOCK=1024)
    ref = x.double().exp()
    r = ref.float()
    ulp = (torch.nextafter(r, torch.tensor(float("inf"))) - r).double()
    assert ((out.double() - ref).abs() / ulp).max() <= 4
    ends = torch.tensor([89.0, 100.0, float("inf"), -104.0, -120.0, float("-inf")])
    e_out = torch.empty_like(ends)
    _exp_kernel[(1,)](ends, e_out, 6, BLOCK=8)
    assert torch.isinf(e_out[:3]).all() and (e_out[3:] >= 0).all() and (e_out[3:] < 1e-44).all()


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_special_values_follow_torch(dtype):
    """Large |g| (exp overflows: silu -> -0 or g), infinities, NaN (clamp passes NaN on), zeros."""
    vals = torch.tensor([-200.0, -90.0, -88.0, 88.0, 200.0, 1e30, float("inf"), float("-inf"), float("nan"), 0.0, -0.0,
                         3.0, -3.0, 1e-30])
    g = vals.repeat(len(vals)).to(dtype)
    u = vals.repeat_interleave(len(vals)).to(dtype)
    for limit in (0.0, 10.0):
        got, want = swiglu_act(g, u, limit), swiglu_act_ref(g, u, limit)
        same = (got == want) | (got.isnan() & want.isnan())
        assert same.all(), (limit, g[~same], u[~same], got[~same], want[~same])


def test_no_rows_launch_nothing():
    g = torch.zeros(0, 64)
    assert swiglu_act(g, g, 1.0).shape == (0, 64)


@pytest.mark.parametrize("call,err", [
    (lambda: swiglu_act(torch.zeros(2, 8, dtype=torch.float16), torch.zeros(2, 8, dtype=torch.float16), 1.0),
     "g must be float32 or bfloat16"),
    (lambda: swiglu_act(torch.zeros(2, 8), torch.zeros(2, 8, dtype=torch.float64), 1.0), "u must be float32 or bfloat16"),
    (lambda: swiglu_act(torch.zeros(2, 8), torch.zeros(2, 8, dtype=torch.bfloat16), 1.0), "one dtype"),
    (lambda: swiglu_act(torch.zeros(2, 8), torch.zeros(2, 7), 1.0), r"one shape, got g \[2, 8\] and u \[2, 7\]"),
    (lambda: swiglu_act(torch.zeros(()), torch.zeros(()), 1.0), "g must be"),
    (lambda: swiglu_act(torch.zeros(2, 16)[:, ::2], torch.zeros(2, 8), 1.0), "g must have unit stride"),
    (lambda: swiglu_act(torch.zeros(2, 8), torch.zeros(8, 2).t(), 1.0), "u must have unit stride"),
    (lambda: swiglu_act(torch.zeros(3, 2, 8).transpose(0, 1), torch.zeros(2, 3, 8), 1.0),
     "g's leading dims do not collapse"),
    (lambda: swiglu_act(torch.zeros(2, 8), torch.zeros(2, 8), float("nan")), "limit is NaN"),
    (lambda: torch.ops.dsv4c.swiglu_act(torch.zeros(2, 8), torch.zeros(2, 7), 1.0), "one shape"),
])
def test_bad_input_is_rejected_naming_the_tensor(call, err):
    with pytest.raises(ValueError, match=err):
        call()


# ---- the custom op -------------------------------------------------------------------------------
def test_op_is_the_model_function_on_cpu_fake_and_capture_safe():
    g, u = _halves((5, 40), seed=3, dtype=torch.bfloat16)
    assert torch.equal(torch.ops.dsv4c.swiglu_act(g, u, 0.3), swiglu_act_ref(g, u, 0.3))
    assert str(OP._schema) == "dsv4c::swiglu_act(Tensor g, Tensor u, float limit) -> Tensor"
    with torch._subclasses.FakeTensorMode() as mode:
        f = torch.ops.dsv4c.swiglu_act(mode.from_tensor(g), mode.from_tensor(u), 0.3)
    assert (f.shape, f.dtype, f.is_contiguous()) == ((5, 40), torch.bfloat16, True)
    assert OP_CAPTURE["dsv4c.swiglu_act"] is None
    assert host_sync_ops(reference_impl("dsv4c.swiglu_act"), g, u, 0.3) == []


# ---- fuse_projections: the shared expert's w1 ‖ w3 -------------------------------------------------
def _shared_groups(stats) -> list[dict]:
    return [g for g in stats["groups"] if g["fused"].endswith("ffn.shared_experts.fused_w1__w3.weight")]


def _n_moe(name, kind) -> int:
    return 1 if kind == "mtp" else _model(name).config.num_hidden_layers


@pytest.mark.parametrize("kind,dtype", [("decode", torch.float32), ("mtp", torch.float32), ("prefill", torch.bfloat16)])
def test_projections_stack_the_shared_expert_w1_w3(kind, dtype):
    """One group [w1; w3] per shared expert, on the MoE input, outputs unchanged (bit for bit on the CPU);
    the router's logits GEMM (fp32, on the same u in an fp32 model) is not in it."""
    cfg = _model("v4", dtype).config
    ctx = PassContext(cfg, "cpu", graph_kind=kind)
    ref = _exported("v4", kind, dtype)
    res = fuse_projections(_exported("v4", kind, dtype), ctx)
    gm = res.graph
    gm.recompile()
    verify(gm, ctx, after="fuse_projections")
    shared = _shared_groups(res.stats)
    assert len(shared) == _n_moe("v4", kind)
    I = cfg.moe_intermediate_size
    for g in shared:
        assert g["members"] == [g["fused"].replace("fused_w1__w3", w) for w in ("w1", "w3")]
        assert g["out_features"] == [I, I] and g["dtype"] == g["stored"] == str(dtype).replace("torch.", "")
    assert sum(n.target is aten.matmul.default for n in gm.graph.nodes) == _n_moe("v4", kind)  # w2 only
    args = _inputs("v4", kind, dtype)
    _assert_same(_run(gm, args), _run(ref, args))


# ---- the pass ------------------------------------------------------------------------------------
def _count(gm, op) -> int:
    return sum(nd.target is op for nd in gm.graph.nodes)


def _fused(name, kind, dtype, projections=True):
    ctx = PassContext(_model(name, dtype).config, "cpu", graph_kind=kind)
    gm = _exported(name, kind, dtype)
    if projections:
        gm = fuse_projections(gm, ctx).graph
        gm.recompile()
    res = fuse_swiglu(gm, ctx)
    verify(res.graph, ctx, after="fuse_swiglu")
    return res, ctx


@pytest.mark.parametrize("kind,dtype", [
    ("decode", torch.float32),
    ("verify", torch.float32),
    ("mtp", torch.float32),
    ("prefill", torch.bfloat16),
    ("decode", torch.bfloat16),
])
def test_pass_fuses_every_shared_expert_bit_exact(kind, dtype):
    """After fuse_projections: every shared expert is linear([w1; w3]) -> split -> swiglu_act -> w2 GEMM,
    no clamp/silu left, and on the CPU (the op is the model's function) the outputs are bit-exact."""
    res, ctx = _fused("v4", kind, dtype)
    gm = res.graph
    n = _n_moe("v4", kind)
    assert res.changed and res.stats == {"sites": n, "limit": ctx.config.swiglu_limit} and ctx.config.swiglu_limit > 0
    assert _count(gm, OP) == n
    for op in (aten.silu.default, aten.clamp.default, aten.mul.Tensor):
        assert not any(u.target is op for nd in gm.graph.nodes if nd.target is OP for u in nd.users)
    assert _count(gm, aten.silu.default) == 0 and _count(gm, aten.clamp.default) == 0
    for nd in (nd for nd in gm.graph.nodes if nd.target is OP):
        g, u, limit = nd.args
        assert limit == ctx.config.swiglu_limit and (g.args[1], u.args[1]) == (0, 1) and g.args[0] is u.args[0]
        split = g.args[0]
        assert split.target is aten.split_with_sizes.default and split.args[0].target is aten.linear.default
        w = split.args[0].args[1]
        assert w.op == "get_attr" and w.target.endswith("shared_experts.fused_w1__w3.weight")
        assert g.meta["val"].stride(0) == 2 * g.meta["val"].shape[-1]  # the kernel reads the halves in place
        (down,) = nd.users
        assert down.target is aten.matmul.default
    args = _inputs("v4", kind, dtype)
    _assert_same(_run(gm, args), _run(_exported("v4", kind, dtype), args))
    again = fuse_swiglu(gm, ctx)
    assert not again.changed and again.stats["sites"] == 0


def test_pass_alone_and_on_v3_graphs():
    """Without fuse_projections (two GEMMs, contiguous g and u) and on V3/V3.2 (limit 0: dense MLPs and
    shared experts, one per layer): every site fused, bit-exact."""
    for name, kind, dtype in (("v4", "decode", torch.float32), ("v3-tiny", "decode", torch.float32),
                              ("v3-tiny", "prefill", torch.float32), ("v32-tiny", "decode", torch.bfloat16)):
        res, ctx = _fused(name, kind, dtype, projections=False)
        n = ctx.config.num_hidden_layers
        assert res.stats["sites"] == n == _count(res.graph, OP), (name, kind)
        assert _count(res.graph, aten.silu.default) == 0
        if not ctx.config.is_v4:
            assert ctx.config.swiglu_limit == 0 and _count(res.graph, aten.clamp.default) == 0
        args = _inputs(name, kind, dtype)
        _assert_same(_run(res.graph, args), _run(_exported(name, kind, dtype), args))


def test_other_limit_is_left_alone():
    cfg = _model("v4").config
    gm = _exported("v4", "mtp")
    before = gm.code
    res = fuse_swiglu(gm, PassContext(dataclasses.replace(cfg, swiglu_limit=7.0), "cpu", graph_kind="mtp"))
    assert not res.changed and res.stats["sites"] == 0 and res.graph.code == before


@pytest.mark.parametrize("kind", ["decode", "verify"])
def test_fused_graph_with_the_triton_kernel_matches(kind):
    """The op's nodes replaced by the Triton kernel (interpreter), reading the split halves in place."""
    res, _ = _fused("v4", kind, torch.float32)
    gm = res.graph
    assert swap_targets(gm, {OP: swiglu_act}) == _n_moe("v4", kind)
    args = _inputs("v4", kind)
    _assert_same(_run(gm, args), _run(_exported("v4", kind), args), rel=GRAPH_REL)


def test_in_the_pipeline_sites_sit_in_capturable_segments():
    """fuse_swiglu runs in default_pipeline right after fuse_router: the outputs equal the pipeline without
    it, and on h200 the fused activations sit in capturable static segments."""
    ctx, gm, recs, _ = pipeline_pair("fuse_swiglu")
    names = [r.name for r in recs]
    assert names.index("fuse_swiglu") == names.index("fuse_router") + 1
    n = _n_moe("v4", "decode")
    assert next(r for r in recs if r.name == "fuse_swiglu").stats["sites"] == n
    assert len(_shared_groups(next(r for r in recs if r.name == "fuse_projections").stats)) == n
    assert_in_capturable_segments(gm, ctx, (OP,), n)


# ---- CUDA (the device) ------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 8, 64])
@pytest.mark.parametrize("limit", [0.0, 10.0])
def test_kernel_on_cuda_flash_shapes(T, limit):
    """V4-Flash's shared expert: I = 2048, bf16, g and u the halves of the [T, 4096] GEMM output; against
    the model's function on CUDA (torch's rounding steps: at most one bf16 ulp, nearly all bit-equal)."""
    gen = torch.Generator().manual_seed(T)
    y = (6 * torch.randn(T, 4096, generator=gen)).to(torch.bfloat16).cuda()
    g, u = y[:, :2048], y[:, 2048:]
    got = torch.ops.dsv4c.swiglu_act(g, u, limit)
    want = swiglu_act_ref(g, u, limit)
    frac, ulps = _bf16_report(got.cpu(), want.cpu())
    print(f"cuda T={T} limit={limit}: bit-equal {frac:.6f}, max {ulps} ulp")
    assert rel_err(got, want) <= BF16_REL and ulps <= 1.0 and frac >= 0.999
    gf, uf = g.float(), u.float()
    assert rel_err(swiglu_act(gf, uf, limit), swiglu_act_ref(gf, uf, limit)) <= F32_REL


@pytest.mark.gpu
def test_op_captures_in_a_cuda_graph():
    y = torch.randn(8, 4096, device="cuda", dtype=torch.bfloat16)
    g, u = y[:, :2048], y[:, 2048:]
    torch.ops.dsv4c.swiglu_act(g, u, 10.0)  # compile before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = torch.ops.dsv4c.swiglu_act(g, u, 10.0)
    y.copy_(12 * torch.randn_like(y))
    graph.replay()
    torch.cuda.synchronize()
    frac, ulps = _bf16_report(out.cpu(), swiglu_act_ref(g, u, 10.0).cpu())
    assert ulps <= 1.0 and frac >= 0.999
