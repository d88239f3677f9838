"""Dense FP8 block GEMM kernels (tile GEMMs, decode GEMVs) vs their references (CPU interpreter;
GPU with -m gpu)."""
from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import triton

from dsv4c.kernels.fp8_gemm import (
    DEQUANT_M,
    fp8_dequant,
    fp8_gemm_w8a8,
    fp8_gemm_w8a8_ref,
    fp8_gemm_w8a16,
    fp8_gemm_w8a16_ref,
)
from dsv4c.kernels.fp8_gemv import (
    Fp8GemvConfig,
    fp8_gemv_w8a8,
    fp8_gemv_w8a8_ref,
    fp8_gemv_w8a16,
    fp8_gemv_w8a16_ref,
)
from dsv4c.kernels.tolerances import KERNEL_REL_ERR, rel_err

from dsv4c import ModelConfig
from dsv4c import quant as Q
from sm90_compile import run_sm90_script


def operands(m, n, k, scale_fmt, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(m, k, generator=g).bfloat16()
    w = torch.randn(n, k, generator=g) * 0.05
    w_q, w_s = Q.quant_fp8_block(w, scale_fmt=scale_fmt)
    return a.to(device), w_q.to(device), w_s.to(device)


@pytest.mark.parametrize("m, n, k, fmt", [(1, 128, 128, "ue8m0"), (37, 200, 384, "ue8m0"), (70, 130, 256, "fp32")])
def test_w8a8_matches_ref(m, n, k, fmt):
    a, w_q, w_s = operands(m, n, k, fmt)
    a_q, a_s = Q.quant_act_fp8(a)
    y = fp8_gemm_w8a8(a_q, a_s, w_q, w_s)
    assert y.dtype == torch.bfloat16 and y.shape == (m, n)
    assert rel_err(y, fp8_gemm_w8a8_ref(a_q, a_s, w_q, w_s)) < KERNEL_REL_ERR["gemm_fp8"]


@pytest.mark.parametrize("m, n, k, fmt", [(3, 130, 200, "ue8m0"), (65, 64, 128, "fp32")])
def test_w8a16_matches_ref(m, n, k, fmt):
    a, w_q, w_s = operands(m, n, k, fmt, seed=1)
    y = fp8_gemm_w8a16(a, w_q, w_s)
    assert rel_err(y, fp8_gemm_w8a16_ref(a, w_q, w_s)) < KERNEL_REL_ERR["gemm_fp8_w_bf16_a"]


def test_fp8_gemm_rejects_bad_scales():
    a, w_q, w_s = operands(2, 128, 256, "ue8m0")
    with pytest.raises(ValueError, match="w_s: expected"):
        fp8_gemm_w8a16(a, w_q, w_s[:, :1])
    with pytest.raises(ValueError, match="a_q: expected"):
        fp8_gemm_w8a8(a, torch.ones(2, 2), w_q, w_s)


@pytest.mark.parametrize("n, k, fmt", [(130, 200, "ue8m0"), (64, 384, "fp32"), (256, 128, "ue8m0")])
def test_dequant_equals_the_quant_reference(n, k, fmt):
    """fp8_dequant equals dsv4c.quant's dequantisation (fp32 product, one rounding), ragged tiles included:
    bit-identical in fp32, and in bf16 with e8m0 scales (the product is then exact). With fp32 scales the
    interpreter's bf16 conversion truncates where the GPU rounds to nearest: one ulp here, exact on the GPU
    (test_w8a16_op_paths_gpu)."""
    _, w_q, w_s = operands(1, n, k, fmt, seed=n)
    ref = Q.dequant_fp8_block(w_q, w_s)                                              # fp32 [N, K]
    assert torch.equal(fp8_dequant(w_q, w_s, torch.float32), ref), (n, k, fmt)
    y = fp8_dequant(w_q, w_s)
    assert y.dtype == torch.bfloat16 and y.shape == (n, k)
    if fmt == "ue8m0":
        assert torch.equal(y.float(), ref)
    else:
        assert ((y.float() - ref).abs() <= ref.abs() * 2.0 ** -7).all()
    with pytest.raises(ValueError, match="w_s: expected"):
        fp8_dequant(w_q, w_s.reshape(-1)[:1].reshape(1, 1))  # every case expects more tiles


@pytest.mark.gpu
def test_w8a16_op_paths_gpu():
    """dsv4c::fp8_linear_w8a16 by row count on the GPU: from DEQUANT_M rows the widened weight on cuBLAS,
    bit-identical to F.linear on the bf16 weight a bf16-dense artifact holds; below it the tile GEMM and the
    GEMV within the kernels' tolerance."""
    from dsv4c.kernels.fp8_gemm import fp8_linear_w8a16

    _, w_q, w_s = operands(1, 1000, 1024, "fp32", device="cuda")
    assert torch.equal(fp8_dequant(w_q, w_s), Q.dequant_fp8_block(w_q, w_s, torch.bfloat16))  # rounded as torch
    for m in (DEQUANT_M, 300, DEQUANT_M - 1, 64):
        a, w_q, w_s = operands(m, 1000, 1024, "ue8m0", seed=m, device="cuda")
        wb = Q.dequant_fp8_block(w_q, w_s, torch.bfloat16)
        assert torch.equal(fp8_dequant(w_q, w_s), wb)
        y = fp8_linear_w8a16(a.view(1, m, -1), w_q, w_s.view(torch.uint8))
        assert y.shape == (1, m, 1000) and y.dtype == torch.bfloat16
        if m >= DEQUANT_M:
            assert torch.equal(y[0], torch.nn.functional.linear(a, wb)), m
        else:
            assert rel_err(y[0], fp8_gemm_w8a16_ref(a, w_q, w_s)) < KERNEL_REL_ERR["gemm_fp8_w_bf16_a"], m


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 300])
def test_fp8_gemms_gpu(m):
    a, w_q, w_s = operands(m, 1000, 1024, "ue8m0", device="cuda")
    a_q, a_s = Q.quant_act_fp8(a)
    assert rel_err(fp8_gemm_w8a8(a_q, a_s, w_q, w_s), fp8_gemm_w8a8_ref(a_q, a_s, w_q, w_s)) < KERNEL_REL_ERR["gemm_fp8"]
    assert rel_err(fp8_gemm_w8a16(a, w_q, w_s), fp8_gemm_w8a16_ref(a, w_q, w_s)) < KERNEL_REL_ERR["gemm_fp8_w_bf16_a"]


