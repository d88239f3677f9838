"""The deferred mHC Sinkhorn: hc_pre's finish writing the logits c0 (`defer`), the post-mix kernels normalising
them (`sinkhorn_iters`, `c0_in`, before the PDL wait with `early`), their ops and the defer_sinkhorn pass."""
from __future__ import annotations

import dataclasses
import operator
import textwrap

import pytest
import torch

import dsv4c.kernels.mhc as mhc
from dsv4c import ModelConfig, targets
from dsv4c.model import register_ops
from dsv4c.passes import PassContext, run_pipeline, verify
from dsv4c.passes.defer_sinkhorn import defer_sinkhorn
from dsv4c.passes.split_at_routers import OP_CAPTURE
from fusion_cases import assert_same, exported, inputs, model, run, swap_targets
from sm90_compile import run_sm90_script

register_ops()
ITERS, EPS, HC_EPS = 20, 1e-6, 1e-6
OPS = torch.ops.dsv4c
C0_OPS = (OPS.hc_pre_c0.default, OPS.hc_post_c0.default, OPS.hc_post_pre_c0.default)


def _site(lead, n, d, dtype, seed):
    """X, y, post and the site's weights (fn, base, scale), all random; c0's logits spread over a few units."""
    g = torch.Generator().manual_seed(seed)
    mix = (2 + n) * n
    X = torch.randn(*lead, n, d, generator=g).to(dtype)
    y = torch.randn(*lead, d, generator=g).to(dtype)
    post = 2 * torch.rand(*lead, n, generator=g)
    fn = 4 * torch.randn(mix, n * d, generator=g) / (n * d) ** 0.5
    base, scale = 0.3 * torch.randn(mix, generator=g), 0.5 + torch.rand(3, generator=g)
    return X, y, post, fn, base, scale


def _equal(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b))


# ---- the kernels (Triton interpreter) ---------------------------------------------------------------
@pytest.mark.parametrize("m,exact", [(1, False), (5, False), (3, True)])
def test_post_mix_normalising_c0_gives_the_bits_of_the_post_mix_on_comb(m, exact):
    """hc_pre with `defer` writes u and post as without it and c0 in comb's place (its Sinkhorn is comb); hc_post
    with `sinkhorn_iters` on c0 gives the bits of hc_post on that comb, early or not (the fast kernel runs the
    finish's own Sinkhorn on a fresh load of c0), and in the exact variant (the `sinkhorn` launch first)."""
    X, y, post, fn, base, scale = _site((m,), 4, 64, torch.bfloat16, m)
    u, p, comb = mhc.hc_pre(X, fn, base, scale, EPS, HC_EPS, ITERS, exact=exact)
    u2, p2, c0 = mhc.hc_pre(X, fn, base, scale, EPS, HC_EPS, ITERS, exact=exact, defer=True)
    assert torch.equal(u, u2) and torch.equal(p, p2)
    assert not torch.allclose(c0, comb, atol=1e-2)  # the logits, not the normalised matrix
    assert (mhc.sinkhorn_ref(c0, ITERS, HC_EPS) - comb).abs().max() <= 1e-6
    want = mhc.hc_post(y, X, p, comb, exact=exact)
    for early in (False, True):
        got = mhc.hc_post(y, X, p, c0, exact=exact, sinkhorn_iters=ITERS, hc_eps=HC_EPS, early=early)
        assert torch.equal(got, want), (early, (got.float() - want.float()).abs().max())


@pytest.mark.parametrize("chained", [True, False])
@pytest.mark.parametrize("c0_in,defer", [(True, False), (False, True), (True, True)])
def test_chained_post_pre_takes_and_gives_logits(chained, c0_in, defer):
    """hc_post_pre with `c0_in` (comb is the previous site's logits) and / or `defer` (comb' is this site's):
    X', u and post' are the bits of the call on the normalised comb, and comb' is c0' where deferred."""
    X, y, post, fn, base, scale = _site((3, 1), 4, 64, torch.bfloat16, 7)
    _, _, c0 = mhc.hc_pre(X, fn, base, scale, EPS, HC_EPS, ITERS, defer=True)
    _, _, comb = mhc.hc_pre(X, fn, base, scale, EPS, HC_EPS, ITERS)
    want = mhc.hc_post_pre(y, X, post, comb, fn, base, scale, EPS, HC_EPS, ITERS, chained=chained)
    got = mhc.hc_post_pre(y, X, post, c0 if c0_in else comb, fn, base, scale, EPS, HC_EPS, ITERS, chained=chained,
                          c0_in=c0_in, defer=defer, early=True)
    assert _equal(got[:3], want[:3])
    if defer:
        assert (mhc.sinkhorn_ref(got[3], ITERS, HC_EPS) - want[3]).abs().max() <= 1e-6
    else:
        assert torch.equal(got[3], want[3])


