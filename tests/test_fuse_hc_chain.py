"""A site's mHC post-mix chained into the next site's pre-mix: the kernel (kernels/mhc.py `hc_post_pre`), its
custom op and the fuse_hc_chain pass."""
from __future__ import annotations

import operator
import textwrap

import pytest
import torch

from dsv4c import ModelConfig
import dsv4c.kernels.mhc as mhc_mod
from dsv4c.kernels.mhc import HC_CHAIN_MAX, hc_post_pre, hc_post_pre_ref
from dsv4c.model import register_ops
from dsv4c.passes import PassContext, run_pipeline, verify
from dsv4c.passes.fuse_hc import fuse_hc
from dsv4c.passes.fuse_hc_chain import _pairs, fuse_hc_chain
from dsv4c.passes.make_batch_invariant import batch_invariance_blockers
from dsv4c.passes.split_at_routers import OP_CAPTURE, host_sync_ops, plan_segments, reference_impl
from sm90_compile import run_sm90_script
from fusion_cases import (assert_same as _assert_same, exported as _exported, inputs as _inputs, model as _model,
                          rel as _rel, run as _run)

register_ops()
ITERS, EPS, HC_EPS = 20, 1e-6, 1e-6
OPS = torch.ops.dsv4c


def _case(lead, n, d, dtype, seed):
    """A post site (y, X, post, comb) and the next site's weights (fn, base, scale), all random."""
    g = torch.Generator().manual_seed(seed)
    mix = (2 + n) * n
    X = torch.randn(*lead, n, d, generator=g).to(dtype)
    y = torch.randn(*lead, d, generator=g).to(dtype)
    post = 2 * torch.rand(*lead, n, generator=g)
    comb = torch.rand(*lead, n, n, generator=g)
    fn = torch.randn(mix, n * d, generator=g) / (n * d) ** 0.5
    base, scale = 0.3 * torch.randn(mix, generator=g), 0.5 + torch.rand(3, generator=g)
    return y, X, post, comb, fn, base, scale


def _count(gm, op) -> int:
    return sum(1 for n in gm.graph.nodes if n.target is op)


# ---- the kernel (Triton interpreter) ----------------------------------------------------------------
@pytest.mark.parametrize("lead,n,d,dtype", [
    ((1, 1), 4, 256, torch.bfloat16),    # decode, batch 1: two d-blocks
    ((2, 3), 4, 200, torch.float32),     # verify-shaped; D not a multiple of the d-block
    ((8, 1), 4, 64, torch.float16),      # HC_CHAIN_MAX tokens
    ((3, 1), 2, 40, torch.float32),      # N = 2
])
def test_chained_kernel_equals_the_two_unchained_kernels(lead, n, d, dtype):
    """X' bit for bit (the same post arithmetic); u, post' and comb' from z summed in another order (by d-block,
    not by K chunk): fp32 noise, u within one rounding of its dtype. All four near the model's pair."""
    args = _case(lead, n, d, dtype, sum(lead) + d)
    got = hc_post_pre(*args, EPS, HC_EPS, ITERS, chained=True)
    sep = hc_post_pre(*args, EPS, HC_EPS, ITERS, chained=False)
    ref = hc_post_pre_ref(*args, EPS, HC_EPS, ITERS)
    assert torch.equal(got[0], sep[0])
    assert _rel(got[1], sep[1]) <= (1e-6 if dtype == torch.float32 else 1e-2)
    for a, b in zip(got[2:], sep[2:]):
        assert a.dtype == torch.float32 and _rel(a, b) <= 1e-6
    tol = {torch.float32: 2e-6, torch.bfloat16: 1e-2, torch.float16: 2e-3}[dtype]
    for a, b in zip(got, ref):
        assert a.shape == b.shape and a.dtype == b.dtype and _rel(a, b) <= tol


