"""The RMSNorm kernel (kernels/norm.py), its custom op and the fuse_rmsnorm pass (V4 and V3)."""
from __future__ import annotations

import dataclasses

import pytest
import torch

import dsv4c.kernels.norm as norm_mod
from dsv4c.kernels.norm import (EXACT_ROWS_MIN, ORDER_ROWS, ReduceLayout, reduce_layout, rms_norm, rms_norm_ref,
                                 torch_cuda_row_sum)
from dsv4c.model import register_ops
from dsv4c.model.common import RMSNorm
from dsv4c.passes import PassContext, run_pipeline, verify
from dsv4c.passes.fuse_rmsnorm import fuse_rmsnorm
from dsv4c.passes.split_at_routers import OP_CAPTURE, host_sync_ops, plan_segments, reference_impl
from fusion_cases import (MAX_LEN, N_SLOTS, assert_same as _assert_same, exported as _exported, inputs as _inputs,
                           model as _model, rel as _rel, run as _run)

register_ops()

# Kernel vs an fp64 reference, relative norm ||k - r|| / ||r||, by the output's dtype. fp32: the sum
# of squares in another order and rsqrt rounding (measured <= 1.2e-7). Low precision: one rounding of
# the output (V3 order: two), which the Triton interpreter truncates (< 1 ulp: 2^-7 bf16, 2^-10 fp16);
# on CUDA (round to nearest) half of that.
KERNEL_REL = {torch.float32: 1e-6, torch.bfloat16: 1.2e-2, torch.float16: 2e-3}
# Graphs with the Triton kernel (interpreter) in place of each rms_norm node, fp32 model: max |err| /
# max |out| over logits and cache writes.
GRAPH_REL = 2e-6
EPS = 1e-6


def _norm64(x, w, eps, cast_first):
    xd = x.double()
    r = xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + eps)
    if cast_first:  # the model rounds r to x's dtype before the multiply
        r = r.to(x.dtype).double()
    return w.double() * r


# ---- the kernel (Triton interpreter on CPU) ---------------------------------------------------------
@pytest.mark.parametrize("shape,x_dt,w_dt,cast_first", [
    ((1, 64), torch.float32, torch.float32, False),
    ((3, 1, 100), torch.float32, torch.float32, False),     # non-power-of-two C, [B, T, C]
    ((2, 3, 4, 48), torch.float32, torch.float32, False),   # the MTP hnorm's [B, T, N, D]
    ((5, 1), torch.float32, torch.float32, False),          # C = 1
    ((4, 4096), torch.float32, torch.float32, False),       # Flash hidden
    ((2, 1, 96), torch.bfloat16, torch.bfloat16, False),
    ((2, 1, 96), torch.float16, torch.float16, False),
    ((3, 2, 72), torch.bfloat16, torch.bfloat16, True),     # V3 order
    ((3, 2, 72), torch.float32, torch.float32, True),
    ((2, 40), torch.bfloat16, torch.float32, True),         # V3 order, fp32 weight: fp32 output
    ((0, 1, 64), torch.float32, torch.float32, False),      # no rows: no launch
])
@pytest.mark.parametrize("exact", [False, True])  # the fast (decode) and the exact-order (prefill) kernel
def test_kernel_matches_fp64(shape, x_dt, w_dt, cast_first, exact):
    g = torch.Generator().manual_seed(shape[-1] + len(shape))
    x = (3 * torch.randn(shape, generator=g)).to(x_dt)
    w = (1 + 0.2 * torch.randn(shape[-1], generator=g)).to(w_dt)
    got = rms_norm(x, w, EPS, cast_first, exact=exact)
    want = _norm64(x, w, EPS, cast_first)
    ref = rms_norm_ref(x, w, EPS, cast_first)
    assert got.shape == x.shape and got.dtype == ref.dtype
    tol = max(KERNEL_REL[got.dtype], KERNEL_REL[x_dt] if cast_first else 0.0)  # V3 order rounds r to x's dtype
    assert _rel(got, want) <= tol
    assert _rel(ref, want) <= tol  # the threshold holds for the model's own math too
    if got.numel():  # the weight matters (a kernel ignoring it fails here)
        assert _rel(got, _norm64(x, torch.ones_like(w), EPS, cast_first)) > 0.05