# ---- decode kernels (kernels/fp8_gemv.py) -----------------------------------------------------
GEMV_CASES = [  # (M, N, K, weight scale, config): CUDA-core row, tensor-core tiles, K splits, ragged N and K
    (1, 48, 200, "ue8m0", Fp8GemvConfig(1, 16, 128, split=2)),
    (1, 64, 512, "fp32", Fp8GemvConfig(1, 32, 256, split=1)),
    (3, 130, 384, "ue8m0", Fp8GemvConfig(16, 32, 128, split=4)),
    (20, 96, 256, "fp32", Fp8GemvConfig(32, 64, 128, split=2)),
]


@pytest.mark.parametrize("m, n, k, fmt, cfg", GEMV_CASES)
def test_gemv_w8a16_matches_ref(m, n, k, fmt, cfg):
    a, w_q, w_s = operands(m, n, k, fmt, seed=2)
    ref = fp8_gemv_w8a16_ref(a, w_q, w_s)
    y = fp8_gemv_w8a16(a, w_q, w_s, config=cfg)
    assert y.dtype == torch.bfloat16 and y.shape == (m, n)
    assert rel_err(y, ref) < KERNEL_REL_ERR["gemm_fp8_w_bf16_a"]
    # fp32 out: only the summation order differs, so a dropped or doubled split / scale block shows
    assert rel_err(fp8_gemv_w8a16(a, w_q, w_s, torch.float32, config=cfg), ref) < 1e-5
    torch.testing.assert_close(ref, fp8_gemm_w8a16_ref(a, w_q, w_s), rtol=0, atol=0)