def test_ops_are_the_model_split_at_the_sinkhorn_on_the_cpu():
    """The CPU ops: hc_pre_c0 is the model's `pre_logits` (u and post of `pre`, comb its Sinkhorn), hc_post_c0 and
    hc_post_pre_c0 the model's functions on sinkhorn(c0): the bits of the undeferred ops; fakes and capture."""
    X, y, post, fn, base, scale = _site((1, 3), 4, 32, torch.float32, 3)
    u, p, c0 = OPS.hc_pre_c0(X, fn, base, scale, EPS, HC_EPS, ITERS)
    ref = OPS.hc_pre(X, fn, base, scale, EPS, HC_EPS, ITERS)
    assert _equal((u, p, mhc.sinkhorn_ref(c0, ITERS, HC_EPS)), ref)
    assert torch.equal(OPS.hc_post_c0(y, X, p, c0, ITERS, HC_EPS, True), OPS.hc_post(y, X, ref[1], ref[2]))
    got = OPS.hc_post_pre_c0(y, X, p, c0, fn, base, scale, EPS, HC_EPS, ITERS, True, True, True)
    want = OPS.hc_post_pre(y, X, ref[1], ref[2], fn, base, scale, EPS, HC_EPS, ITERS)
    assert _equal(got[:3], want[:3]) and torch.equal(mhc.sinkhorn_ref(got[3], ITERS, HC_EPS), want[3])
    with torch._subclasses.FakeTensorMode() as mode:
        f = [mode.from_tensor(a) for a in (X, y, p, c0, fn, base, scale)]
        fake = OPS.hc_post_pre_c0(f[1], f[0], f[2], f[3], *f[4:], EPS, HC_EPS, ITERS, True, False, True)
        assert [(a.shape, a.dtype) for a in fake] == [(a.shape, a.dtype) for a in want]
        assert OPS.hc_post_c0(f[1], f[0], f[2], f[3], ITERS, HC_EPS, False).shape == X.shape
    assert all(OP_CAPTURE[f"dsv4c.{n}"] is None for n in ("hc_pre_c0", "hc_post_c0", "hc_post_pre_c0"))


def test_bad_sinkhorn_iters_is_refused():
    X, y, post, fn, base, scale = _site((2,), 4, 32, torch.float32, 1)
    with pytest.raises(ValueError, match="sinkhorn_iters must be >= 0"):
        mhc.hc_post(y, X, post, torch.zeros(2, 4, 4), sinkhorn_iters=-1)


# ---- the pass ---------------------------------------------------------------------------------------
@pytest.fixture
def deferring(monkeypatch):
    """The h200 target with `defer_sinkhorn` on (every target has it off until it is timed)."""
    monkeypatch.setitem(targets.TARGETS, "h200", dataclasses.replace(targets.TARGETS["h200"], defer_sinkhorn=True))


def _pipeline(kind: str, skip_defer: bool, dtype=torch.float32, deterministic: bool = False):
    ctx = PassContext(model("v4", dtype).config, "h200", graph_kind=kind, deterministic=deterministic)
    skip = ("quantize_experts", "quantize_dense") + (("defer_sinkhorn",) if skip_defer else ())
    return run_pipeline(exported("v4", kind, dtype), ctx, skip=skip)


def _count(gm, ops) -> int:
    return sum(n.target in ops for n in gm.graph.nodes)


@pytest.mark.parametrize("kind,links", [("decode", 4), ("verify", 4), ("prefill", 4), ("mtp", 2)])
def test_pipeline_defers_every_link_and_keeps_the_bits(deferring, kind, links):
    """The two-layer V4 (4 sites; the MTP graph's block 2): every comb is read by the next post-mix only, after
    the block computed from u, so every link is deferred; outputs and cache writes are bit-equal to the pipeline
    without the pass (the CPU ops are the model's functions, split at the Sinkhorn)."""
    gm, recs = _pipeline(kind, False)
    without, _ = _pipeline(kind, True)
    assert next(r for r in recs if r.name == "defer_sinkhorn").stats == {"links": links}
    old = (OPS.hc_pre.default, OPS.hc_post.default, OPS.hc_post_pre.default)
    assert _count(gm, old) == 0 and _count(gm, C0_OPS) == _count(without, old) == links + 1
    assert all(n.args[12] is True for n in gm.graph.nodes if n.target is OPS.hc_post_pre_c0.default)  # early
    args = inputs("v4", kind)
    assert_same(run(gm, args), run(without, args))