@pytest.mark.parametrize("rows,C,want", [
    # (lanes, warps splitting a row, steps, float4 loads), derived by hand from Reduce.cuh's setReduceConfig
    (512, 4096, (32, 1, 32, True)),   # prefill: a warp per row, 32 float4 loads per lane
    (1, 4096, (512, 1, 2, True)),     # decode batch 1: one 512-lane block on the row
    (2, 4096, (256, 1, 4, True)),
    (20, 8192, (32, 16, 4, True)),    # >= 256 values per thread: the row split over 16 warps
    (16, 64, (32, 1, 1, False)),      # C < 128: scalar loads, 2 per lane
    (3, 100, (64, 1, 1, False)),
])
def test_reduce_layout_is_pytorchs_cuda_configuration(rows, C, want):
    assert reduce_layout(rows, C) == ReduceLayout(*want)


@pytest.mark.parametrize("rows,C", [(16, 1024), (20, 8192), (7, 64)])
def test_kernel_sums_in_pytorchs_cuda_order(rows, C):
    """Issue 22: the exact kernel's fp32 output is exactly eager's CUDA formula with the sum of squares added in
    PyTorch's CUDA order for >= 16 rows (`torch_cuda_row_sum(rows=ORDER_ROWS)`): rounded squares, no FMA,
    fl(1/C), rsqrt, x·r, w·r; for any row count (batch-invariant: row 0 alone gives the same bits). (The
    CPU eager model sums in another order; this order differs from a plain sum on these rows.)"""
    g = torch.Generator().manual_seed(rows + C)
    x = 3 * torch.randn(rows, C, generator=g)  # fp32 in and out (the interpreter's bf16 cast truncates)
    w = 1 + 0.2 * torch.randn(C, generator=g)
    ss = torch_cuda_row_sum(x * x, rows=ORDER_ROWS)
    assert not torch.equal(ss, (x * x).sum(-1))
    want = w * (x * torch.rsqrt(ss[:, None] * torch.tensor(1.0 / C) + EPS))
    got = rms_norm(x, w, EPS, exact=True)
    assert torch.equal(got, want)
    assert torch.equal(rms_norm(x[:1], w, EPS, exact=True), got[:1])
    assert not torch.equal(rms_norm(x, w, EPS, exact=False), want)  # the fast kernel sums in Triton's order


class _Launches:
    """Stands in for the module's two kernels and records which one each launch took."""

    def __init__(self, monkeypatch):
        self.names = []
        for name in ("_rms_norm_kernel", "_rms_norm_exact_kernel"):
            monkeypatch.setattr(norm_mod, name, self._kernel(name))

    def _kernel(self, name):
        class K:
            def __getitem__(_, grid):
                return lambda *a, **kw: self.names.append((name, grid, kw.get("enable_fp_fusion", True)))
        return K()


def test_the_row_count_picks_the_variant(monkeypatch):
    """Decode-sized launches (< EXACT_ROWS_MIN rows: batch x (1 + k)) run the fast kernel with FMA fusion
    on, as before issue 22's exact kernels; prefill-sized ones the exact kernel without; `exact` and the
    deterministic op `dsv4c::rms_norm_bi` override the count (its CPU path is the model's function)."""
    rec = _Launches(monkeypatch)
    w = torch.ones(64)
    for rows in (1, 8, 64, EXACT_ROWS_MIN - 1, EXACT_ROWS_MIN, 512):
        rms_norm(torch.zeros(rows, 1, 64), w, EPS)
    rms_norm(torch.zeros(512, 64), w, EPS, exact=False)
    rms_norm(torch.zeros(2, 64), w, EPS, exact=True)
    fast, exact = ("_rms_norm_kernel", True), ("_rms_norm_exact_kernel", False)
    assert [(n, f) for n, _, f in rec.names] == [fast] * 4 + [exact] * 2 + [fast, exact]
    assert [g for _, g, _ in rec.names][:6] == [(1,), (8,), (64,), (127,), (128,), (512,)]
    assert EXACT_ROWS_MIN > 64  # decode at batch 64 (k = 0) keeps the fast kernel
    x, w = torch.randn(3, 40).to(torch.bfloat16), torch.rand(40) + 0.5
    assert torch.equal(torch.ops.dsv4c.rms_norm_bi(x, w, EPS, False), rms_norm_ref(x, w, EPS, False))
    assert OP_CAPTURE["dsv4c.rms_norm_bi"] is None


def test_non_contiguous_input():
    x = torch.randn(6, 5, 40).transpose(0, 1)
    w = torch.rand(40) + 0.5
    assert not x.is_contiguous()
    assert _rel(rms_norm(x, w, EPS), _norm64(x, w, EPS, False)) <= KERNEL_REL[torch.float32]