@pytest.mark.parametrize("m, n, k, fmt, cfg", [c for c in GEMV_CASES if c[2] % 128 == 0])
def test_gemv_w8a8_matches_ref(m, n, k, fmt, cfg):
    a, w_q, w_s = operands(m, n, k, fmt, seed=3)
    a_q, a_s = Q.quant_act_fp8(a)
    ref = fp8_gemv_w8a8_ref(a_q, a_s, w_q, w_s)
    assert rel_err(fp8_gemv_w8a8(a_q, a_s, w_q, w_s, config=cfg), ref) < KERNEL_REL_ERR["gemm_fp8"]
    assert rel_err(fp8_gemv_w8a8(a_q, a_s, w_q, w_s, torch.float32, config=cfg), ref) < 1e-5


def test_split_counters_are_left_as_found():
    """The split launches share one persistent counter buffer (kernels/_tl.py `split_counters`), never
    zeroed after it is made: a launch of split 4 after one of split 2 (and the batch-invariant decode tile's
    split of 8 between them) finds its last program and gives the first call's bits; every counter is a
    multiple of SPLIT_TICKS afterwards. Bad splits are refused."""
    from dsv4c.kernels import _tl as U
    from dsv4c.kernels.batch_invariant import bi_matmul

    a, w_q, w_s = operands(3, 130, 384, "ue8m0", seed=5)
    cfg2, cfg4 = Fp8GemvConfig(16, 32, 128, split=2), Fp8GemvConfig(16, 32, 128, split=4)
    y2, y4 = fp8_gemv_w8a16(a, w_q, w_s, config=cfg2), fp8_gemv_w8a16(a, w_q, w_s, config=cfg4)
    w = torch.randn(70, 2048).bfloat16()
    bi_matmul(torch.randn(5, 2048).bfloat16(), w, split=8, decode=True)
    assert torch.equal(fp8_gemv_w8a16(a, w_q, w_s, config=cfg4), y4)
    assert torch.equal(fp8_gemv_w8a16(a, w_q, w_s, config=cfg2), y2)
    cnt = U.split_counters(a.device, 64, 1)
    assert cnt.any() and not (cnt % U.SPLIT_TICKS).any()
    for bad in (3, 128):
        with pytest.raises(ValueError, match="split must be a power of two"):
            U.split_counters(a.device, 4, bad)


def test_gemv_default_config_fills_the_gpu_for_the_slice_shapes():
    from dsv4c.kernels.fp8_gemv import GEMV_PROGRAMS_PER_SM, default_config

    # v4-flash-slice: wq_a ‖ wkv, wq_b, wq_b ‖ indexer wq_b, wo_b, shared w1 ‖ w3, shared w2
    shapes = [(1536, 4096), (32768, 1024), (40960, 1024), (4096, 8192), (4096, 4096), (4096, 2048)]
    for m in (1, 8, 64):
        for n, k in shapes:
            c = default_config(m, n, k, 132)
            c.check()
            programs = triton.cdiv(m, c.block_m) * triton.cdiv(n, c.block_n) * c.split
            steps = triton.cdiv(k, c.block_k)
            assert (c.block_m == 1) == (m == 1) and c.block_m >= min(m, 16)
            assert c.split * m * n * 4 <= n * k / 4, (m, n, k, c)  # partials stay small against the weight
            # GEMV_PROGRAMS_PER_SM programs per SM (one token), more than one per SM (tensor cores: a doubling
            # would pass two), unless another bound stopped the split
            full = programs >= GEMV_PROGRAMS_PER_SM * 132 if m == 1 else programs > 132
            assert (full or steps < 2 * c.split or 2 * c.split * m * n * 4 > n * k / 4), (m, n, k, c)
            assert m == 1 or c.split == 1 or programs <= 264, (m, n, k, c)
    assert default_config(1, 1536, 4096, 132).split > 1  # the 12-program case of the tile GEMM
    # one token: up to 16 programs per SM (run64's step A/B), each with one K step of 512 columns or more
    assert [default_config(1, n, k, 132).split for n, k in shapes] == [8, 2, 2, 16, 8, 4]
    # the splits run36's H100 sweep found fastest at 8 and 64 tokens (bn64 bk128)
    assert [default_config(8, n, k, 132).split for n, k in shapes] == [8, 1, 1, 4, 4, 4]
    assert [default_config(64, n, k, 132).split for n, k in shapes] == [4, 1, 1, 4, 4, 2]


