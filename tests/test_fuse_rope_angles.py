"""The RoPE angle-table kernel (kernels/rope_angles.py), its custom op and the fuse_rope_angles pass."""
from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap

import pytest
import torch

from dsv4c import ModelConfig
from dsv4c.kernels.rope_angles import rope_angles, rope_angles_ref
from dsv4c.model import register_ops
from dsv4c.model.common import rope_inv_freq
from dsv4c.passes import PassContext, verify
from dsv4c.passes.fuse_rope_angles import fuse_rope_angles
from dsv4c.passes.split_at_routers import OP_CAPTURE, host_sync_ops, reference_impl
from fusion_cases import assert_in_capturable_segments, pipeline_pair, swap_targets
from fusion_cases import (assert_same as _assert_same, exported as _exported, inputs as _inputs, max_rel as _max_rel,
                           model as _model, run as _run)

register_ops()

# Max absolute error of cos/sin against fp64 cos/sin of the same fp32-rounded angle (|value| <= 1,
# so 1 ulp near 1 is 6e-8). Interpreter: numpy's float32 cos/sin (measured <= 6.9e-8 on 768 rows of
# Flash tables at positions up to 1e6; torch's CPU cos/sin: 3.6e-8); against the model's torch CPU
# cos/sin (measured <= 6.0e-8).
CPU_ABS = 1.5e-7
# CUDA: libdevice __nv_cosf/__nv_sinf, <= 2 ulp by NVIDIA's table (1.2e-7 near 1); 2e-6 leaves room
# and still fails a kernel with `cos.approx`/`sin.approx` (absolute error ~1e-4 at |angle| ~1e6) or
# with a product that is not the fp32 one (fp64 product: up to 3e-2 at position 1e6).
GPU_ABS = 2e-6
# fused graph with the Triton kernel (interpreter) in place of the op, against the unfused graph
# (fp32 tiny V4; measured max_rel <= 3.6e-7 on decode/verify outputs and caches)
GRAPH_REL = 2e-6
OP = torch.ops.dsv4c.rope_angles.default
aten = torch.ops.aten


def _fp64_table(pos0: torch.Tensor, inv_freq: torch.Tensor, T: int):
    """cos/sin in fp64 of the fp32-rounded angle fp32(pos0[b] + t) · inv_freq[j] (the product rounded once)."""
    pos = (pos0[:, None] + torch.arange(T, device=pos0.device)).float()
    ang = pos[..., None] * inv_freq  # fp32 IEEE product
    return ang.double().cos(), ang.double().sin()


def _err(cos, sin, rc, rs) -> float:
    return max((cos.double() - rc.double()).abs().max().item(), (sin.double() - rs.double()).abs().max().item())


def _flash_tables() -> dict[str, torch.Tensor]:
    """V4-Flash's two frequency tables (r = 64): the SWA layers' theta 10000 and the compressed layers' YaRN."""
    cfg = ModelConfig.preset("v4-flash-slice")
    r = cfg.qk_rope_head_dim
    return {"theta": rope_inv_freq(r, cfg.rope_theta, None),
            "yarn": rope_inv_freq(r, cfg.compress_rope_theta, cfg.rope_scaling)}


# ---- the kernel (Triton interpreter on CPU) -----------------------------------------------------
@pytest.mark.parametrize("half", [8, 32])
@pytest.mark.parametrize("B", [1, 3])
@pytest.mark.parametrize("T", [1, 3])
def test_kernel_matches_fp64_and_the_model(half, B, T):
    pos0 = torch.tensor([0, 999_997, 4_321][:B] if B > 1 else [999_999])
    for inv_freq in (rope_inv_freq(2 * half, 10000.0, None), rope_inv_freq(2 * half, 160000.0, _flash_yarn())):
        cos, sin = rope_angles(pos0, inv_freq, T)
        assert cos.shape == sin.shape == (B, T, half) and cos.dtype == sin.dtype == torch.float32
        assert cos.is_contiguous() and sin.is_contiguous()
        assert _err(cos, sin, *_fp64_table(pos0, inv_freq, T)) <= CPU_ABS
        assert _err(cos, sin, *rope_angles_ref(pos0, inv_freq, T)) <= CPU_ABS
    if B > 1:  # position 0: exactly cos 1, sin 0
        assert torch.equal(cos[0, 0], torch.ones(half)) and torch.equal(sin[0, 0], torch.zeros(half))


def _flash_yarn():
    return ModelConfig.preset("v4-flash-slice").rope_scaling