@pytest.mark.parametrize("exact", [False, True])
def test_column_slice_is_read_in_place_with_the_same_bits(exact):
    """The split of a fused projection at several tokens (q's columns of wq_a ‖ wkv): rows one stride apart,
    unit stride along C. Read in place (no copy: `rows_view` is a view) with the bits of its contiguous copy."""
    from dsv4c.kernels.norm import rows_view

    fused = torch.randn(2, 3, 56).to(torch.bfloat16)
    x = fused[..., 8:48]                                  # [2, 3, 40], row stride 56
    w = torch.rand(40) + 0.5
    assert not x.is_contiguous() and rows_view(x).data_ptr() == x.data_ptr() and rows_view(x).stride() == (56, 1)
    got = rms_norm(x, w, EPS, exact=exact)
    assert got.is_contiguous() and torch.equal(got, rms_norm(x.contiguous(), w, EPS, exact=exact))
    assert rows_view(torch.randn(6, 5, 40).transpose(0, 1)).is_contiguous()  # not one stride: copied


@pytest.mark.parametrize("x,w,err", [
    (torch.zeros(2, 8, dtype=torch.float64), torch.ones(8), "float32/bfloat16/float16"),
    (torch.zeros(2, 8), torch.ones(7), r"w must have shape \[8\]"),
    (torch.zeros(2, 8), torch.ones(1, 8), r"w must have shape \[8\]"),
    (torch.zeros(()), torch.ones(1), "scalar"),
    (torch.zeros(1, 32768), torch.ones(32768), "MAX_C"),
])
def test_wrapper_rejects_bad_input(x, w, err):
    with pytest.raises(ValueError, match=err):
        rms_norm(x, w, EPS)


# ---- the custom op ---------------------------------------------------------------------------------
@pytest.mark.parametrize("cast_first", [False, True])
def test_op_is_the_model_function_on_cpu_fake_and_capture_safe(cast_first):
    x = torch.randn(2, 3, 40).to(torch.bfloat16)
    norm = RMSNorm(40, EPS, cast_first=cast_first).to(torch.bfloat16)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(40) + 0.5)
        want = norm(x)
    got = torch.ops.dsv4c.rms_norm(x, norm.weight.detach(), EPS, cast_first)
    assert torch.equal(got, want) and got.dtype == want.dtype
    with torch._subclasses.FakeTensorMode() as mode:
        fake = torch.ops.dsv4c.rms_norm(mode.from_tensor(x), mode.from_tensor(torch.ones(40)), EPS, cast_first)
    assert fake.shape == x.shape and fake.dtype == (torch.float32 if cast_first else torch.bfloat16)
    assert OP_CAPTURE["dsv4c.rms_norm"] is None
    assert host_sync_ops(reference_impl("dsv4c.rms_norm"), x, norm.weight.detach(), EPS, cast_first) == []


# ---- the pass -----------------------------------------------------------------------------------
@torch.no_grad()
def _norm_calls(name, kind, dtype=torch.float32) -> tuple[int, int]:
    """(norms the eager model calls in this graph's step, of them V3-order): the sites to expect.
    The compressors' norms are not module calls (their weight goes into the compressor op)."""
    model = _model(name, dtype)
    args = _inputs(name, kind, dtype)
    calls = []
    hooks = [m.register_forward_hook(lambda mod, i, o: calls.append(mod.cast_first))
             for m in model.modules() if isinstance(m, RMSNorm)]
    try:
        if kind == "mtp":
            cache = model.new_mtp_cache(N_SLOTS, max_len=MAX_LEN)
            model.mtp_forward(args[0], args[1], cache, slots=args[2])
        else:
            cache = model.new_cache(N_SLOTS, max_len=MAX_LEN)
            model(args[0], cache, slots=args[1])
    finally:
        for h in hooks:
            h.remove()
    return len(calls), sum(calls)


