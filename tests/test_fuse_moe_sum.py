"""The MoE's routed + shared sum folded into the mHC post-mix that reads it: the post-mix kernels' second y
(kernels/mhc.py `_load_y`), the ops' `y2` and the fuse_moe_sum pass."""
from __future__ import annotations

import textwrap

import pytest
import torch

from dsv4c import ModelConfig
from dsv4c.kernels.mhc import hc_post, hc_post_pre, hc_post_pre_ref, hc_post_ref
from dsv4c.model import register_ops
from dsv4c.passes import PassContext, run_pipeline
from dsv4c.passes.fuse_moe_sum import fuse_moe_sum
from fusion_cases import assert_same, exported, inputs, model, run
from sm90_compile import run_sm90_script

register_ops()
ITERS, EPS, HC_EPS = 20, 1e-6, 1e-6
OPS = torch.ops.dsv4c
ADD = torch.ops.aten.add.Tensor


def _case(lead, n, d, dtype, seed):
    """(y, y2, X, post, comb, fn, base, scale), all random; y and y2 of one scale, so their sum rounds."""
    g = torch.Generator().manual_seed(seed)
    mix = (2 + n) * n
    y, y2 = (torch.randn(*lead, d, generator=g).to(dtype) for _ in range(2))
    X = torch.randn(*lead, n, d, generator=g).to(dtype)
    post, comb = 2 * torch.rand(*lead, n, generator=g), torch.rand(*lead, n, n, generator=g)
    fn = torch.randn(mix, n * d, generator=g) / (n * d) ** 0.5
    base, scale = 0.3 * torch.randn(mix, generator=g), 0.5 + torch.rand(3, generator=g)
    return y, y2, X, post, comb, fn, base, scale


def _sum_rounds(y, y2) -> bool:
    """The case is a real test: the sum in fp32 differs from the sum stored in y's dtype somewhere."""
    return y.dtype == torch.float32 or not torch.equal((y.float() + y2.float()), (y + y2).float())


