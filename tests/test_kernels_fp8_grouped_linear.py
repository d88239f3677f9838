"""V4's grouped wo_a on its stored FP8 blocks (kernels/grouped_linear.py `fp8_grouped_linear`, the interpreter on
the CPU) and quantize_dense's rewrite of `dsv4c.grouped_linear` to it.

Kernel: against an fp64 einsum on the dequantised weight (the same function: per 128-column step the product
of exact e4m3 values, scaled per weight row, fp32 accumulation, one rounding), at token rows that take one,
two and four 16-row tiles, both scale forms (ue8m0 bytes, fp32), a weight whose R is not a multiple of the
32-row block and a scale tile that straddles two groups. Pass: a tiny V4 decode graph after
lower_grouped_linear rewrites every layer's wo_a and matches the eager logits within `dense_w8a16` (exactly
on the CPU: FP8-block values dequantise to the model's weights); deterministic graphs keep wo_a bf16.
"""
from __future__ import annotations

import copy
import textwrap

import pytest
import torch

from dsv4c import ModelConfig
from dsv4c import quant as Q
from dsv4c.kernels.grouped_linear import FP8_MAX_M, fp8_grouped_linear, fp8_grouped_linear_ref
from dsv4c.kernels.tolerances import KERNEL_REL_ERR, rel_err
from dsv4c.model import register_ops
from sm90_compile import run_sm90_script

register_ops()
KERNEL_REL = {torch.bfloat16: 1e-2, torch.float32: 1e-6}  # as tests/test_lower_grouped_linear.py's bf16 kernel


def _case(M, G, R, I, fmt="ue8m0", seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1, M, G, I, generator=g)
    w_q, w_s = Q.quant_fp8_block(torch.randn(G * R, I, generator=g) * 0.05, scale_fmt=fmt)
    return x.to(device), w_q.to(device), w_s.to(device)


def _exact(x, w_q, w_s, dtype):
    G = x.shape[2]
    w = Q.dequant_fp8_block(w_q.cpu(), w_s.cpu() if w_s.dtype != torch.uint8 else w_s.cpu().view(torch.float8_e8m0fnu))
    return torch.einsum("btgi,gri->btgr", x.cpu().to(dtype).double(), w.double().view(G, -1, w.shape[1]))


@pytest.mark.parametrize("M,G,R,I,fmt,dtype", [
    (1, 2, 128, 256, "ue8m0", torch.bfloat16),   # one token: one 16-row tile, mostly padding
    (20, 3, 80, 384, "fp32", torch.float32),     # two tiles; R = 80: a 128-row scale tile spans groups 0 and 1
    (64, 2, 40, 200, "ue8m0", torch.float32),    # four tiles; R, I not multiples of the blocks (masked tails)
    (0, 2, 128, 128, "ue8m0", torch.bfloat16),   # no rows
])
def test_kernel_matches_fp64(M, G, R, I, fmt, dtype):
    x, w_q, w_s = _case(M, G, R, I, fmt, seed=M + R)
    got = fp8_grouped_linear(x, w_q, w_s, dtype)
    assert got.shape == (1, M, G, R) and got.dtype == dtype
    if M:
        want = _exact(x, w_q, w_s, dtype)
        assert rel_err(got, want) <= KERNEL_REL[dtype]
        assert rel_err(fp8_grouped_linear_ref(x, w_q, w_s, dtype), want) <= KERNEL_REL[dtype]
        assert rel_err(got, want.roll(1, 2)) > 0.3  # each group reads its own rows
        if fmt == "ue8m0":  # the uint8 bytes a graph carries give the same bits
            assert torch.equal(fp8_grouped_linear(x, w_q, w_s.view(torch.uint8), dtype), got)
        op = torch.ops.dsv4c.fp8_grouped_linear(x, w_q, w_s, dtype)  # CPU: the reference
        assert torch.equal(op, fp8_grouped_linear_ref(x, w_q, w_s, dtype))
        for bm in (32, 64):  # larger token tiles: the same function
            assert rel_err(fp8_grouped_linear(x, w_q, w_s, dtype, block_m=bm), want) <= KERNEL_REL[dtype], bm