def test_kernel_rounds_the_angle_in_fp32_at_large_positions():
    """Many rows of large positions (several row blocks): the kernel's values are those of the fp32
    angle; the fp64 angle's would be far off (this is what the fp32 reference resolves)."""
    g = torch.Generator().manual_seed(0)
    pos0 = torch.randint(900_000, 1_000_000, (40,), generator=g)
    inv_freq = _flash_tables()["theta"]
    cos, sin = rope_angles(pos0, inv_freq, 3)
    rc, rs = _fp64_table(pos0, inv_freq, 3)
    assert _err(cos, sin, rc, rs) <= CPU_ABS
    ang64 = (pos0[:, None] + torch.arange(3)).double()[..., None] * inv_freq.double()
    assert (cos.double() - ang64.cos()).abs().max() > 1e-3  # the fp32 product differs from the exact one


def test_no_rows_launch_nothing():
    cos, sin = rope_angles(torch.zeros(0, dtype=torch.int64), torch.ones(4), 3)
    assert cos.shape == sin.shape == (0, 3, 4)
    cos, sin = rope_angles(torch.zeros(2, dtype=torch.int64), torch.ones(4), 0)
    assert cos.shape == (2, 0, 4)


@pytest.mark.parametrize("call,err", [
    (lambda: rope_angles(torch.zeros(2, dtype=torch.int32), torch.ones(4), 1), "pos0 must be a 1-D int64"),
    (lambda: rope_angles(torch.zeros(2, 1, dtype=torch.int64), torch.ones(4), 1), "pos0 must be a 1-D int64"),
    (lambda: rope_angles(torch.zeros(2, dtype=torch.int64), torch.ones(4, dtype=torch.float64), 1),
     "inv_freq must be a non-empty 1-D float32"),
    (lambda: rope_angles(torch.zeros(2, dtype=torch.int64), torch.ones(2, 4), 1), "inv_freq must be"),
    (lambda: rope_angles(torch.zeros(2, dtype=torch.int64), torch.ones(0), 1), "inv_freq must be"),
    (lambda: rope_angles(torch.zeros(2, dtype=torch.int64), torch.ones(4), -1), "T must be >= 0"),
    (lambda: torch.ops.dsv4c.rope_angles(torch.zeros(2), torch.ones(4), 1), "pos0 must be"),
    (lambda: torch.ops.dsv4c.rope_angles(torch.zeros(2, dtype=torch.int64), torch.ones(4, dtype=torch.bfloat16), 1),
     "inv_freq must be"),
])
def test_bad_input_is_rejected_naming_the_tensor(call, err):
    with pytest.raises(ValueError, match=err):
        call()


_SM90_SCRIPT = textwrap.dedent('''
    import re, sys, triton, triton.language as tl
    from triton.compiler import ASTSource
    from triton.backends.compiler import GPUTarget
    from dsv4c.kernels.rope_angles import _rope_angles_kernel

    def ptx(fn, sig, consts, ptrs, warps):
        src = ASTSource(fn=fn, signature=sig, constexprs=consts, attrs={(i,): [["tt.divisibility", 16]] for i in ptrs})
        return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps}).asm["ptx"]

    sig = {"pos0_ptr": "*i64", "inv_freq_ptr": "*fp32", "cos_ptr": "*fp32", "sin_ptr": "*fp32", "rows": "i32",
           "T": "i32", "HALF": "constexpr", "BLOCK_R": "constexpr", "BLOCK_HALF": "constexpr", "INTERPRET": "constexpr",
           "PDL": "constexpr"}
    for half, block_r, warps in ((32, 1, 1), (32, 32, 4), (8, 1, 1)):
        p = ptx(_rope_angles_kernel, sig, {(6,): half, (7,): block_r, (8,): triton.next_power_of_2(half), (9,): False,
                                     (10,): True},
                range(4), warps)
        # every use of a converted position is a mul.rn (the angle, rounded once, not contracted)
        pos = re.findall(r"cvt\\.rn\\.f32\\.s64\\s+(%r\\d+)", p)
        uses = [ln.split()[0] for r in pos for ln in p.splitlines()
                if re.search(re.escape(r) + r"\\b", ln) and not ln.lstrip().startswith("cvt.rn.f32.s64")]
        print("kernel", half, block_r, len(re.findall(r"\\b(?:sin|cos)\\.approx", p)),
              int(bool(pos) and bool(uses) and all(u.startswith("mul.rn") for u in uses)),
              int("__nv_cosf" in p and "__nv_sinf" in p))
''')