def test_bf16_decode_graph_keeps_its_bits(deferring):
    gm, _ = _pipeline("decode", False, torch.bfloat16)
    without, _ = _pipeline("decode", True, torch.bfloat16)
    args = inputs("v4", "decode", torch.bfloat16)
    assert_same(run(gm, args), run(without, args))


def test_deferred_graph_on_the_triton_kernels_matches(deferring):
    """The deferred decode graph with its mHC ops on their Triton kernels (interpreter) vs the undeferred graph on
    its kernels: the same bits (each post-mix runs the finish's Sinkhorn on the same c0)."""
    gm, _ = _pipeline("decode", False)
    without, _ = _pipeline("decode", True)

    def post_c0(y, X, post, c0, iters, hc_eps, early, y2=None):
        return mhc.hc_post(y, X, post, c0, y2=y2, sinkhorn_iters=iters, hc_eps=hc_eps, early=early)

    def post_pre_c0(y, X, post, comb, fn, base, scale, eps, hc_eps, iters, c0_in, defer, early, y2=None):
        return mhc.hc_post_pre(y, X, post, comb, fn, base, scale, eps, hc_eps, iters, y2=y2, c0_in=c0_in,
                               defer=defer, early=early)

    assert swap_targets(gm, {OPS.hc_pre_c0.default: lambda *a: mhc.hc_pre(*a, defer=True),
                             OPS.hc_post_c0.default: post_c0, OPS.hc_post_pre_c0.default: post_pre_c0}) == 5
    assert swap_targets(without, {OPS.hc_pre.default: mhc.hc_pre,
                                  OPS.hc_post.default: lambda *a, y2=None: mhc.hc_post(*a[:4], y2=(*a[4:], y2)[0]),
                                  OPS.hc_post_pre.default: lambda *a, y2=None: mhc.hc_post_pre(
                                      *a[:10], y2=(*a[10:], y2)[0])}) == 5
    args = inputs("v4", "decode")
    assert_same(run(gm, args), run(without, args))


def test_deferred_graph_saves_checks_and_loads(deferring, tmp_path):
    """The deferred decode graph lifted, re-exported and saved as compile does; the archive passes the artifact
    check, loads with the three ops in it, and computes the graph's outputs."""
    from dsv4c.artifact_safety import check_pt2, load_program
    from dsv4c.export import example_inputs, export_lifted, lift_weights
    from fusion_cases import spec

    gm, _ = _pipeline("decode", False)
    args = inputs("v4", "decode")
    want = run(gm, args)
    weights = lift_weights(gm)
    program = export_lifted(gm, spec("decode"), example_inputs(model("v4"), spec("decode"), "cpu"), weights)
    path = tmp_path / "decode.pt2"
    torch.export.save(program, str(path))
    data = path.read_bytes()
    check_pt2(data, path)
    loaded = load_program(data).module()
    assert _count(loaded, C0_OPS) == 5
    assert_same(run(lambda *a: loaded(*a, weights), args), want)


def test_off_unless_the_target_asks_and_in_deterministic_graphs(deferring):
    assert not any(t.defer_sinkhorn for n, t in targets.TARGETS.items() if n != "h200")
    cfg = model("v4").config
    gm, recs = _pipeline("decode", False, deterministic=True)
    assert next(r for r in recs if r.name == "defer_sinkhorn").stats["skipped"].startswith("deterministic")
    assert _count(gm, C0_OPS) == 0
    res = defer_sinkhorn(exported("v4", "decode"), PassContext(cfg, "h100", graph_kind="decode"))
    assert not res.changed and res.stats == {"links": 0, "skipped": "target h100: defer_sinkhorn is off"}
    v3 = ModelConfig.preset("v3-tiny")
    assert defer_sinkhorn(exported("v4", "decode"), PassContext(v3, "h200")).stats["links"] == 0