@pytest.mark.parametrize("fmt", ["ue8m0", "fp32"])
def test_one_bf16_token_runs_the_block_diagonal_gemv(monkeypatch, fmt):
    """One token row already in the output dtype, FP8_GEMV_MAX_M = 1 (the default): the dense FP8 decode GEMV
    with each tile's activations taken from its group's columns (R = 64: a 128-row scale tile spans two groups;
    I = 640: a partial 512-column step). Within the bf16 bound of the fp64 einsum, close to the 16-row tile's
    result, and not the tile's launch."""
    import dsv4c.kernels.grouped_linear as GL

    x, w_q, w_s = _case(1, 3, 64, 640, fmt, seed=5)
    x = x.to(torch.bfloat16)
    calls = []
    real = GL.fp8_gemv_grouped_w8a16
    monkeypatch.setattr(GL, "fp8_gemv_grouped_w8a16", lambda *a, **k: calls.append(a[3]) or real(*a, **k))
    monkeypatch.setattr(GL, "FP8_GEMV_MAX_M", 1)
    got = fp8_grouped_linear(x, w_q, w_s, torch.bfloat16)
    want = _exact(x, w_q, w_s, torch.bfloat16)
    assert calls == [3] and got.shape == (1, 1, 3, 64) and got.dtype == torch.bfloat16
    assert rel_err(got, want) <= KERNEL_REL[torch.bfloat16]
    assert rel_err(got, want.roll(1, 2)) > 0.3  # each group reads its own columns
    monkeypatch.setattr(GL, "FP8_GEMV_MAX_M", 0)
    tile = fp8_grouped_linear(x, w_q, w_s, torch.bfloat16)
    assert calls == [3] and rel_err(got, tile) <= KERNEL_REL[torch.bfloat16]
    monkeypatch.setattr(GL, "FP8_GEMV_MAX_M", 1)
    fp32_out = fp8_grouped_linear(x, w_q, w_s, torch.float32)  # fp32 output: the tile (its ieee dot)
    assert calls == [3] and rel_err(fp32_out, want) <= 1e-2


def test_one_fp32_token_is_rounded_by_the_gemv(monkeypatch):
    """The decode graph's wo_a input is fp32 (the attention's output; the op casts it): with FP8_GEMV_MAX_M = 1 one
    fp32 row runs the GEMV, which rounds it to bf16 first, as the tile does. Its result is then the one of the
    bf16-rounded row (fp32 products of the same values), and not the one of the unrounded row."""
    import dsv4c.kernels.grouped_linear as GL
    from dsv4c.kernels.fp8_gemv import fp8_gemv_grouped_w8a16, fp8_gemv_grouped_w8a16_ref

    x, w_q, w_s = _case(1, 2, 64, 256, seed=8)
    x = x + 1e-3 * torch.randn(x.shape, generator=torch.Generator().manual_seed(1))  # bits below bf16's
    calls = []
    real = GL.fp8_gemv_grouped_w8a16
    monkeypatch.setattr(GL, "fp8_gemv_grouped_w8a16", lambda *a, **k: calls.append(a[0].dtype) or real(*a, **k))
    monkeypatch.setattr(GL, "FP8_GEMV_MAX_M", 1)
    got = fp8_grouped_linear(x, w_q, w_s, torch.bfloat16)
    rounded = fp8_grouped_linear(x.to(torch.bfloat16), w_q, w_s, torch.bfloat16)
    assert calls == [torch.float32, torch.bfloat16] and torch.equal(got, rounded)
    a = x.reshape(1, -1)
    assert torch.equal(fp8_gemv_grouped_w8a16_ref(a, w_q, w_s, 2), fp8_gemv_grouped_w8a16_ref(
        a.to(torch.bfloat16), w_q, w_s, 2))
    exact32 = fp8_gemv_grouped_w8a16_ref(a, w_q, w_s, 2, out_dtype=torch.float16)  # rounded to fp16 instead
    assert not torch.equal(exact32, fp8_gemv_grouped_w8a16_ref(a, w_q, w_s, 2))
    with pytest.raises(ValueError, match="or fp32 with a bf16/fp16 out_dtype"):
        fp8_gemv_grouped_w8a16(a, w_q, w_s, 2, out_dtype=torch.float32)