@pytest.mark.parametrize("name,kind,dtype", [
    ("v4", "decode", torch.float32),
    ("v4", "verify", torch.float32),
    ("v4", "mtp", torch.float32),
    ("v4", "prefill", torch.bfloat16),
    ("v4", "mtp", torch.bfloat16),
    ("v3-tiny", "decode", torch.float32),
    ("v3-tiny", "mtp", torch.bfloat16),
    ("v32-tiny", "verify", torch.float32),
])
def test_pass_fuses_every_norm_bit_exact(name, kind, dtype):
    model = _model(name, dtype)
    ctx = PassContext(model.config, "cpu", graph_kind=kind)
    ref_gm = _exported(name, kind, dtype)
    res = fuse_rmsnorm(_exported(name, kind, dtype), ctx)
    gm = res.graph
    verify(gm, ctx, after="fuse_rmsnorm")
    n, v3 = _norm_calls(name, kind, dtype)
    assert n > 0 and res.changed and res.stats["sites"] == n
    assert res.stats["orders"] == {"v4": n - v3, "v3": v3} and v3 == (0 if name == "v4" else n)
    assert sum(nd.target is torch.ops.dsv4c.rms_norm.default for nd in gm.graph.nodes) == n
    args = _inputs(name, kind, dtype)
    _assert_same(_run(gm, args), _run(ref_gm, args))  # CPU: the op is RMSNorm.forward: exact
    again = fuse_rmsnorm(gm, ctx)
    assert not again.changed and again.stats["sites"] == 0


@pytest.mark.parametrize("name", ["v4", "v3-tiny"])
def test_fused_graph_with_the_triton_kernel_matches(name):
    """The decode graph with each rms_norm node running the Triton kernel (interpreter)."""
    ctx = PassContext(_model(name).config, "cpu", graph_kind="decode")
    ref_gm = _exported(name, "decode")
    gm = fuse_rmsnorm(_exported(name, "decode"), ctx).graph
    for nd in gm.graph.nodes:
        if nd.target is torch.ops.dsv4c.rms_norm.default:
            nd.target = rms_norm
    gm.recompile()
    args = _inputs(name, "decode")
    _assert_same(_run(gm, args), _run(ref_gm, args), rel=GRAPH_REL)


def test_norms_with_another_eps_are_left_alone():
    cfg = dataclasses.replace(_model("v4").config, rms_norm_eps=1e-5)
    gm = _exported("v4", "decode")
    before = gm.code
    res = fuse_rmsnorm(gm, PassContext(cfg, "cpu", graph_kind="decode"))
    assert not res.changed and res.stats["sites"] == 0 and res.graph.code == before


def test_in_the_pipeline_norms_sit_in_capturable_segments():
    """fuse_rmsnorm runs in default_pipeline: the outputs equal the pipeline without it, and on h200
    the fused norms sit in capturable static segments."""
    ctx = PassContext(_model("v4").config, "h200", graph_kind="decode")
    args = _inputs("v4", "decode")
    skip = ("quantize_experts", "quantize_dense")  # lossy (tests/test_quantize_experts.py, test_quantize_dense.py)
    unfused, _ = run_pipeline(_exported("v4", "decode"), ctx, skip=skip + ("fuse_rmsnorm",))
    gm, recs = run_pipeline(_exported("v4", "decode"), ctx, skip=skip)
    n, _ = _norm_calls("v4", "decode")
    assert next(r for r in recs if r.name == "fuse_rmsnorm").stats["sites"] == n
    _assert_same(_run(gm, args), _run(unfused, args))
    plan = plan_segments(gm, ctx)
    names = {nd.name for nd in gm.graph.nodes if nd.target is torch.ops.dsv4c.rms_norm.default}
    holding = [s for s in plan.segments if names & set(s.nodes)]
    assert len(names) == n and sum(len(names & set(s.nodes)) for s in holding) == n
    assert all(s.kind == "static" and s.capturable for s in holding), [(s.index, s.reason) for s in holding]


# ---- CUDA (the device) ------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("batch", [1, 8, 64])
@pytest.mark.parametrize("C,cast_first", [(4096, False), (1024, False), (512, False), (7168, True), (1536, True)])
def test_kernel_on_cuda(batch, C, cast_first):
    """The compiled kernel against the model's function run on CUDA and against fp64: V4-Flash hidden
    4096 (and q/kv norm widths), V3 hidden 7168 and q_a 1536, bf16, batch 1/8/64."""
    g = torch.Generator().manual_seed(batch + C)
    x = (3 * torch.randn(batch, 1, C, generator=g)).to(torch.bfloat16).cuda()
    w = (1 + 0.2 * torch.randn(C, generator=g)).to(torch.bfloat16).cuda()
    got = torch.ops.dsv4c.rms_norm(x, w, EPS, cast_first)
    want = _norm64(x, w, EPS, cast_first)
    tol = 8e-3 if cast_first else 4e-3  # round to nearest on the device: one (V3 order: two) bf16 roundings
    assert _rel(got, want) <= tol
    assert _rel(got, rms_norm_ref(x, w, EPS, cast_first)) <= 2 * tol