def test_early_fn_keeps_the_chain_within_its_bounds(monkeypatch):
    """Early fn (fn's tiles loaded before the PDL wait, z summed over d then streams; HC_EARLY_FN_MAX_ROWS >= M)
    against late (the loop over streams): X' unchanged bit for bit, u / post' / comb' within fp32 noise, both
    within the model pair's bounds."""
    args = _case((2, 1), 4, 256, torch.bfloat16, 11)
    outs = {}
    for early in (0, 1):
        monkeypatch.setattr(mhc_mod, "HC_EARLY_FN_MAX_ROWS", 64 * early)
        outs[early] = hc_post_pre(*args, EPS, HC_EPS, ITERS, chained=True)
    got, base = outs[1], outs[0]
    ref = hc_post_pre_ref(*args, EPS, HC_EPS, ITERS)
    assert torch.equal(got[0], base[0]) and _rel(got[1], base[1]) <= 1e-2
    for a, b in zip(got[2:], base[2:]):
        assert _rel(a, b) <= 1e-6
    for out in (got, base):
        for a, b in zip(out, ref):
            assert a.shape == b.shape and a.dtype == b.dtype and _rel(a, b) <= 1e-2


_SM90_SCRIPT = textwrap.dedent('''
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from dsv4c.kernels import mhc

    def build(fn, types, consts, warps):
        names = list(fn.arg_names)
        sig = {nm: "constexpr" if nm in consts else types.get(nm, "fp32" if nm.endswith("eps") or nm == "inv_k"
                                                                   else "i32") for nm in names}
        attrs = {(i,): [["tt.divisibility", 16]] for i, nm in enumerate(names) if nm.endswith("_ptr")}
        src = ASTSource(fn=fn, signature=sig, constexprs={(names.index(k),): v for k, v in consts.items()},
                        attrs=attrs)
        ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps}).asm["ptx"]
        body = ptx[ptx.index(".entry"):]
        return int(body.index("ld.global") < body.index("griddepcontrol.wait"))

    f32 = {nm: "*fp32" for nm in ("zp_ptr", "ssp_ptr", "fn_ptr", "post_ptr", "comb_ptr", "base_ptr", "scale_ptr")}
    bf = {"x_ptr": "*bf16", "y_ptr": "*bf16", "y2_ptr": "*bf16", "out_ptr": "*bf16", "u_ptr": "*bf16"}
    for early in (False, True):
        c = dict(N=4, MIXP=32, BLOCK_D=32, EARLY_FN=early, PDL=True)
        print("kernel post_mix", int(early), build(mhc._hc_post_mix_kernel, {**f32, **bf}, c, 2))
''')


def test_kernels_compile_for_sm90(tmp_path):
    """_hc_post_mix_kernel compiled (not run) for sm_90 with and without HC_EARLY_FN: with it the PTX requests fn
    before the PDL wait, without it nothing is loaded before the wait."""
    rows = run_sm90_script(tmp_path, _SM90_SCRIPT)
    assert rows == [["post_mix", "0", "0"], ["post_mix", "1", "1"]], rows


def test_chained_kernel_partials_are_the_streams_it_wrote():
    """z comes from X' as written: feeding that X' to hc_pre alone gives the same post' and comb'."""
    args = _case((1, 1), 4, 256, torch.bfloat16, 5)
    x2, u, post, comb = hc_post_pre(*args, EPS, HC_EPS, ITERS, chained=True)
    u1, post1, comb1 = mhc_mod.hc_pre(x2, *args[4:], EPS, HC_EPS, ITERS)
    assert torch.equal(u, u1) and _rel(post, post1) <= 1e-6 and _rel(comb, comb1) <= 1e-6
    assert _rel(post, post.roll(1, -1)) > 1e-3   # the rows of post' are not all one value


def test_the_token_count_picks_the_path(monkeypatch):
    calls, early = [], []
    real = mhc_mod._hc_post_mix_kernel

    def launch(grid):
        def run(*args, **kw):
            early.append(kw["EARLY_FN"])
            return real[grid](*args, **kw)
        calls.append(grid)
        return run
    monkeypatch.setattr(mhc_mod, "_hc_post_mix_kernel", type("K", (), {"__getitem__": lambda self, g: launch(g)})())
    for m in (1, HC_CHAIN_MAX, HC_CHAIN_MAX + 1):
        hc_post_pre(*_case((m, 1), 4, 32, torch.float32, m), EPS, HC_EPS, ITERS)
    assert [g[0] for g in calls] == [1, HC_CHAIN_MAX]   # above HC_CHAIN_MAX: hc_post then hc_pre
    assert mhc_mod.HC_EARLY_FN_MAX_ROWS == 1 and early == [True, False]  # fn before the wait at one token only


