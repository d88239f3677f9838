"""V4's grouped output projection: the Triton kernel (kernels/grouped_linear.py, interpreter on the CPU),
its custom op, and the lower_grouped_linear pass."""
from __future__ import annotations

import pytest
import torch

from dsv4c.kernels.grouped_linear import MAX_M, grouped_linear, grouped_linear_ref
from dsv4c.kernels.tolerances import rel_err
from dsv4c.model import register_ops
from dsv4c.passes import PassContext, verify
from dsv4c.passes.lower_grouped_linear import lower_grouped_linear
from dsv4c.passes.split_at_routers import OP_CAPTURE, host_sync_ops, reference_impl
from fusion_cases import assert_same, exported, inputs, model, run

register_ops()

# kernel vs an fp64 einsum of the same (cast) operands, relative norm: fp32 accumulation of exact
# bf16 products, one rounding of z (bf16: 2^-9 relative; the interpreter truncates, < 2^-8)
KERNEL_REL = {torch.bfloat16: 1e-2, torch.float32: 1e-6}
GRAPH_REL = 2e-6  # fp32 decode graph with the Triton kernel (interpreter) in place of the op


def _case(B, T, G, R, I, x_dtype, w_dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, T, G, I, generator=g).to(x_dtype)
    w = (torch.randn(G, R, I, generator=g) / I**0.5).to(w_dtype)
    return x, w


def _exact(x, w):
    return torch.einsum("btgi,gri->btgr", x.to(w.dtype).double(), w.double())


@pytest.mark.parametrize("B,T,G,R,I,x_dtype,w_dtype", [
    (1, 1, 2, 16, 64, torch.float32, torch.bfloat16),    # fp32 attention output, bf16 weight: cast inside
    (2, 3, 3, 40, 300, torch.bfloat16, torch.bfloat16),   # R, I not block multiples
    (1, 16, 2, 33, 257, torch.float32, torch.float32),    # M = MAX_M rows, fp32 model
    (4, 1, 8, 64, 128, torch.float32, torch.bfloat16),
    (0, 1, 2, 16, 64, torch.float32, torch.bfloat16),     # no rows
])
def test_kernel_matches_fp64(B, T, G, R, I, x_dtype, w_dtype):
    x, w = _case(B, T, G, R, I, x_dtype, w_dtype, seed=B + R)
    got = grouped_linear(x, w)
    want = _exact(x, w)
    assert got.shape == (B, T, G, R) and got.dtype == w_dtype
    if got.numel():
        assert rel_err(got, want) <= KERNEL_REL[w_dtype]
        assert rel_err(grouped_linear_ref(x, w), want) <= KERNEL_REL[w_dtype]
        assert rel_err(got, want.roll(1, 2)) > 0.3  # groups use their own weights


def test_bad_input_and_the_op():
    x, w = _case(1, 1, 2, 16, 64, torch.float32, torch.bfloat16)
    with pytest.raises(ValueError, match="does not match w"):
        grouped_linear(x[..., :32], w)
    with pytest.raises(ValueError, match=r"must be \[B, T, G, I\]"):
        grouped_linear(x[0], w)
    with pytest.raises(ValueError, match="float32/bfloat16/float16"):
        grouped_linear(x.double(), w)
    with pytest.raises(ValueError, match="exceed the kernel's MAX_M"):
        grouped_linear(torch.zeros(1, MAX_M + 1, 2, 64), w)
    assert torch.equal(torch.ops.dsv4c.grouped_linear(x, w), grouped_linear_ref(x, w))  # CPU: the reference
    with torch._subclasses.FakeTensorMode() as mode:
        fake = torch.ops.dsv4c.grouped_linear(mode.from_tensor(x), mode.from_tensor(w))
    assert fake.shape == (1, 1, 2, 16) and fake.dtype == torch.bfloat16
    assert OP_CAPTURE["dsv4c.grouped_linear"] is None
    assert host_sync_ops(reference_impl("dsv4c.grouped_linear"), x, w) == []


@pytest.mark.parametrize("kind,dtype", [("decode", torch.float32), ("verify", torch.bfloat16),
                                        ("mtp", torch.float32), ("prefill", torch.bfloat16)])
def test_pass_rewrites_every_layer_bit_exact(kind, dtype):
    m = model("v4", dtype)
    gm = exported("v4", kind, dtype)
    ref = exported("v4", kind, dtype)
    ctx = PassContext(m.config, "h200", graph_kind=kind)
    res = lower_grouped_linear(gm, ctx)
    verify(gm, ctx, after="lower_grouped_linear")
    layers = 1 if kind == "mtp" else m.config.num_hidden_layers
    assert res.stats["sites"] == layers
    assert res.stats["casts_folded"] == layers  # the model's cast of o (a no-op in an fp32 model)
    ops = [(n.target, n.args[0]) for n in gm.graph.nodes if n.op == "call_function"]
    assert (torch.ops.aten.einsum.default, "btgi,gri->btgr") not in ops
    assert sum(t is torch.ops.dsv4c.grouped_linear.default for t, _ in ops) == layers
    args = inputs("v4", kind, dtype)
    assert_same(run(gm, args), run(ref, args))  # the CPU op is the model's cast + einsum
    assert not lower_grouped_linear(gm, ctx).changed


def test_graph_with_the_triton_kernel_matches():
    m = model("v4")
    gm = exported("v4", "verify")
    lower_grouped_linear(gm, PassContext(m.config, "h200", graph_kind="verify"))
    for n in gm.graph.nodes:
        if n.target is torch.ops.dsv4c.grouped_linear.default:
            n.target = grouped_linear
    gm.recompile()
    args = inputs("v4", "verify")
    assert_same(run(gm, args), run(exported("v4", "verify"), args), rel=GRAPH_REL)


def test_v3_graphs_are_untouched():
    m = model("v3-tiny")
    gm = exported("v3-tiny", "decode")
    res = lower_grouped_linear(gm, PassContext(m.config, "h200", graph_kind="decode"))
    assert not res.changed and res.stats["sites"] == 0


@pytest.mark.gpu
def test_fp32_on_cuda_is_not_tf32():
    """An fp32 model's projection: IEEE fp32 products (TF32 would give ~1e-3)."""
    x, w = _case(2, 3, 2, 40, 300, torch.float32, torch.float32, seed=5)
    got = torch.ops.dsv4c.grouped_linear(x.cuda(), w.cuda()).cpu()
    assert rel_err(got, _exact(x, w)) <= KERNEL_REL[torch.float32]


@pytest.mark.gpu
@pytest.mark.parametrize("M", [1, 8, 16])
def test_on_cuda_at_flash_dims(M):
    x, w = _case(1, M, 8, 1024, 4096, torch.float32, torch.bfloat16, seed=M)
    x, w = x.cuda(), w.cuda()
    got = torch.ops.dsv4c.grouped_linear(x, w)
    assert rel_err(got, _exact(x, w)) <= 5e-3
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = torch.ops.dsv4c.grouped_linear(x, w)
    x.copy_(torch.randn_like(x))
    graph.replay()
    assert rel_err(out, _exact(x, w)) <= 5e-3