def _small_graph(block: str):
    """hc_pre -> (u -> block -> y) -> hc_post(y, X, post, comb): block "kernel" (y = neg(u)), "view" (a view of u,
    no kernel between the pre-mix's finish and the post-mix), "none" (y = u), "reader" (comb also read by a neg)."""
    g = torch.fx.Graph()
    X, fn, b, s = (g.placeholder(n) for n in ("X", "fn", "b", "s"))
    pre = g.call_function(OPS.hc_pre.default, (X, fn, b, s, EPS, HC_EPS, ITERS))
    u, post, comb = (g.call_function(operator.getitem, (pre, i)) for i in range(3))
    aten = torch.ops.aten
    y = {"kernel": lambda: g.call_function(aten.neg.default, (u,)),
         "view": lambda: g.call_function(aten.view.default, (u, [-1])),
         "none": lambda: u, "reader": lambda: g.call_function(aten.neg.default, (u,))}[block]()
    x1 = g.call_function(OPS.hc_post.default, (y, X, post, comb))
    outs = (x1, g.call_function(aten.neg.default, (comb,))) if block == "reader" else (x1,)
    g.output(outs)
    return torch.fx.GraphModule(torch.nn.Module(), g)


@pytest.mark.parametrize("block,deferred", [("kernel", True), ("view", False), ("none", False), ("reader", False)])
def test_a_link_is_deferred_only_where_a_kernel_orders_it(deferring, block, deferred):
    """Deferred only when every reader of comb is a post-mix and its y is computed from u through at least one
    kernel: the post-mix's early read of c0 must come two launches after the finish that writes it."""
    gm = _small_graph(block)
    res = defer_sinkhorn(gm, PassContext(model("v4").config, "h200"))
    assert res.stats.get("links", 0) == int(deferred)
    assert _count(res.graph, C0_OPS) == 2 * int(deferred)
    if deferred:
        post = next(n for n in res.graph.graph.nodes if n.target is OPS.hc_post_c0.default)
        assert post.args[4:7] == (ITERS, HC_EPS, True)


# ---- sm_90 (compiled, not run) ----------------------------------------------------------------------
_SM90_SCRIPT = textwrap.dedent('''
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from dsv4c.kernels import mhc

    def ptx(fn, consts, warps):
        names = list(fn.arg_names)
        types = {**{nm: "*bf16" for nm in ("x_ptr", "y_ptr", "y2_ptr", "out_ptr", "u_ptr")},
                 **{nm: "fp32" for nm in ("hc_eps", "eps", "inv_k")}}
        sig = {nm: "constexpr" if nm in consts else types.get(nm, "*fp32" if nm.endswith("_ptr") else "i32")
               for nm in names}
        attrs = {(i,): [["tt.divisibility", 16]] for i, nm in enumerate(names) if nm.endswith("_ptr")}
        src = ASTSource(fn=fn, signature=sig, constexprs={(names.index(k),): v for k, v in consts.items()},
                        attrs=attrs)
        body = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps}).asm["ptx"]
        return body[body.index(".entry"):]

    for name, extra, warps in (("_hc_post_kernel", {}, 4), ("_hc_post_mix_kernel", dict(MIXP=32, EARLY_FN=False), 2)):
        for sk, early in ((0, False), (20, False), (20, True)):
            b = ptx(getattr(mhc, name), dict(N=4, BLOCK_D=512 if warps == 4 else 32, HAS_Y2=False, RNE_BF16=False,
                                             SK=sk, EARLY_SK=early, PDL=True, **extra), warps)
            print("kernel", name, sk, int(early), b[:b.index("griddepcontrol.wait")].count("ld.global"),
                  b.count("div.rn.f32"), int(".local" in b))
    for sinkhorn in (True, False):
        b = ptx(mhc._hc_pre_finish_kernel, dict(ITERS=20, N=4, MIXP=32, S_P=128, BLOCK_D=512, HEAD=False,
                                                SINKHORN=sinkhorn, PDL=True), 1)
        print("kernel finish", int(sinkhorn), 0, b.count("div.rn.f32"), 0, 0)
''')