def test_no_tokens_and_bad_input():
    out = hc_post_pre(*_case((0, 1), 4, 32, torch.float32, 0), EPS, HC_EPS, ITERS)
    assert [tuple(t.shape) for t in out] == [(0, 1, 4, 32), (0, 1, 32), (0, 1, 4), (0, 1, 4, 4)]
    y, X, post, comb, fn, base, scale = _case((1, 1), 4, 32, torch.float32, 1)
    with pytest.raises(ValueError, match="fn must have shape"):
        hc_post_pre(y, X, post, comb, fn[:, :-1], base, scale, EPS, HC_EPS, ITERS)
    with pytest.raises(ValueError, match="hc_post: y must be"):
        hc_post_pre(y[..., :-1], X, post, comb, fn, base, scale, EPS, HC_EPS, ITERS)
    with pytest.raises(ValueError, match="block_d must be a power of two"):
        hc_post_pre(y, X, post, comb, fn, base, scale, EPS, HC_EPS, ITERS, block_d=96)


def test_op_is_the_model_pair_on_cpu_fake_and_capture_safe():
    args = _case((2, 1), 4, 32, torch.bfloat16, 3)
    got = OPS.hc_post_pre(*args, EPS, HC_EPS, ITERS)
    ref = hc_post_pre_ref(*args, EPS, HC_EPS, ITERS)
    assert all(torch.equal(a, b) for a, b in zip(got, ref))
    with torch._subclasses.FakeTensorMode() as mode:
        fake = OPS.hc_post_pre(*(mode.from_tensor(a) for a in args), EPS, HC_EPS, ITERS)
    assert [(f.shape, f.dtype) for f in fake] == [(r.shape, r.dtype) for r in ref]
    assert OP_CAPTURE["dsv4c.hc_post_pre"] is None
    assert host_sync_ops(reference_impl("dsv4c.hc_post_pre"), *args, EPS, HC_EPS, ITERS) == []


# ---- the pass ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind,dtype", [("decode", torch.float32), ("verify", torch.bfloat16),
                                        ("prefill", torch.bfloat16), ("mtp", torch.float32)])
def test_pass_chains_every_pair_bit_exact(kind, dtype):
    cfg = _model("v4", dtype).config
    ctx = PassContext(cfg, "cpu", graph_kind=kind)
    ref_gm = fuse_hc(_exported("v4", kind, dtype), ctx).graph
    sites = _count(ref_gm, OPS.hc_pre.default)
    res = fuse_hc_chain(fuse_hc(_exported("v4", kind, dtype), ctx).graph, ctx)
    gm = res.graph
    verify(gm, ctx, after="fuse_hc_chain")
    # 2 sites a block (the MTP graph: its one block); every post but the last feeds the next site's pre
    want = sites - 1
    assert want >= 1 and res.changed and res.stats == {"chained": want}
    assert _count(gm, OPS.hc_post_pre.default) == want
    assert _count(gm, OPS.hc_pre.default) == _count(gm, OPS.hc_post.default) == sites - want
    args = _inputs("v4", kind, dtype)
    _assert_same(_run(gm, args), _run(ref_gm, args))   # CPU: the op is the model's pair
    assert fuse_hc_chain(gm, ctx).stats == {"chained": 0}


def test_chained_graph_with_the_triton_kernels_matches():
    """The decode graph with the chained, pre and post nodes running their Triton kernels (interpreter) vs the
    unfused graph (fp32 model: the kernels' summation orders only)."""
    ctx = PassContext(_model().config, "cpu", graph_kind="decode")
    gm = fuse_hc_chain(fuse_hc(_exported("v4", "decode"), ctx).graph, ctx).graph
    swap = {OPS.hc_post_pre.default: hc_post_pre, OPS.hc_pre.default: mhc_mod.hc_pre,
            OPS.hc_post.default: mhc_mod.hc_post}
    for n in gm.graph.nodes:
        n.target = swap.get(n.target, n.target)
    gm.recompile()
    assert sum(1 for n in gm.graph.nodes if n.target is hc_post_pre) == 3
    args = _inputs("v4", "decode")
    _assert_same(_run(gm, args), _run(_exported("v4", "decode"), args), rel=2e-6)