def test_gemv_rejects_bad_contracts():
    a, w_q, w_s = operands(2, 128, 256, "ue8m0")
    with pytest.raises(ValueError, match="block_m = 1 takes one token"):
        fp8_gemv_w8a16(a, w_q, w_s, config=Fp8GemvConfig(1, 32))
    with pytest.raises(ValueError, match="Fp8GemvConfig.block_n"):
        fp8_gemv_w8a16(a, w_q, w_s, config=Fp8GemvConfig(16, 48))
    with pytest.raises(ValueError, match="Fp8GemvConfig.split"):
        fp8_gemv_w8a16(a, w_q, w_s, config=Fp8GemvConfig(16, 32, split=3))
    with pytest.raises(ValueError, match="w_s: expected"):
        fp8_gemv_w8a16(a, w_q, w_s[:, :1])
    with pytest.raises(ValueError, match="a: expected"):
        fp8_gemv_w8a16(a.float(), w_q, w_s)
    with pytest.raises(ValueError, match="a_s: expected"):
        fp8_gemv_w8a8(*Q.quant_act_fp8(a)[:1], torch.ones(2, 1), w_q, w_s)
    assert fp8_gemv_w8a16(a[:0], w_q, w_s).shape == (0, 128)


SLICE_SHAPES = [(1536, 4096), (32768, 1024), (40960, 1024), (4096, 8192), (4096, 4096), (4096, 2048)]


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 8, 64])
def test_gemv_gpu_slice_shapes(m):
    for n, k in SLICE_SHAPES:
        a, w_q, w_s = operands(m, n, k, "ue8m0", seed=n + k, device="cuda")
        ref = fp8_gemv_w8a16_ref(a, w_q, w_s)
        y = fp8_gemv_w8a16(a, w_q, w_s)
        assert rel_err(y, ref) < KERNEL_REL_ERR["gemm_fp8_w_bf16_a"], (n, k)
        assert torch.equal(fp8_gemv_w8a16(a, w_q, w_s), y), (n, k)  # the split reduction is ordered
        a_q, a_s = Q.quant_act_fp8(a)
        y8 = fp8_gemv_w8a8(a_q, a_s, w_q, w_s)
        assert rel_err(y8, fp8_gemv_w8a8_ref(a_q, a_s, w_q, w_s)) < KERNEL_REL_ERR["gemm_fp8"], (n, k)


@pytest.mark.gpu
@pytest.mark.parametrize("m, n, k, fmt, cfg", GEMV_CASES)
def test_gemv_gpu_configs(m, n, k, fmt, cfg):
    a, w_q, w_s = operands(m, n, k, fmt, seed=4, device="cuda")
    ref = fp8_gemv_w8a16_ref(a, w_q, w_s)
    assert rel_err(fp8_gemv_w8a16(a, w_q, w_s, torch.float32, config=cfg), ref) < 1e-5
    if k % 128 == 0:
        a_q, a_s = Q.quant_act_fp8(a)
        ref8 = fp8_gemv_w8a8_ref(a_q, a_s, w_q, w_s)
        # Hopper's FP8 tensor cores add products with fewer mantissa bits than fp32 (DeepSeek-V3 report,
        # 3.3.2: about 14); measured 1.2e-4 at M = 20. A dropped split or scale block costs >= 0.1.
        tol = 1e-5 if m == 1 else 1e-3
        assert rel_err(fp8_gemv_w8a8(a_q, a_s, w_q, w_s, torch.float32, config=cfg), ref8) < tol