def test_kernels_compile_for_sm90(tmp_path):
    """Compiled (not run) for sm_90: the post-mix kernels with SK 20 carry the Sinkhorn's divisions, and load c0
    before the PDL wait only with EARLY_SK; the finish without SINKHORN has none of the Sinkhorn's divisions."""
    rows = {tuple(r[:3]): tuple(int(v) for v in r[3:]) for r in run_sm90_script(tmp_path, _SM90_SCRIPT)}
    for name in ("_hc_post_kernel", "_hc_post_mix_kernel"):
        (e0, d0, l0), (e1, d1, l1), (e2, d2, l2) = (rows[(name, *k)] for k in (("0", "0"), ("20", "0"), ("20", "1")))
        assert d0 == 0 and d1 > 0 and d2 == d1 and l0 == l1 == l2 == 0, (name, rows)
        assert e1 == e0 and e2 > e0, (name, rows)
    (div_on, _, _), (div_off, _, _) = rows[("finish", "1", "0")], rows[("finish", "0", "0")]
    assert div_on > 0 and div_off == 0, rows


# ---- CUDA (the device) ------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 8, 64])
def test_deferred_sinkhorn_on_cuda_at_flash_dims(m):
    """On the GPU (Flash dims, bf16), with a kernel between the pre-mix and the post-mix as in a step: u and post
    are the undeferred bits, and the post-mix on c0 (early) gives X' within a few bf16 ulps of the post-mix on
    comb (the two Sinkhorns run in other layouts), chained and unchained."""
    X, y, post, fn, base, scale = (a.cuda() for a in _site((m,), 4, 4096, torch.bfloat16, 40 + m))
    u, p, comb = mhc.hc_pre(X, fn, base, scale, EPS, HC_EPS, ITERS)
    u2, p2, c0 = mhc.hc_pre(X, fn, base, scale, EPS, HC_EPS, ITERS, defer=True)
    mhc.hc_post(y, X, p2, torch.full_like(c0, 0.25))  # a kernel between the finish and the early read
    assert torch.equal(u, u2) and torch.equal(p, p2)
    want = mhc.hc_post(y, X, p, comb)
    got = mhc.hc_post(y, X, p2, c0, sinkhorn_iters=ITERS, hc_eps=HC_EPS, early=True)
    torch.cuda.synchronize()
    assert (got.float() - want.float()).abs().max() <= 2 ** -6 * want.float().abs().max()
    for chained in (True, False):
        a = mhc.hc_post_pre(y, X, p, comb, fn, base, scale, EPS, HC_EPS, ITERS, chained=chained)
        b = mhc.hc_post_pre(y, X, p2, c0, fn, base, scale, EPS, HC_EPS, ITERS, chained=chained, c0_in=True,
                            defer=True, early=True)
        assert (a[0].float() - b[0].float()).abs().max() <= 2 ** -6 * a[0].float().abs().max()
        assert (mhc.sinkhorn_ref(b[3], ITERS, HC_EPS) - a[3]).abs().max() <= 1e-4


@pytest.mark.gpu
@torch.no_grad()
def test_deferred_h200_artifact_runs_on_cuda_and_equals_eager(deferring, tmp_path):
    """v4-tiny-a compiled for h200 with the Sinkhorn deferred (fp32, reference experts, as
    tests/test_compile_session.py's h200 test): its graphs hold the _c0 ops, the prefill logits are eager's
    within 1e-4 and the greedy tokens of the CUDA-graph decode steps (the post-mix's early reads) are eager's."""
    from dsv4c import load_model, write_random_checkpoint
    from dsv4c.compile import compile_checkpoint
    from dsv4c.model.generate import greedy
    from dsv4c.runtime import Session

    write_random_checkpoint(ModelConfig.preset("v4-tiny-a"), tmp_path / "ckpt", seed=3, dtype=torch.float32)
    man = compile_checkpoint(tmp_path / "ckpt", tmp_path / "art", target="h200", max_tokens=64, max_batch=4,
                             dtype=torch.float32, kernels={"moe_experts": "reference"})
    passes = {p["name"]: p for p in man["graphs"]["decode"]["passes"]}
    assert passes["defer_sinkhorn"]["stats"]["links"] >= 2
    sess = Session.load(tmp_path / "art", device="cuda")
    model = load_model(tmp_path / "ckpt").cuda()
    ids = [5, 9, 17, 3, 44, 2, 7, 19, 23]
    ref = model(torch.tensor([ids], device="cuda"))[0].float().cpu()
    got = sess.logits(ids)
    assert ((got - ref).abs().max() / ref.abs().max()).item() < 1e-4
    prompts = [[5, 9, 17], [3, 44, 2, 7, 19, 23, 1, 8], [4], [6, 6, 6, 6, 6]]
    for p, r in zip(prompts, sess.generate(prompts, max_new_tokens=5)):
        assert r.tokens == greedy(model, torch.tensor([p], device="cuda"), 5)[0].tolist()