def test_fp32_token_rows_on_the_tensor_core_gemv(monkeypatch):
    """Up to FP8_GEMV_MAX_M (1 by default; 16 here) fp32 token rows run the GEMV's tensor-core tile, which rounds
    them to bf16 before the MMA: the bits of the bf16-rounded rows, with the 16-row tile's result within bf16."""
    import dsv4c.kernels.grouped_linear as GL
    from dsv4c.kernels.fp8_gemv import Fp8GemvConfig, fp8_gemv_grouped_w8a16

    x, w_q, w_s = _case(3, 2, 64, 256, seed=12)
    x = x + 1e-3 * torch.randn(x.shape, generator=torch.Generator().manual_seed(2))  # bits below bf16's
    a = x.reshape(3, -1)
    cfg = Fp8GemvConfig(16, 32, 128, 2)
    got = fp8_gemv_grouped_w8a16(a, w_q, w_s, 2, config=cfg)
    assert torch.equal(got, fp8_gemv_grouped_w8a16(a.to(torch.bfloat16), w_q, w_s, 2, config=cfg))
    calls = []
    real = GL.fp8_gemv_grouped_w8a16
    monkeypatch.setattr(GL, "fp8_gemv_grouped_w8a16", lambda *a, **k: calls.append(a[0].shape) or real(*a, **k))
    monkeypatch.setattr(GL, "FP8_GEMV_MAX_M", 16)
    gemv = fp8_grouped_linear(x, w_q, w_s, torch.bfloat16)
    assert calls == [(3, 512)] and torch.equal(gemv, fp8_grouped_linear(x.to(torch.bfloat16), w_q, w_s, torch.bfloat16))
    monkeypatch.setattr(GL, "FP8_GEMV_MAX_M", 1)
    tile = fp8_grouped_linear(x, w_q, w_s, torch.bfloat16)
    assert len(calls) == 2 and rel_err(gemv, tile) <= KERNEL_REL[torch.bfloat16]
    assert rel_err(gemv, _exact(x.to(torch.bfloat16), w_q, w_s, torch.bfloat16)) <= KERNEL_REL[torch.bfloat16]


def test_grouped_gemv_rows_and_errors():
    """`fp8_gemv_grouped_w8a16` directly: several token rows on the tensor-core path, and its contracts."""
    from dsv4c.kernels.fp8_gemv import Fp8GemvConfig, fp8_gemv_grouped_w8a16, fp8_gemv_grouped_w8a16_ref

    x, w_q, w_s = _case(3, 2, 128, 256, seed=9)
    a = x.to(torch.bfloat16).view(3, -1)
    got = fp8_gemv_grouped_w8a16(a, w_q, w_s, 2, config=Fp8GemvConfig(16, 64, 128, 2))
    want = fp8_gemv_grouped_w8a16_ref(a, w_q, w_s, 2)
    assert rel_err(got, want) <= KERNEL_REL[torch.bfloat16]
    assert rel_err(want.view(1, 3, 2, 128), _exact(x.to(torch.bfloat16), w_q, w_s, torch.bfloat16)) <= 1e-6
    x3, w3, s3 = _case(1, 2, 48, 256, seed=3)  # R = 48: the default tile's 32 rows halve to 16
    a3 = x3.to(torch.bfloat16).view(1, -1)
    assert rel_err(fp8_gemv_grouped_w8a16(a3, w3, s3, 2), fp8_gemv_grouped_w8a16_ref(a3, w3, s3, 2)) <= 1e-2
    with pytest.raises(ValueError, match="block_n = 64 does not divide the 32 weight rows"):
        x4, w4, s4 = _case(1, 4, 32, 256)
        fp8_gemv_grouped_w8a16(x4.to(torch.bfloat16).view(1, -1), w4, s4, 4, config=Fp8GemvConfig(1, 64))
    with pytest.raises(ValueError, match="groups: 3 must divide"):
        fp8_gemv_grouped_w8a16(a, w_q, w_s, 3)
    with pytest.raises(ValueError, match="a: expected bf16/fp16"):
        fp8_gemv_grouped_w8a16(a.double()[:1], w_q, w_s, 2)


