"""kernels/linear_f32.py: the one-token GEMV of `dsv4c::linear_f32` (bf16 x and weight, fp32 output), its
tensor-core form for 2-16 token rows, the `fused` op and its selection (Triton interpreter on the CPU; `-m gpu`
on the device)."""
from __future__ import annotations

import textwrap

import pytest
import torch

import dsv4c.kernels.linear_f32 as LF
from dsv4c.kernels.linear_f32 import linear_f32_gemv, linear_f32_gemv_ref, linear_f32_tc, split_for
from dsv4c.kernels.tolerances import rel_err
from dsv4c.model import register_ops
from sm90_compile import run_sm90_script

register_ops()


def _case(n: int, k: int, dtype=torch.bfloat16, seed: int = 0, device="cpu", m: int = 1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(dtype)
    w = (torch.randn(n, k, generator=g) / k ** 0.5).to(dtype)
    return x.to(device), w.to(device)


@pytest.mark.parametrize("n,k,split", [(48, 200, 1), (64, 512, 2), (70, 1100, 4), (256, 1024, None)])
def test_gemv_equals_the_fp32_linear(n, k, split):
    """Ragged N and K, one K split or several (the last program adds the partials): within fp32 summation order
    of linear(x.float(), w.float()), and the same bits on a second call (the split sum is ordered)."""
    x, w = _case(n, k, seed=n + k)
    y = linear_f32_gemv(x, w, split)
    ref = linear_f32_gemv_ref(x, w)
    assert y.dtype == torch.float32 and y.shape == (1, n)
    assert rel_err(y, ref) < 1e-6
    assert torch.equal(y, linear_f32_gemv(x, w, split))
    assert rel_err(y, ref.roll(1, -1)) > 0.5  # each row is its own dot product


def test_fp16_and_the_default_split():
    x, w = _case(96, 768, torch.float16, seed=3)
    assert rel_err(linear_f32_gemv(x, w), linear_f32_gemv_ref(x, w)) < 1e-6
    assert split_for(256, 4096, 132) == 16  # Flash's router: 8 tiles, split until about two programs per SM
    assert split_for(4096, 4096, 132) == 2  # 128 tiles: 256 programs
    assert split_for(8192, 4096, 132) == 1
    assert split_for(256, 256, 132) == 1   # one K step: no split


def test_bad_input_names_the_limit():
    x, w = _case(32, 256)
    with pytest.raises(ValueError, match="share a 16-bit dtype"):
        linear_f32_gemv(x.float(), w)
    with pytest.raises(ValueError, match=r"\[1, K\]"):
        linear_f32_gemv(torch.cat([x, x]), w)
    with pytest.raises(ValueError, match="unit stride"):
        linear_f32_gemv(x, w.t().contiguous().t())
    with pytest.raises(ValueError, match="split must be a power of two"):
        linear_f32_gemv(x, w, split=3)


@pytest.mark.parametrize("m,n,k", [(2, 48, 200), (7, 96, 512), (16, 70, 1100), (5, 256, 1024), (1, 64, 256)])
def test_tc_equals_the_fp32_linear(m, n, k):
    """Several token rows on batch_invariant's decode tile with an fp32 output (padding rows masked), ragged N and
    K, its K split: within fp32 summation order of linear(x.float(), w.float()), the same bits on a second call."""
    x, w = _case(n, k, seed=n + k + m, m=m)
    y = linear_f32_tc(x, w)
    ref = linear_f32_gemv_ref(x, w)
    assert y.dtype == torch.float32 and y.shape == (m, n)
    assert rel_err(y, ref) < 1e-6
    assert torch.equal(y, linear_f32_tc(x, w))
    if m > 1:
        assert rel_err(y, ref.roll(1, 0)) > 0.5  # each token row is its own


def test_fused_op_is_the_op_off_cuda_and_selected_by_the_target_map():
    """On the CPU the `fused` op is `linear_f32` itself (the reference); select_kernels maps linear_f32 to it when
    a target or --kernels names `fused` (the CUDA targets do), up to GEMV_MAX_ELEMENTS weight values (the routers'
    gates and the stacked compressor / indexer projections of Flash; not the head)."""
    from dsv4c.passes.select_kernels import implementation_op

    x, w = _case(40, 256, seed=4)
    assert torch.equal(torch.ops.dsv4c.linear_f32_fused(x, w), torch.ops.dsv4c.linear_f32(x, w))
    assert implementation_op("linear_f32", "fused") is torch.ops.dsv4c.linear_f32_fused.default
    from dsv4c.targets import get_target

    assert all(get_target(t).kernels["linear_f32"] == "fused" for t in ("h100", "h200", "b200"))
    assert "linear_f32" not in get_target("cpu").kernels
    assert 4096 * 384 <= LF.GEMV_MAX_ELEMENTS < 129280 * 4096


_SM90_SCRIPT = textwrap.dedent('''
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from dsv4c.kernels.linear_f32 import _gemv_f32_kernel as fn

    names = list(fn.arg_names)
    types = {"x_ptr": "*bf16", "w_ptr": "*bf16", "y_ptr": "*fp32", "part_ptr": "*fp32", "cnt_ptr": "*i32"}
    for split in (1, 16):
        consts = dict(K=4096, BLOCK_N=32, BLOCK_K=256, K_SPLIT=4096 // split, SPLIT=split, PDL=True)
        sig = {nm: "constexpr" if nm in consts else types.get(nm, "i32") for nm in names}
        attrs = {(i,): [["tt.divisibility", 16]] for i, nm in enumerate(names) if nm.endswith("_ptr")}
        src = ASTSource(fn=fn, signature=sig, constexprs={(names.index(k),): v for k, v in consts.items()}, attrs=attrs)
        ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4}).asm["ptx"]
        print("kernel", split, int("griddepcontrol.wait" in ptx), int("atom.global" in ptx), int("mma" in ptx))
''')


def test_kernel_compiles_for_sm90(tmp_path):
    """Compiled (not run) for sm_90: the PDL wait, the split's atomic counter only when split, no MMA."""
    assert run_sm90_script(tmp_path, _SM90_SCRIPT) == [["1", "1", "0", "0"], ["16", "1", "1", "0"]]


@pytest.mark.gpu
def test_gemv_on_gpu_at_flash_shapes(monkeypatch):
    """Flash's router [256, 4096] and a compressor-sized [2304, 4096] weight at one token: within fp32 summation
    order of the fp32 linear, the same bits twice, in a CUDA graph too; the op runs it once GEMV_MAX_ELEMENTS
    allows and keeps cuBLAS above it (the head's size) and at two tokens."""
    monkeypatch.setattr(LF, "GEMV_MAX_ELEMENTS", 16 << 20)
    for n in (256, 2304):
        x, w = _case(n, 4096, seed=n, device="cuda")
        y = torch.ops.dsv4c.linear_f32_fused(x, w)
        assert rel_err(y, linear_f32_gemv_ref(x, w)) < 1e-6 and torch.equal(y, linear_f32_gemv(x, w)), n
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            out = torch.ops.dsv4c.linear_f32_fused(x, w)
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, y), n
    x2 = torch.cat([x, x])
    assert LF.TC_MAX_M == 0  # two rows and more stay on cuBLAS until linear_f32_tc is timed (run75)
    assert torch.equal(torch.ops.dsv4c.linear_f32_fused(x2, w), torch.ops.dsv4c.linear_f32(x2, w))


@pytest.mark.gpu
@pytest.mark.parametrize("m", [2, 8, 16])
def test_tc_on_gpu_at_flash_shapes(monkeypatch, m):
    """linear_f32_tc (bi_matmul's decode tile) at Flash's router and a ratio-4 layer's compressor / indexer stack,
    2-16 token rows, through
    the op once TC_MAX_M allows it: within fp32 summation order of the fp32 linear (1e-5: tensor-core sums), the
    same bits twice and in a CUDA graph; without TC_MAX_M the op is cuBLAS's."""
    monkeypatch.setattr(LF, "TC_MAX_M", 16)
    for n in (256, 2624):
        x, w = _case(n, 4096, seed=n + m, device="cuda", m=m)
        y = torch.ops.dsv4c.linear_f32_fused(x, w)
        assert rel_err(y, linear_f32_gemv_ref(x, w)) < 1e-5 and torch.equal(y, linear_f32_tc(x, w)), (n, m)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            out = torch.ops.dsv4c.linear_f32_fused(x, w)
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, y), (n, m)
    monkeypatch.setattr(LF, "TC_MAX_M", 0)
    assert torch.equal(torch.ops.dsv4c.linear_f32_fused(x, w), torch.ops.dsv4c.linear_f32(x, w))