def test_compiles_for_sm90_without_approximate_sine_or_cosine(tmp_path):
    """Compile (not run) for sm_90 with the real Triton compiler in a subprocess (the tests import
    kernels under TRITON_INTERPRET=1): the PTX inlines libdevice's __nv_cosf/__nv_sinf (their labels
    stay in it), holds no `sin.approx`/`cos.approx` and rounds the angle with `mul.rn`."""
    script = tmp_path / "sm90.py"
    script.write_text(_SM90_SCRIPT)
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_CACHE_DIR": str(tmp_path / "cache")}
    res = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300,
                         check=False)
    if res.returncode != 0 and re.search(r"ptxas|nvlink|No such file", res.stderr):
        pytest.skip(f"no CUDA toolchain for the sm_90 compile: {res.stderr[-300:]}")
    assert res.returncode == 0, res.stderr[-2000:]
    lines = [ln.split() for ln in res.stdout.splitlines()]
    kernels = [ln for ln in lines if ln[0] == "kernel"]
    assert len(kernels) == 3 and all(ln[3:] == ["0", "1", "1"] for ln in kernels), res.stdout


# ---- the custom op --------------------------------------------------------------------------------
def test_op_is_the_model_function_on_cpu_fake_and_capture_safe():
    pos0, inv_freq = torch.tensor([0, 17, 999_999]), _flash_tables()["yarn"]
    cos, sin = torch.ops.dsv4c.rope_angles(pos0, inv_freq, 3)
    rc, rs = rope_angles_ref(pos0, inv_freq, 3)
    assert torch.equal(cos, rc) and torch.equal(sin, rs)
    assert str(OP._schema) == "dsv4c::rope_angles(Tensor pos0, Tensor inv_freq, SymInt T) -> (Tensor, Tensor)"
    with torch._subclasses.FakeTensorMode() as mode:
        fc, fs = torch.ops.dsv4c.rope_angles(mode.from_tensor(pos0), mode.from_tensor(inv_freq), 5)
    assert (fc.shape, fc.dtype, fs.shape, fs.dtype) == ((3, 5, 32), torch.float32, (3, 5, 32), torch.float32)
    assert "dsv4c.rope_angles" in OP_CAPTURE and OP_CAPTURE["dsv4c.rope_angles"] is None
    assert host_sync_ops(reference_impl("dsv4c.rope_angles"), pos0, inv_freq, 3) == []


# ---- the pass ------------------------------------------------------------------------------------
def _count(gm, op) -> int:
    return sum(nd.target is op for nd in gm.graph.nodes)


def _expected(name, kind) -> int:
    """One table per V4 attention layer (the MTP graph: the MTP block's one)."""
    return 1 if kind == "mtp" else _model(name).config.num_hidden_layers


@pytest.mark.parametrize("kind,dtype,T", [
    ("decode", torch.float32, 1),
    ("verify", torch.float32, 3),
    ("mtp", torch.float32, 3),
    ("prefill", torch.bfloat16, None),  # symbolic chunk size
])
def test_pass_fuses_every_v4_table_bit_exact(kind, dtype, T):
    model = _model("v4", dtype)
    ctx = PassContext(model.config, "cpu", graph_kind=kind)
    ref_gm = _exported("v4", kind, dtype)
    gm = _exported("v4", kind, dtype)
    assert _count(gm, aten.cos.default) == _count(gm, aten.arange.default) == _expected("v4", kind)
    res = fuse_rope_angles(gm, ctx)
    gm = res.graph
    verify(gm, ctx, after="fuse_rope_angles")
    want = _expected("v4", kind)
    assert res.changed and res.stats["sites"] == want == _count(gm, OP) > 0
    for target in (aten.cos.default, aten.sin.default, aten.arange.default):
        assert _count(gm, target) == 0
    calls = [nd for nd in gm.graph.nodes if nd.target is OP]
    if T is None:
        assert all(isinstance(nd.args[2], torch.fx.Node) for nd in calls) and isinstance(res.stats["T"][0], str)
    else:
        assert res.stats["T"] == [T] and all(nd.args[2] == T for nd in calls)
    assert all(nd.args[0].name == "pos0" for nd in calls)
    if kind != "mtp":  # the CSA layer's compressors read the same inv_freq node as its table
        assert any(u.target is not OP for nd in calls for u in nd.args[1].users)
    args = _inputs("v4", kind, dtype)
    _assert_same(_run(gm, args), _run(ref_gm, args))  # CPU: the op is the model's function: exact
    again = fuse_rope_angles(gm, ctx)
    assert not again.changed and again.stats["sites"] == 0