# ---- the kernels (Triton interpreter) --------------------------------------------------------------
@pytest.mark.parametrize("exact", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_post_with_y2_is_the_post_of_the_rounded_sum(dtype, exact):
    """hc_post(y, ..., y2) equals hc_post(y + y2, ...) bit for bit in both variants (the kernel rounds the sum
    to y's dtype as ATen's add does), and the model's post on the eager sum within the variant's usual bound."""
    y, y2, X, post, comb = _case((2, 3), 4, 200, dtype, 3)[:5]
    assert _sum_rounds(y, y2)
    got = hc_post(y, X, post, comb, exact=exact, y2=y2)
    assert torch.equal(got, hc_post(y + y2, X, post, comb, exact=exact))
    ref = hc_post_ref(y, X, post, comb, y2)
    assert torch.equal(ref, hc_post_ref(y + y2, X, post, comb))
    tol = {torch.float32: 2e-6, torch.bfloat16: 1e-2, torch.float16: 2e-3}[dtype]
    assert ((got.double() - ref.double()).norm() / ref.double().norm()).item() <= tol


@pytest.mark.parametrize("chained", [True, False])
def test_post_pre_with_y2_is_the_pair_on_the_rounded_sum(chained):
    """hc_post_pre with y2 (chained: `_hc_post_mix_kernel`; unchained: hc_post then hc_pre) gives the bits of
    the same call on y + y2, all four outputs."""
    y, y2, *rest = _case((2, 1), 4, 256, torch.bfloat16, 5)
    got = hc_post_pre(y, *rest, EPS, HC_EPS, ITERS, chained=chained, y2=y2)
    want = hc_post_pre(y + y2, *rest, EPS, HC_EPS, ITERS, chained=chained)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    ref = hc_post_pre_ref(y, *rest, EPS, HC_EPS, ITERS, y2)
    assert torch.equal(ref[0], hc_post_ref(y + y2, *rest[:3]))


def test_ops_take_y2_on_the_cpu_and_as_fakes():
    """The three post-mix ops with y2: the CPU op is the model's function on the eager sum (bit-exact), and
    the fake op gives the real op's shapes and dtypes."""
    y, y2, X, post, comb, fn, base, scale = _case((3, 1), 4, 64, torch.bfloat16, 7)
    for op in (OPS.hc_post, OPS.hc_post_bi):
        assert torch.equal(op(y, X, post, comb, y2), hc_post_ref(y + y2, X, post, comb))
    got = OPS.hc_post_pre(y, X, post, comb, fn, base, scale, EPS, HC_EPS, ITERS, y2)
    for a, b in zip(got, hc_post_pre_ref(y + y2, X, post, comb, fn, base, scale, EPS, HC_EPS, ITERS)):
        assert torch.equal(a, b)
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode() as mode:
        fake = OPS.hc_post_pre(*(mode.from_tensor(a) for a in (y, X, post, comb, fn, base, scale)), EPS, HC_EPS,
                               ITERS, mode.from_tensor(y2))
    assert [(f.shape, f.dtype) for f in fake] == [(t.shape, t.dtype) for t in got]


def test_a_y2_unlike_y_is_refused():
    y, y2, X, post, comb = _case((2, 1), 4, 64, torch.bfloat16, 9)[:5]
    with pytest.raises(ValueError, match="y2 must match y"):
        hc_post(y, X, post, comb, y2=y2.float())
    with pytest.raises(ValueError, match="y2 must match y"):
        hc_post(y, X, post, comb, y2=y2[:1])


# ---- the pass -----------------------------------------------------------------------------------------
def _pipeline(kind: str, deterministic: bool, skip_sum: bool, dtype=torch.float32):
    ctx = PassContext(model("v4", dtype).config, "h200", graph_kind=kind, deterministic=deterministic)
    skip = ("quantize_experts", "quantize_dense") + (("fuse_moe_sum",) if skip_sum else ())
    return run_pipeline(exported("v4", kind, dtype), ctx, skip=skip)


def _posts_with_y2(gm) -> list:
    posts = (OPS.hc_post.default, OPS.hc_post_bi.default, OPS.hc_post_pre.default)
    return [n for n in gm.graph.nodes if n.target in posts and len(n.args) in (5, 11)]


@pytest.mark.parametrize("kind,deterministic", [("decode", False), ("verify", False), ("prefill", False),
                                                ("decode", True)])
def test_in_the_pipeline_every_moe_sum_is_folded_and_the_outputs_are_unchanged(kind, deterministic):
    """The two-layer V4 (two MoE layers): both sums folded, no add left feeding a post-mix, outputs and cache
    writes bit-equal to the pipeline without the pass (the CPU ops are the model's functions)."""
    gm, recs = _pipeline(kind, deterministic, False)
    without, _ = _pipeline(kind, deterministic, True)
    assert next(r for r in recs if r.name == "fuse_moe_sum").stats["folded"] == 2
    assert len(_posts_with_y2(gm)) == 2 and _posts_with_y2(without) == []
    adds = sum(n.target is ADD for n in gm.graph.nodes)
    assert adds == sum(n.target is ADD for n in without.graph.nodes) - 2
    args = inputs("v4", kind)
    assert_same(run(gm, args), run(without, args))


def test_bf16_graphs_fold_and_keep_their_bits():
    """In bf16, where the sum rounds, the folded decode graph still gives the unfolded graph's bits."""
    gm, recs = _pipeline("decode", False, False, torch.bfloat16)
    without, _ = _pipeline("decode", False, True, torch.bfloat16)
    assert next(r for r in recs if r.name == "fuse_moe_sum").stats["folded"] == 2
    args = inputs("v4", "decode", torch.bfloat16)
    assert_same(run(gm, args), run(without, args))


def _graph(shape_b, other_user: bool = False, alpha: bool = False) -> torch.fx.GraphModule:
    """a + b (b of shape_b) viewed to [M, 1, D] and read by hc_post; fake values in meta."""
    g = torch.fx.Graph()
    M, N, D = 3, 4, 8
    vals = {"a": torch.empty(M, D), "b": torch.empty(*shape_b), "X": torch.empty(M, 1, N, D),
            "p": torch.empty(M, 1, N), "c": torch.empty(M, 1, N, N)}
    ph = {}
    for name, v in vals.items():
        ph[name] = g.placeholder(name)
        ph[name].meta["val"] = v
    s = g.call_function(ADD, (ph["a"], ph["b"]), {"alpha": 2} if alpha else {})
    s.meta["val"] = torch.empty(M, D)
    y = g.call_function(torch.ops.aten.view.default, (s, [M, 1, D]))
    y.meta["val"] = torch.empty(M, 1, D)
    x1 = g.call_function(OPS.hc_post.default, (y, ph["X"], ph["p"], ph["c"]))
    x1.meta["val"] = torch.empty(M, 1, N, D)
    g.output((x1, s) if other_user else (x1,))
    return torch.fx.GraphModule(torch.nn.Module(), g)


@pytest.mark.parametrize("case", ["broadcast", "other_user", "alpha"])
def test_sums_the_kernel_cannot_take_are_left_alone(case):
    """A broadcast addend, a sum read elsewhere, or an add with alpha: not the eager sum of two like tensors
    read once, so the graph stays as it is; the like, single-use sum in the same graph is folded."""
    ctx = PassContext(model().config, "h200", graph_kind="decode")
    gm = _graph((1, 8) if case == "broadcast" else (3, 8), other_user=case == "other_user", alpha=case == "alpha")
    assert fuse_moe_sum(gm, ctx).stats["folded"] == 0
    ok = fuse_moe_sum(_graph((3, 8)), ctx)
    assert ok.stats["folded"] == 1
    post = next(n for n in ok.graph.graph.nodes if n.target is OPS.hc_post.default)
    assert [a.target for a in (post.args[0], post.args[4])] == [torch.ops.aten.reshape.default] * 2
    assert not any(n.target is ADD for n in ok.graph.graph.nodes)
    g = torch.Generator().manual_seed(2)
    a, b, X = torch.randn(3, 8, generator=g), torch.randn(3, 8, generator=g), torch.randn(3, 1, 4, 8, generator=g)
    p, c = torch.rand(3, 1, 4, generator=g), torch.rand(3, 1, 4, 4, generator=g)
    got, = ok.graph(a, b, X, p, c)
    assert torch.equal(got, hc_post_ref((a + b).view(3, 1, 8), X, p, c))


def test_other_models_are_left_alone():
    v3 = ModelConfig.preset("v3-tiny")
    res = fuse_moe_sum(_graph((3, 8)), PassContext(v3, "cpu", graph_kind="decode"))
    assert not res.changed and "not a V4 model" in res.stats["skipped"]


_SM90_SCRIPT = textwrap.dedent('''
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from dsv4c.kernels import mhc

    def loads(fn, consts):
        """(global loads, loads before the PDL wait) in fn's sm_90 PTX, bf16 streams."""
        names = list(fn.arg_names)
        types = {nm: "*bf16" for nm in ("x_ptr", "y_ptr", "y2_ptr", "out_ptr")}
        sig = {nm: "constexpr" if nm in consts else types.get(nm, "*fp32" if nm.endswith("_ptr") else "i32")
               for nm in names}
        attrs = {(i,): [["tt.divisibility", 16]] for i, nm in enumerate(names) if nm.endswith("_ptr")}
        src = ASTSource(fn=fn, signature=sig, constexprs={(names.index(k),): v for k, v in consts.items()},
                        attrs=attrs)
        ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 2}).asm["ptx"]
        body = ptx[ptx.index(".entry"):]
        return body.count("ld.global"), body[:body.index("griddepcontrol.wait")].count("ld.global")

    for name, extra in (("_hc_post_kernel", {}), ("_hc_post_exact_kernel", {}),
                        ("_hc_post_mix_kernel", dict(MIXP=32, EARLY_FN=True))):
        for y2 in (False, True):
            c = dict(N=4, BLOCK_D=32, HAS_Y2=y2, RNE_BF16=False, PDL=True, **extra)
            print("kernel", name, int(y2), *loads(getattr(mhc, name), c))
''')


def test_kernels_with_y2_compile_for_sm90(tmp_path):
    """The three post-mix kernels compiled (not run) for sm_90 with and without y2: y2 adds global loads, all
    after the PDL wait (y2 is the previous kernel's output); before it only the mix kernel's fn, as without."""
    rows = {(r[0], r[1]): (int(r[2]), int(r[3])) for r in run_sm90_script(tmp_path, _SM90_SCRIPT)}
    for name in ("_hc_post_kernel", "_hc_post_exact_kernel", "_hc_post_mix_kernel"):
        (n0, early0), (n1, early1) = rows[(name, "0")], rows[(name, "1")]
        assert n1 > n0 and early1 == early0, (name, rows)
    assert rows[("_hc_post_kernel", "1")][1] == 0 and rows[("_hc_post_mix_kernel", "1")][1] > 0


# ---- CUDA (the device) ------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 8, 64])
def test_y2_on_cuda_at_flash_dims(m):
    """On the GPU (Flash dims, bf16): hc_post and the chained hc_post_pre with y2 give the bits of the same
    calls on the ATen sum y + y2."""
    y, y2, *rest = (a.cuda() for a in _case((m, 1), 4, 4096, torch.bfloat16, 30 + m))
    assert torch.equal(hc_post(y, *rest[:3], y2=y2), hc_post(y + y2, *rest[:3]))
    assert torch.equal(hc_post(y, *rest[:3], y2=y2, exact=True), hc_post(y + y2, *rest[:3], exact=True))
    got = hc_post_pre(y, *rest, EPS, HC_EPS, ITERS, y2=y2)
    for a, b in zip(got, hc_post_pre(y + y2, *rest, EPS, HC_EPS, ITERS)):
        assert torch.equal(a, b)