def test_bad_input_names_the_tensor():
    x, w_q, w_s = _case(2, 2, 128, 256)
    with pytest.raises(ValueError, match=r"\[B, T, G, I\]"):
        fp8_grouped_linear(x[0], w_q, w_s, torch.bfloat16)
    with pytest.raises(ValueError, match="does not split into x's G = 3"):
        fp8_grouped_linear(torch.zeros(1, 2, 3, 256), w_q, w_s, torch.bfloat16)
    with pytest.raises(ValueError, match="w_s"):
        fp8_grouped_linear(x, w_q, w_s[:1], torch.bfloat16)
    with pytest.raises(ValueError, match="w_q"):
        fp8_grouped_linear(x, w_q.float(), w_s, torch.bfloat16)
    with pytest.raises(ValueError, match="float32/bfloat16/float16"):
        fp8_grouped_linear(x, w_q, w_s, torch.float64)
    with pytest.raises(ValueError, match="block_m"):
        fp8_grouped_linear(x, w_q, w_s, torch.bfloat16, block_m=8)
    big = torch.zeros(1, FP8_MAX_M + 1, 2, 256)
    with pytest.raises(ValueError, match="FP8_MAX_M"):
        fp8_grouped_linear(big, w_q, w_s, torch.bfloat16)
    assert torch.ops.dsv4c.fp8_grouped_linear(big, w_q, w_s, torch.bfloat16).shape == (1, FP8_MAX_M + 1, 2, 128)


@torch.no_grad()
def test_quantize_dense_rewrites_the_grouped_wo_a():
    from dsv4c.checkpoint import release_format
    from dsv4c.compare import _cases, _run
    from dsv4c.export import export_graph
    from dsv4c.model import build_model
    from dsv4c.passes import PassContext, default_pipeline, run_pipeline
    from dsv4c.passes.quantize_dense import quantize_dense_as

    cfg = ModelConfig.preset("v4-tiny-a").replace(hidden_size=128, q_lora_rank=128, o_lora_rank=96,
                                                  moe_intermediate_size=128)
    torch.manual_seed(0)
    m = build_model(cfg)
    for name, p in m.named_parameters():  # the release's FP8 weights as loading the checkpoint gives them
        if release_format(cfg, name) == "fp8":
            q, s = Q.quant_fp8_block(p.detach().float())
            p.data.copy_(Q.dequant_fp8_block(q, Q.e8m0_to_float(s)))
    case = _cases(m, ["decode"], k=0, seed=0)[0]
    gm = export_graph(m, case.spec).module()
    lower = [p for p in default_pipeline() if p[0] in ("fuse_projections", "lower_grouped_linear")]
    gm, _ = run_pipeline(gm, PassContext(cfg, "h200", "decode"), passes=lower)
    grouped = torch.ops.dsv4c.grouped_linear.default
    assert sum(n.target is grouped for n in gm.graph.nodes) == cfg.num_hidden_layers
    for fmt in ("fp8_block_w8a16", "fp8_block"):
        g2, recs = run_pipeline(copy.deepcopy(gm), PassContext(cfg, "h200", "decode"),
                                passes=[("quantize_dense", quantize_dense_as(fmt))])
        recs = [r for r in recs[0].stats["linears"] if r.get("grouped")]
        assert [r["weight"] for r in recs] == [f"model.layers.{i}.attn.wo_a.weight"
                                                for i in range(cfg.num_hidden_layers)]
        assert all(r["kernel"] == "w8a16" and r["shape"] == [2 * 96, 128] for r in recs)  # [G·R, I] as stored
        assert ("W8A8" in recs[0].get("why", "")) == (fmt == "fp8_block")
        ops = [n.target for n in g2.graph.nodes if n.op == "call_function"]
        assert grouped not in ops and ops.count(torch.ops.dsv4c.fp8_grouped_linear.default) == len(recs)
        attrs = {n.target for n in g2.graph.nodes if n.op == "get_attr"}
        assert not {r["weight"] for r in recs} & attrs  # the bf16 wo_a left the graph
        if fmt == "fp8_block_w8a16":
            assert rel_err(_run(g2, case), case.ref) <= KERNEL_REL_ERR["dense_w8a16"]
    g3, recs = run_pipeline(copy.deepcopy(gm), PassContext(cfg, "h200", "decode", deterministic=True),
                            passes=[("quantize_dense", quantize_dense_as("fp8_block_w8a16"))])
    kept = [k for k in recs[0].stats["kept"] if ".wo_a." in k["weight"]]
    assert len(kept) == cfg.num_hidden_layers and all("deterministic" in k["why"] for k in kept)
    assert sum(n.target is grouped for n in g3.graph.nodes) == cfg.num_hidden_layers