def test_a_post_read_by_two_pres_stays():
    """Only a post whose streams feed exactly one pre is chained (the other pre would lose its input)."""
    def graph(pres: int) -> torch.fx.GraphModule:
        g = torch.fx.Graph()
        y, X, p, c, fn, b, s = (g.placeholder(n) for n in ("y", "X", "p", "c", "fn", "b", "s"))
        x1 = g.call_function(OPS.hc_post.default, (y, X, p, c))
        outs = [g.call_function(operator.getitem, (g.call_function(OPS.hc_pre.default, (x1, fn, b, s, EPS, HC_EPS,
                                                                                        ITERS)), 0))
                for _ in range(pres)]
        g.output(tuple(outs))
        return torch.fx.GraphModule(torch.nn.Module(), g)

    assert len(_pairs(graph(1), OPS.hc_pre.default, OPS.hc_post.default)) == 1
    assert _pairs(graph(2), OPS.hc_pre.default, OPS.hc_post.default) == []


def test_deterministic_graphs_and_other_models_are_left_alone():
    cfg = _model().config
    gm = fuse_hc(_exported("v4", "decode"), PassContext(cfg, "cpu", graph_kind="decode")).graph
    res = fuse_hc_chain(gm, PassContext(cfg, "h200", graph_kind="decode", deterministic=True))
    assert not res.changed and res.stats["chained"] == 0 and "deterministic" in res.stats["skipped"]
    v3 = ModelConfig.preset("v3-tiny")
    assert fuse_hc_chain(gm, PassContext(v3, "cpu", graph_kind="decode")).stats["chained"] == 0
    # a chained op left in a deterministic graph would be named as a blocker
    chained = fuse_hc_chain(gm, PassContext(cfg, "cpu", graph_kind="decode")).graph
    assert any("dsv4c.hc_post_pre" in b for b in batch_invariance_blockers(chained))


def test_in_the_pipeline_chains_sit_in_capturable_segments():
    """After fuse_hc in default_pipeline: the outputs equal the pipeline without the pass, and on h200 every
    chained op sits in a capturable static segment."""
    ctx = PassContext(_model().config, "h200", graph_kind="verify")
    args = _inputs("v4", "verify")
    skip = ("quantize_experts", "quantize_dense")
    unchained, _ = run_pipeline(_exported("v4", "verify"), ctx, skip=skip + ("fuse_hc_chain",))
    gm, recs = run_pipeline(_exported("v4", "verify"), ctx, skip=skip)
    assert next(r for r in recs if r.name == "fuse_hc_chain").stats["chained"] >= 1
    _assert_same(_run(gm, args), _run(unchained, args))
    plan = plan_segments(gm, ctx)
    names = {n.name for n in gm.graph.nodes if n.target is OPS.hc_post_pre.default}
    holding = [s for s in plan.segments if names & set(s.nodes)]
    assert sum(len(names & set(s.nodes)) for s in holding) == len(names) >= 1
    assert all(s.kind == "static" and s.capturable for s in holding), [(s.index, s.reason) for s in holding]


# ---- CUDA (the device) ------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 8])
def test_early_fn_on_cuda_at_flash_dims(monkeypatch, m):
    """Early fn against late on the GPU (Flash dims): X' the same bits, u / post' / comb' within fp32 noise."""
    args = [a.cuda() for a in _case((m, 1), 4, 4096, torch.bfloat16, 20 + m)]
    monkeypatch.setattr(mhc_mod, "HC_EARLY_FN_MAX_ROWS", 64)
    got = hc_post_pre(*args, EPS, HC_EPS, ITERS, chained=True)
    monkeypatch.setattr(mhc_mod, "HC_EARLY_FN_MAX_ROWS", 0)
    base = hc_post_pre(*args, EPS, HC_EPS, ITERS, chained=True)
    assert torch.equal(got[0], base[0]) and _rel(got[1], base[1]) <= 1e-2
    assert _rel(got[2], base[2]) <= 1e-5 and _rel(got[3], base[3]) <= 1e-5


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 4, 8])
def test_chained_kernel_on_cuda_at_flash_dims_and_in_a_graph(m):
    args = [a.cuda() for a in _case((m, 1), 4, 4096, torch.bfloat16, m)]
    got = hc_post_pre(*args, EPS, HC_EPS, ITERS, chained=True)
    sep = hc_post_pre(*args, EPS, HC_EPS, ITERS, chained=False)
    assert torch.equal(got[0], sep[0]) and _rel(got[1], sep[1]) <= 1e-2
    assert _rel(got[2], sep[2]) <= 1e-5 and _rel(got[3], sep[3]) <= 1e-5
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = hc_post_pre(*args, EPS, HC_EPS, ITERS)
    g.replay()
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(out, got))