@pytest.mark.parametrize("kind", ["decode", "verify"])
def test_fused_graph_with_the_triton_kernel_matches(kind):
    ctx = PassContext(_model("v4").config, "cpu", graph_kind=kind)
    ref_gm = _exported("v4", kind)
    gm = fuse_rope_angles(_exported("v4", kind), ctx).graph
    assert swap_targets(gm, {OP: rope_angles}) == _expected("v4", kind)
    args = _inputs("v4", kind)
    out, ref = _run(gm, args), _run(ref_gm, args)
    _assert_same(out, ref, rel=GRAPH_REL)
    assert max(_max_rel(a, b) for a, b in zip(out[0], ref[0])) > 0  # the kernel really ran (not bit-exact)


@pytest.mark.parametrize("name,kind,want", [
    ("v3-tiny", "decode", 1), ("v3-tiny", "prefill", 1), ("v32-tiny", "decode", 1),
    ("v3-tiny", "mtp", 0),  # its positions are also compared with 0 (mtp_zero_embed_at_pos0): left alone
])
def test_v3_step_tables_are_fused_bit_exact(name, kind, want):
    ctx = PassContext(_model(name).config, "cpu", graph_kind=kind)
    ref_gm = _exported(name, kind)
    gm = _exported(name, kind)
    before = gm.code
    res = fuse_rope_angles(gm, ctx)
    assert res.stats["sites"] == want == _count(res.graph, OP)
    if not want:
        assert not res.changed and res.graph.code == before
        return
    verify(res.graph, ctx, after="fuse_rope_angles")
    assert _count(res.graph, aten.cos.default) == 0
    args = _inputs(name, kind)
    _assert_same(_run(res.graph, args), _run(ref_gm, args))


def test_in_the_pipeline_tables_sit_in_capturable_segments():
    """fuse_rope_angles runs in default_pipeline right after fuse_rope: the outputs equal the pipeline
    without it, and on h200 the fused tables sit in capturable static segments."""
    ctx, gm, recs, unfused = pipeline_pair("fuse_rope_angles")
    names = [r.name for r in recs]
    assert names.index("fuse_rope_angles") == names.index("fuse_rope") + 1
    want = _expected("v4", "decode")
    assert next(r for r in recs if r.name == "fuse_rope_angles").stats["sites"] == want
    assert _count(gm, aten.cos.default) == 0 and _count(unfused, aten.cos.default) == want
    assert_in_capturable_segments(gm, ctx, (OP,), want)


# ---- CUDA (the device) ------------------------------------------------------------------------------
def _flash_positions(B: int, device) -> torch.Tensor:
    g = torch.Generator().manual_seed(B)
    pos0 = torch.randint(0, 1_000_000, (B,), generator=g)
    pos0[0] = 0 if B > 1 else 999_999
    return pos0.to(device)


@pytest.mark.gpu
@pytest.mark.parametrize("table", ["theta", "yarn"])
@pytest.mark.parametrize("B", [1, 64])
@pytest.mark.parametrize("T", [1, 3])
def test_kernel_on_cuda_flash_tables(table, B, T):
    """V4-Flash's tables (r/2 = 32) at positions up to 1e6: within GPU_ABS of fp64 and of torch's CUDA
    cos/sin (the model's function on CUDA)."""
    inv_freq = _flash_tables()[table].cuda()
    pos0 = _flash_positions(B, "cuda")
    cos, sin = torch.ops.dsv4c.rope_angles(pos0, inv_freq, T)
    assert cos.shape == (B, T, 32) and cos.is_cuda
    assert _err(cos, sin, *_fp64_table(pos0, inv_freq, T)) <= GPU_ABS
    assert _err(cos, sin, *rope_angles_ref(pos0, inv_freq, T)) <= GPU_ABS


@pytest.mark.gpu
def test_op_captures_in_a_cuda_graph():
    inv_freq = _flash_tables()["yarn"].cuda()
    pos0 = _flash_positions(64, "cuda")
    torch.ops.dsv4c.rope_angles(pos0, inv_freq, 3)  # compile before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        cos, sin = torch.ops.dsv4c.rope_angles(pos0, inv_freq, 3)
    pos0.copy_(torch.randint(0, 1_000_000, (64,), device="cuda"))
    graph.replay()
    torch.cuda.synchronize()
    assert _err(cos, sin, *_fp64_table(pos0, inv_freq, 3)) <= GPU_ABS