@pytest.mark.gpu
def test_kernel_on_gpu_at_flash_shapes(monkeypatch):
    """Flash's wo_a (G = 8, R = 1024, I = 4096) at 1 / 8 / 64 token rows (the kernel) and 100 (the op widens the
    weight for the einsum): within the bf16 bound of the fp64 einsum; the op equals the kernel where it runs it;
    the 64-row tile too; one bf16 token on the block-diagonal GEMV, close to the tile."""
    for M in (1, 8, 64, 100):
        x, w_q, w_s = _case(M, 8, 1024, 4096, seed=M, device="cuda")
        got = torch.ops.dsv4c.fp8_grouped_linear(x, w_q, w_s.view(torch.uint8), torch.bfloat16)
        assert rel_err(got.cpu(), _exact(x, w_q, w_s, torch.bfloat16)) <= KERNEL_REL[torch.bfloat16], M
        if M <= FP8_MAX_M:
            assert torch.equal(got, fp8_grouped_linear(x, w_q, w_s, torch.bfloat16)), M
            wide = fp8_grouped_linear(x, w_q, w_s, torch.bfloat16, block_m=64)  # one tile of up to 64 rows
            assert rel_err(wide.cpu(), _exact(x, w_q, w_s, torch.bfloat16)) <= KERNEL_REL[torch.bfloat16], M
    x, w_q, w_s = _case(1, 8, 1024, 4096, seed=7, device="cuda")
    x = x.to(torch.bfloat16)  # one bf16 token: the block-diagonal GEMV (FP8_GEMV_MAX_M)
    import dsv4c.kernels.grouped_linear as GL

    monkeypatch.setattr(GL, "FP8_GEMV_MAX_M", 1)
    got = fp8_grouped_linear(x, w_q, w_s.view(torch.uint8), torch.bfloat16)
    assert rel_err(got.cpu(), _exact(x, w_q, w_s, torch.bfloat16)) <= KERNEL_REL[torch.bfloat16]
    monkeypatch.setattr(GL, "FP8_GEMV_MAX_M", 0)
    tile = fp8_grouped_linear(x, w_q, w_s.view(torch.uint8), torch.bfloat16)
    assert rel_err(got.cpu(), tile.cpu()) <= KERNEL_REL[torch.bfloat16]


@pytest.mark.gpu
def test_fp32_rows_on_gpu_round_like_bf16(monkeypatch):
    """Flash's wo_a at 1 and 8 fp32 token rows (the decode graph's input) on the GEMV: the bits of the bf16-rounded
    rows' GEMV, within the bf16 bound of the fp64 einsum."""
    import dsv4c.kernels.grouped_linear as GL

    monkeypatch.setattr(GL, "FP8_GEMV_MAX_M", 16)
    for M in (1, 8):  # one token on CUDA cores, 8 on the tensor-core tile (FP8_GEMV_MAX_M 16: off by default)
        x, w_q, w_s = _case(M, 8, 1024, 4096, seed=8, device="cuda")
        got = fp8_grouped_linear(x, w_q, w_s, torch.bfloat16)
        assert torch.equal(got, fp8_grouped_linear(x.to(torch.bfloat16), w_q, w_s, torch.bfloat16)), M
        assert rel_err(got.cpu(), _exact(x, w_q, w_s, torch.bfloat16)) <= KERNEL_REL[torch.bfloat16], M


_SM90_SCRIPT = textwrap.dedent('''
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from dsv4c.kernels.grouped_linear import _fp8_grouped_kernel as fn

    names = list(fn.arg_names)
    types = {"x_ptr": "*fp32", "w_ptr": "*fp8e4nv", "ws_ptr": "*u8", "z_ptr": "*bf16"}
    consts = dict(I=4096, BLOCK_M=16, BLOCK_R=32, BLOCK_I=128, WS_E8M0=True, F32=False, INTERPRET=False, PDL=True)
    sig = {nm: "constexpr" if nm in consts else types.get(nm, "i32") for nm in names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, nm in enumerate(names) if nm.endswith("_ptr")}
    src = ASTSource(fn=fn, signature=sig, constexprs={(names.index(k),): v for k, v in consts.items()}, attrs=attrs)
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "num_stages": 4}).asm["ptx"]
    print("kernel", int("mma" in ptx), int("cp.async" in ptx), int("griddepcontrol.wait" in ptx))
''')


def test_kernel_compiles_for_sm90(tmp_path):
    """Compiled (not run) for sm_90: tensor-core MMAs, the loads software-pipelined (cp.async), and the
    programmatic-dependent-launch wait the step-wide PDL chain needs."""
    assert run_sm90_script(tmp_path, _SM90_SCRIPT) == [["1", "1", "1"]]