@pytest.mark.gpu
def test_op_captures_in_a_cuda_graph():
    x = torch.randn(8, 1, 4096, device="cuda", dtype=torch.bfloat16)
    w = torch.rand(4096, device="cuda", dtype=torch.bfloat16) + 0.5
    torch.ops.dsv4c.rms_norm(x, w, EPS, False)  # compile before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = torch.ops.dsv4c.rms_norm(x, w, EPS, False)
    x.copy_(torch.randn_like(x))
    graph.replay()
    assert _rel(out, _norm64(x, w, EPS, False)) <= 4e-3


@pytest.mark.gpu
@pytest.mark.parametrize("C", [4096, 1024, 512])
def test_kernel_rounds_once_like_eager_at_prefill_size(C):
    """Issue 22: V4 order (fp32 product, one cast) at a prefill's 512 rows: against eager on CUDA, element
    by element, <= 1 bf16 ulp in few elements (an extra rounding step would move most of them)."""
    g = torch.Generator().manual_seed(C)
    x = (3 * torch.randn(2, 256, C, generator=g)).to(torch.bfloat16).cuda()
    w = (1 + 0.2 * torch.randn(C, generator=g)).to(torch.bfloat16).cuda()
    a, b = torch.ops.dsv4c.rms_norm(x, w, EPS, False).float(), rms_norm_ref(x, w, EPS, False).float()
    ulp = torch.exp2(torch.floor(torch.log2(b.abs().clamp_min(2.0 ** -126))) - 7)
    d = (a - b).abs() / ulp
    assert d.max() <= 1.0 and (d > 0).float().mean() <= 0.01, (d.max().item(), (d > 0).float().mean().item())


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 2, 8, 16, 64, 512])
@pytest.mark.parametrize("C", [4096, 1024, 512, 64])
def test_kernel_is_bit_exact_with_eager_on_cuda(rows, C):
    """Issue 22: the first assert checks the summation order itself: `torch_cuda_row_sum` (reduce_layout, for
    this row count) against torch's own mean of the squares. From 16 rows on (prefill; decode at batch >=
    16), where PyTorch's block shape no longer depends on the row count, the V4-order kernel equals
    RMSNorm.forward bit for bit (the exact kernel, which the op runs from EXACT_ROWS_MIN rows); below, it keeps
    the 16-row order (one order for any row count) and is within an ulp."""
    g = torch.Generator().manual_seed(rows * C)
    x = (3 * torch.randn(rows, C, generator=g)).to(torch.bfloat16).cuda()
    w = (1 + 0.2 * torch.randn(C, generator=g)).to(torch.bfloat16).cuda()
    sq = x.float().pow(2)
    assert torch.equal(torch_cuda_row_sum(sq) * torch.tensor(1.0 / C, device="cuda"), sq.mean(-1)), reduce_layout(rows, C)
    got, want = rms_norm(x, w, EPS, False, exact=True), rms_norm_ref(x, w, EPS, False)
    if rows >= ORDER_ROWS:
        assert torch.equal(got, want), (got != want).float().mean().item()
    else:
        assert torch.equal(got, rms_norm(x.repeat(ORDER_ROWS, 1), w, EPS, False, exact=True)[:rows])
    if rows >= EXACT_ROWS_MIN:
        assert torch.equal(torch.ops.dsv4c.rms_norm(x, w, EPS, False), got)


@pytest.mark.gpu
def test_deterministic_op_rows_do_not_depend_on_the_row_count_on_cuda():
    """`dsv4c::rms_norm_bi` (the deterministic mode's norm): a row's bits are the same alone, among decode-sized
    and among prefill-sized launches (the default op changes kernel at EXACT_ROWS_MIN rows)."""
    x = (3 * torch.randn(2 * EXACT_ROWS_MIN, 1, 4096, generator=torch.Generator().manual_seed(1))).to(torch.bfloat16).cuda()
    w = (1 + 0.2 * torch.randn(4096, generator=torch.Generator().manual_seed(2))).to(torch.bfloat16).cuda()
    full = torch.ops.dsv4c.rms_norm_bi(x, w, EPS, False)
    for m in (1, 8, EXACT_ROWS_MIN - 1, EXACT_ROWS_MIN):
        assert torch.equal(torch.ops.dsv4c.rms_norm_bi(x[:m], w, EPS, False), full[:m]), m
    assert torch.equal(full[:8], torch.ops.dsv4c.rms_norm(x[:8], w, EPS, False))  # decode-sized: the same kernel