_SM90_SCRIPT = textwrap.dedent('''
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from dsv4c.kernels.fp8_gemv import _gemv_kernel as fn

    names = list(fn.arg_names)
    ints = ("N", "stride_am", "stride_asm", "stride_wn", "stride_wsn", "stride_ym")  # launch-time multiples of 16
    tiles = ((False, 1, 32, 512, 4, 8, 0, False), (True, 16, 64, 128, 8, 4, 0, False),
             (False, 64, 64, 128, 4, 4, 0, False), (False, 1, 32, 512, 2, 8, 1024, False),
             (False, 1, 32, 512, 2, 8, 1024, True), (False, 16, 64, 128, 4, 4, 1024, True))
    for a_fp8, bm, bn, bk, split, warps, group, f32 in tiles:  # 4-6: Flash's wo_a block-diagonally, then fp32 rows
        a_ty = "*fp8e4nv" if a_fp8 else "*fp32" if f32 else "*bf16"
        types = {"a_ptr": a_ty, "as_ptr": "*fp32" if a_fp8 else a_ty, "w_ptr": "*fp8e4nv",
                 "ws_ptr": "*u8", "y_ptr": "*bf16", "part_ptr": "*fp32", "cnt_ptr": "*i32"}
        consts = dict(K=8192, A_FP8=a_fp8, WS_E8M0=True, INTERPRET=False, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
                      K_SPLIT=8192 // split, SPLIT=split, GROUP_ROWS=group, ROUND_A=f32,
                      PDL=True)  # PDL: as sm_90 launches it
        sig = {nm: "constexpr" if nm in consts else types.get(nm, "i32") for nm in names}
        attrs = {(i,): [["tt.divisibility", 16]] for i, nm in enumerate(names) if nm.endswith("_ptr") or nm in ints}
        src = ASTSource(fn=fn, signature=sig, constexprs={(names.index(k),): v for k, v in consts.items()}, attrs=attrs)
        ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": 4}).asm["ptx"]
        print("kernel", bm, int("cp.async" in ptx), int("atom.global" in ptx), int("wgmma" in ptx or "mma.sync" in ptx))
''')


def test_gemv_compiles_for_sm90(tmp_path):
    """Compile (not run) six tiles for sm_90 with the real Triton compiler in a subprocess (tests
    import kernels under TRITON_INTERPRET=1): the tensor-core tiles are software-pipelined (cp.async),
    the split tiles count with a global atomic, the one-token tile has no MMA."""
    rows = run_sm90_script(tmp_path, _SM90_SCRIPT)
    assert rows == [["1", "0", "1", "0"], ["16", "1", "1", "1"], ["64", "1", "1", "1"], ["1", "0", "1", "0"],
                    ["1", "0", "1", "0"], ["16", "1", "1", "1"]], rows


def test_bench_dense_kernels_quick_run(tmp_path):
    """examples/bench_dense_kernels.py on the interpreter: every kernel's error against the fp32 product
    of the same operands, the JSON and the table (no timing on the CPU)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
    import bench_dense_kernels as bench

    out = tmp_path / "q.json"
    assert bench.main(["--device", "cpu", "--quick", "--out", str(out), "--md", str(tmp_path / "q.md")]) == 0
    res = json.loads(out.read_text())
    assert {r["kernel"] for r in res["rows"]} == set(bench.KERNELS) and len(res["rows"]) == 2 * 2 * len(bench.KERNELS)
    for r in res["rows"]:  # bf16 outputs; W8A8 also rounds its input to e4m3
        assert r["rel_err"] < (KERNEL_REL_ERR["dense_w8a8"] if "w8a8" in r["kernel"] else KERNEL_REL_ERR["gemm_fp8"]), r
    assert "| attn.wq_a‖wkv [" in (tmp_path / "q.md").read_text()
    shapes = {name: (n, k) for name, n, k in bench.dense_shapes(ModelConfig.preset("v4-flash-slice"))}
    assert shapes["attn.wq_a‖wkv"] == (1536, 4096) and shapes["attn.wo_b"] == (4096, 8192)


def test_ops_take_strided_rows_without_a_copy():
    """A split of a fused projection's output (row stride > K) goes to the kernels as a view."""
    from dsv4c.kernels.fp8_gemm import _rows

    base = torch.randn(2, 3, 384)
    x = base[..., 128:256]                                   # [2, 3, 128], row stride 384
    r = _rows(x)
    assert r.shape == (6, 128) and r.data_ptr() == x.data_ptr() and r.stride() == (384, 1)
    a, w_q, w_s = operands(6, 32, 128, "ue8m0", seed=5)
    wide = torch.zeros(6, 256, dtype=torch.bfloat16)
    wide[:, 64:192] = a
    view = wide[:, 64:192]
    torch.testing.assert_close(fp8_gemv_w8a16(view, w_q, w_s, torch.float32), fp8_gemv_w8a16(a, w_q, w_s, torch.float32),
                               rtol=0, atol=0)
    assert _rows(x.transpose(0, 1)).is_contiguous()          # not reshapeable as a view: copied
