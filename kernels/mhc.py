"""mHC (manifold-constrained hyper-connections, dsv4c/model/v4.py) as Triton kernels: the Sinkhorn
normalisation, and the whole pre- and post-mix of a site.

Public API::

    sinkhorn(c0, iters, eps, block_m=None, exact=None) -> Tensor   # [..., N, N] fp32, the Triton kernel
    sinkhorn_ref(c0, iters, eps) -> Tensor             # the model's eager math (the spec)
    sinkhorn_cuda_order(c0, iters, eps) -> Tensor      # the same with PyTorch's CUDA summation orders (N = 4)
    hc_pre(X, fn, base, scale, eps, hc_eps, iters, exact=None) -> (u, post, comb)   # two launches
    hc_pre_ref(...)                                    # HyperConnection.pre, unchanged
    hc_post(y, X, post, comb, exact=None, y2=None) -> Tensor    # one launch; y2: y is y + y2 (rounded)
    hc_post_ref(...)                                   # HyperConnection.post, unchanged
    hc_post_pre(y, X, post, comb, fn, base, scale, eps, hc_eps, iters, y2=None) -> (X', u, post', comb')
                                                       # a post and the next site's pre: two launches at decode
    hc_post_pre_ref(...)                               # HyperConnection.post, then .pre on its output

Custom ops (targets of passes/fuse_sinkhorn.py and passes/fuse_hc.py; CPU = the reference)::

    dsv4c::sinkhorn(Tensor c0, int iters, float eps) -> Tensor
    dsv4c::hc_pre(Tensor X, Tensor fn, Tensor base, Tensor scale, float eps, float hc_eps, int iters)
        -> (Tensor u, Tensor post, Tensor comb)
    dsv4c::hc_post(Tensor y, Tensor X, Tensor post, Tensor comb, Tensor? y2=None) -> Tensor
    dsv4c::hc_post_pre(Tensor y, Tensor X, Tensor post, Tensor comb, Tensor fn, Tensor base, Tensor scale,
        float eps, float hc_eps, int iters, Tensor? y2=None) -> (Tensor, Tensor, Tensor, Tensor)
                                                       # passes/fuse_hc_chain.py
    dsv4c::hc_pre_rows, dsv4c::hc_post_bi, dsv4c::sinkhorn_bi   # the same, one variant at any M (deterministic)

Two variants of each kernel, chosen by the launch's M (tokens, matrices): from EXACT_ROWS_MIN
(kernels/norm.py; prefill chunks) the exact kernels (`*_exact_kernel`, below), under it (decode:
batch x (1 + k) tokens) the fast kernels, unchanged from before issue 22's exact kernels (which made
the slice's decode step 0.26 ms slower on the H200). `exact=` overrides the choice. The deterministic
mode (passes/make_batch_invariant.py) needs a row's bits independent of M, so its ops take the fast
variant at any M.

The pre/post kernels are described above their code, below the Sinkhorn kernel.

Semantics (deepseek_v4.md, mHC): per [N, N] matrix, softmax over the last dim (max subtracted),
+eps, divide each column by (its sum + eps), then (iters - 1) times: rows by (row sum + eps),
columns by (column sum + eps). Eagerly that is 6·iters − 1 tiny ATen kernels per mHC site (119 for
iters = 20, N = 4); here one program holds BLOCK_M whole matrices in registers for all iterations,
so a site is one launch. ITERS is a constexpr (the loop bound; the Triton interpreter cannot range
over a runtime scalar): one compiled variant per model config. The kernels perform the same operations in the same order as the eager code; divisions
are IEEE round-to-nearest (`tl.div_rn`, not the approximate fp32 `/`). The fast kernel sums in Triton's
order with `tl.exp` (a few ulp from `sinkhorn_ref`); the exact one's `exp` is libdevice's accurate expf,
as in torch's CUDA softmax, and for N = 4 every sum is added in PyTorch's CUDA order (`_sinkhorn4_io`),
other N in Triton's order.

The exact variants: rounding like eager (issue 22). On the random-weight slice's prefill graph a
kernel whose fp32 values are a few ulp off eager's moves single bf16 roundings, and the logits
feel it (BENCHMARKS.md, 2026-12-01: fuse_hc 40 -> 37 dB). So each kernel does eager's fp32
operations one by one: the pre/post launches are compiled without FMA contraction
(`enable_fp_fusion=False`, which Triton otherwise applies to every a·b + c), explicit `tl.fma` only
where eager's own kernel fuses (the batched GEMM of hc_post's einsum); sigmoid = 1 / (1 + expf(-t))
with an IEEE division and libdevice's expf (Triton's tl.sigmoid/tl.exp are approximate); rsqrt =
the hardware rsqrt.approx, which is what torch.rsqrt (CUDA's rsqrtf) runs; u sums the rounded
products pre_k·X[k] in the order of PyTorch's reduction over a non-innermost dim; the 4 x 4
Sinkhorn adds its sums in the orders of torch's CUDA softmax and reductions (`sinkhorn_cuda_order`).
What is left is z = fn·vec(X), a dot of N·D terms (16384 at Flash dims) that cuBLAS (eager) and the
split-K kernel add in different orders: z then differs by an ulp or so, and u rounds differently in a
few elements in 10^4. In ulps of u itself that looked large (up to 14 on the H200 at 2 x 256 tokens,
issue 22): where the streams cancel, |u| is far below the terms pre_k·X[k] whose rounding error it
carries, so the tests bound the error by the terms' scale. From EXACT_ROWS_MIN tokens (prefill
chunks) hc_pre therefore takes z from eager's own ops (`_eager_z`: the fp32 copy of X and torch's
linear, the same cuBLAS call as eager's, and the sum of squares in PyTorch's CUDA order): u, post and
comb are then expected bit-exact with eager on CUDA (the `gpu` tests check it), at the price of that copy and an fp32 GEMM (a 512-token
chunk at Flash dims: 32 MB written and read once more per site). Decode batches keep the fast split-K
launch. The exact hc_post is bit-exact with eager on the CPU (interpreter, tests/test_fuse_hc.py) and, if
cuBLAS's fp32 batched GEMM of K = N adds its FMAs in order as the CPU's does, on CUDA (`gpu` tests).

Launch: grid = ceil(M / BLOCK_M) for M = prod(leading dims), fixed by the shape, no host sync:
capture-safe (split_at_routers.OP_CAPTURE). M = 0 launches nothing.
"""
from __future__ import annotations

from types import SimpleNamespace

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from dsv4c.kernels._tl import interpret_flag, pdl_launch, pdl_wait, rne_bf16, round_to
from dsv4c.kernels.norm import EXACT_ROWS_MIN, row_sumsq, reduce_layout

MAX_N = 16  # N·N fp32 per matrix in registers; hc_mult is 4


@triton.jit
def _sinkhorn_kernel(c_ptr, out_ptr, M, eps, ITERS: tl.constexpr, N: tl.constexpr, BLOCK_M: tl.constexpr,
                     PDL: tl.constexpr = False):
    pdl_wait(PDL)
    # M matrices [N, N], contiguous; this program handles matrices [pid·BLOCK_M, (pid+1)·BLOCK_M)
    pid = tl.program_id(0)
    m = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    i = tl.arange(0, N)
    j = tl.arange(0, N)
    offs = m[:, None, None].to(tl.int64) * (N * N) + i[None, :, None] * N + j[None, None, :]
    mask = (m < M)[:, None, None] & (offs >= 0)  # full [BLOCK_M, N, N] mask of real matrices
    x = tl.load(c_ptr + offs, mask=mask, other=0.0)  # [BLOCK_M, N(i), N(j)]
    tl.store(out_ptr + offs, _sinkhorn_tile(x, eps, ITERS, 1, 2), mask=mask)


@triton.jit
def _sinkhorn_exact_kernel(c_ptr, out_ptr, M, eps, ITERS: tl.constexpr, N: tl.constexpr, BLOCK_M: tl.constexpr,
                           INTERPRET: tl.constexpr, PDL: tl.constexpr = False):
    pdl_wait(PDL)
    # M matrices [N, N], contiguous; this program handles matrices [pid·BLOCK_M, (pid+1)·BLOCK_M)
    pid = tl.program_id(0)
    m = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    i = tl.arange(0, N)
    j = tl.arange(0, N)
    offs = m[:, None, None].to(tl.int64) * (N * N) + i[None, :, None] * N + j[None, None, :]
    mask = (m < M)[:, None, None] & (offs >= 0)  # full [BLOCK_M, N, N] mask of real matrices
    if N == 4:  # PyTorch's CUDA summation orders (_sinkhorn4), one [BLOCK_M] vector per matrix entry
        _sinkhorn4_io(c_ptr, out_ptr, m[:, None].to(tl.int64) * 16, (m < M)[:, None], eps, ITERS, INTERPRET)
    else:
        x = tl.load(c_ptr + offs, mask=mask, other=0.0)  # [BLOCK_M, N(i), N(j)]
        tl.store(out_ptr + offs, _sinkhorn_tile_exact(x, eps, ITERS, 1, 2, INTERPRET), mask=mask)


@triton.jit
def _sinkhorn_tile(x, eps, ITERS: tl.constexpr, I_AXIS: tl.constexpr, J_AXIS: tl.constexpr):
    """Sinkhorn of the [N(i), N(j)] matrices of the register tile x (axes I_AXIS, J_AXIS)."""
    # softmax over j, then + eps
    e = tl.exp(x - tl.max(x, axis=J_AXIS, keep_dims=True))
    c = tl.div_rn(e, tl.sum(e, axis=J_AXIS, keep_dims=True)) + eps
    # columns: sum over i
    c = tl.div_rn(c, tl.sum(c, axis=I_AXIS, keep_dims=True) + eps)
    for _ in range(ITERS - 1):
        c = tl.div_rn(c, tl.sum(c, axis=J_AXIS, keep_dims=True) + eps)  # rows
        c = tl.div_rn(c, tl.sum(c, axis=I_AXIS, keep_dims=True) + eps)  # columns
    return c


# Sinkhorn of 4 x 4 matrices with PyTorch's CUDA summation orders (eager's on the GPU): softmax's sum of a
# row as its warp shuffle adds it, (e0 + e2) + (e1 + e3); a row sum (`c.sum(-1)`: one lane per element,
# halving shuffle offsets) the same; a column sum (`c.sum(-2)`: a reduction over a non-innermost dim, one
# thread per output) in order, ((c0 + c1) + c2) + c3. Entries are [BLOCK, 1] tensors (one per matrix
# position, any number of matrices), so every sum is explicit arithmetic and rounds exactly as written.
@triton.jit
def _softmax4(a, b, c, d, eps, INTERPRET: tl.constexpr):
    mx = tl.maximum(tl.maximum(a, b), tl.maximum(c, d))
    ea = _exp_like_torch(a - mx, INTERPRET)
    eb = _exp_like_torch(b - mx, INTERPRET)
    ec = _exp_like_torch(c - mx, INTERPRET)
    ed = _exp_like_torch(d - mx, INTERPRET)
    s = (ea + ec) + (eb + ed)
    return tl.div_rn(ea, s) + eps, tl.div_rn(eb, s) + eps, tl.div_rn(ec, s) + eps, tl.div_rn(ed, s) + eps


@triton.jit
def _row4(a, b, c, d, eps):
    s = ((a + c) + (b + d)) + eps
    return tl.div_rn(a, s), tl.div_rn(b, s), tl.div_rn(c, s), tl.div_rn(d, s)


@triton.jit
def _col4(a, b, c, d, eps):
    s = (((a + b) + c) + d) + eps
    return tl.div_rn(a, s), tl.div_rn(b, s), tl.div_rn(c, s), tl.div_rn(d, s)


@triton.jit
def _sinkhorn4_io(src_ptr, dst_ptr, base, mask, eps, ITERS: tl.constexpr, INTERPRET: tl.constexpr):
    # matrices at src_ptr + base (16 fp32 each, row-major) -> dst_ptr + base; c<i><j> is entry (i, j)
    c00 = tl.load(src_ptr + base + 0, mask=mask, other=0.0)
    c01 = tl.load(src_ptr + base + 1, mask=mask, other=0.0)
    c02 = tl.load(src_ptr + base + 2, mask=mask, other=0.0)
    c03 = tl.load(src_ptr + base + 3, mask=mask, other=0.0)
    c10 = tl.load(src_ptr + base + 4, mask=mask, other=0.0)
    c11 = tl.load(src_ptr + base + 5, mask=mask, other=0.0)
    c12 = tl.load(src_ptr + base + 6, mask=mask, other=0.0)
    c13 = tl.load(src_ptr + base + 7, mask=mask, other=0.0)
    c20 = tl.load(src_ptr + base + 8, mask=mask, other=0.0)
    c21 = tl.load(src_ptr + base + 9, mask=mask, other=0.0)
    c22 = tl.load(src_ptr + base + 10, mask=mask, other=0.0)
    c23 = tl.load(src_ptr + base + 11, mask=mask, other=0.0)
    c30 = tl.load(src_ptr + base + 12, mask=mask, other=0.0)
    c31 = tl.load(src_ptr + base + 13, mask=mask, other=0.0)
    c32 = tl.load(src_ptr + base + 14, mask=mask, other=0.0)
    c33 = tl.load(src_ptr + base + 15, mask=mask, other=0.0)
    tl.debug_barrier()  # every thread has read before any writes (dst may be src)
    c00, c01, c02, c03 = _softmax4(c00, c01, c02, c03, eps, INTERPRET)
    c10, c11, c12, c13 = _softmax4(c10, c11, c12, c13, eps, INTERPRET)
    c20, c21, c22, c23 = _softmax4(c20, c21, c22, c23, eps, INTERPRET)
    c30, c31, c32, c33 = _softmax4(c30, c31, c32, c33, eps, INTERPRET)
    c00, c10, c20, c30 = _col4(c00, c10, c20, c30, eps)
    c01, c11, c21, c31 = _col4(c01, c11, c21, c31, eps)
    c02, c12, c22, c32 = _col4(c02, c12, c22, c32, eps)
    c03, c13, c23, c33 = _col4(c03, c13, c23, c33, eps)
    for _ in range(ITERS - 1):
        c00, c01, c02, c03 = _row4(c00, c01, c02, c03, eps)
        c10, c11, c12, c13 = _row4(c10, c11, c12, c13, eps)
        c20, c21, c22, c23 = _row4(c20, c21, c22, c23, eps)
        c30, c31, c32, c33 = _row4(c30, c31, c32, c33, eps)
        c00, c10, c20, c30 = _col4(c00, c10, c20, c30, eps)
        c01, c11, c21, c31 = _col4(c01, c11, c21, c31, eps)
        c02, c12, c22, c32 = _col4(c02, c12, c22, c32, eps)
        c03, c13, c23, c33 = _col4(c03, c13, c23, c33, eps)
    tl.store(dst_ptr + base + 0, c00, mask=mask)
    tl.store(dst_ptr + base + 1, c01, mask=mask)
    tl.store(dst_ptr + base + 2, c02, mask=mask)
    tl.store(dst_ptr + base + 3, c03, mask=mask)
    tl.store(dst_ptr + base + 4, c10, mask=mask)
    tl.store(dst_ptr + base + 5, c11, mask=mask)
    tl.store(dst_ptr + base + 6, c12, mask=mask)
    tl.store(dst_ptr + base + 7, c13, mask=mask)
    tl.store(dst_ptr + base + 8, c20, mask=mask)
    tl.store(dst_ptr + base + 9, c21, mask=mask)
    tl.store(dst_ptr + base + 10, c22, mask=mask)
    tl.store(dst_ptr + base + 11, c23, mask=mask)
    tl.store(dst_ptr + base + 12, c30, mask=mask)
    tl.store(dst_ptr + base + 13, c31, mask=mask)
    tl.store(dst_ptr + base + 14, c32, mask=mask)
    tl.store(dst_ptr + base + 15, c33, mask=mask)


@triton.jit
def _exp_like_torch(x, INTERPRET: tl.constexpr):
    # torch's CUDA kernels call expf: libdevice's accurate exp, not Triton's tl.exp (ex2.approx of a rounded
    # x·log2(e), whose error grows with |x|); libdevice does not run under the interpreter (numpy's exp)
    if INTERPRET:
        return tl.exp(x)
    return libdevice.exp(x)


@triton.jit
def _sinkhorn_tile_exact(x, eps, ITERS: tl.constexpr, I_AXIS: tl.constexpr, J_AXIS: tl.constexpr,
                         INTERPRET: tl.constexpr):
    """Sinkhorn of the [N(i), N(j)] matrices of the register tile x (axes I_AXIS, J_AXIS)."""
    # softmax over j, then + eps
    e = _exp_like_torch(x - tl.max(x, axis=J_AXIS, keep_dims=True), INTERPRET)
    c = tl.div_rn(e, tl.sum(e, axis=J_AXIS, keep_dims=True)) + eps
    # columns: sum over i
    c = tl.div_rn(c, tl.sum(c, axis=I_AXIS, keep_dims=True) + eps)
    for _ in range(ITERS - 1):
        c = tl.div_rn(c, tl.sum(c, axis=J_AXIS, keep_dims=True) + eps)  # rows
        c = tl.div_rn(c, tl.sum(c, axis=I_AXIS, keep_dims=True) + eps)  # columns
    return c


def _check(c0: torch.Tensor, iters: int, eps: float) -> int:
    if c0.dtype != torch.float32:
        raise ValueError(f"sinkhorn: c0 must be float32, got {c0.dtype}")
    if c0.dim() < 2 or c0.shape[-1] != c0.shape[-2]:
        raise ValueError(f"sinkhorn: c0 must be [..., N, N], got shape {tuple(c0.shape)}")
    n = c0.shape[-1]
    if n < 1 or n > MAX_N or n & (n - 1):
        raise ValueError(f"sinkhorn: N = c0.shape[-1] must be a power of two <= {MAX_N}, got {n}")
    if int(iters) < 1:
        raise ValueError(f"sinkhorn: iters must be >= 1, got {iters}")
    if not eps >= 0.0:
        raise ValueError(f"sinkhorn: eps must be >= 0, got {eps}")
    return n


def sinkhorn(c0: torch.Tensor, iters: int, eps: float, block_m: int | None = None,
             exact: bool | None = None) -> torch.Tensor:
    """Sinkhorn of every [N, N] matrix of c0 [..., N, N] (fp32, any leading dims, any strides: a
    non-contiguous c0 is copied once). `block_m` (matrices per program, a power of two) defaults to
    min(64, next_pow2(M)). `exact` picks the variant (default: M >= EXACT_ROWS_MIN matrices): True
    `_sinkhorn_exact_kernel` (PyTorch's CUDA orders, libdevice exp), False `_sinkhorn_kernel`. CPU
    tensors run under the Triton interpreter (TRITON_INTERPRET=1)."""
    n = _check(c0, iters, eps)
    x = c0.contiguous()
    out = torch.empty_like(x)
    m = x.numel() // (n * n)
    if m == 0:
        return out
    bm = block_m if block_m is not None else min(64, triton.next_power_of_2(m))
    if bm < 1 or bm & (bm - 1):
        raise ValueError(f"sinkhorn: block_m must be a power of two, got {bm}")
    if m >= EXACT_ROWS_MIN if exact is None else exact:
        _sinkhorn_exact_kernel[(triton.cdiv(m, bm),)](x, out, m, float(eps), ITERS=int(iters), N=n, BLOCK_M=bm,
                                                     INTERPRET=interpret_flag(x),
                                                     num_warps=1 if bm * n * n <= 512 else 2, **pdl_launch(x))
    else:  # decode-sized: the kernel and launch of the tree's decode path before issue 22's re-land
        _sinkhorn_kernel[(triton.cdiv(m, bm),)](x, out, m, float(eps), ITERS=int(iters), N=n, BLOCK_M=bm,
                                               num_warps=1 if bm * n * n <= 512 else 2, **pdl_launch(x))
    return out


def sinkhorn_cuda_order(c0: torch.Tensor, iters: int, eps: float, exp=torch.exp) -> torch.Tensor:
    """The eager Sinkhorn of 4 x 4 matrices (c0 [..., 4, 4] fp32) with the sums added in PyTorch's CUDA
    orders (the comment above `_softmax4`), in torch ops: what the kernels compute for N = 4, and on CUDA
    (exp = expf) eager's own result. `exp`: the exponential (the tests pass the interpreter's numpy one)."""
    def rows(c):  # Σ_j as a 4-lane shuffle tree
        return ((c[..., 0] + c[..., 2]) + (c[..., 1] + c[..., 3]))[..., None]

    def cols(c):  # Σ_i in order
        return (((c[..., 0, :] + c[..., 1, :]) + c[..., 2, :]) + c[..., 3, :])[..., None, :]

    e = exp(c0 - c0.amax(-1, keepdim=True))
    c = e / rows(e) + eps
    c = c / (cols(c) + eps)
    for _ in range(iters - 1):
        c = c / (rows(c) + eps)
        c = c / (cols(c) + eps)
    return c


def sinkhorn_ref(c0: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """The eager model's Sinkhorn (the specification), unchanged."""
    from dsv4c.model.v4 import sinkhorn as model_sinkhorn

    return model_sinkhorn(c0, iters, eps)


# ---------------------------------------------------------------------------------------------
# custom op for the FX rewrite of the eager Sinkhorn subgraph (passes/fuse_sinkhorn.py)


@torch.library.custom_op("dsv4c::sinkhorn", mutates_args=())
def sinkhorn_op(c0: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """`sinkhorn` on CUDA tensors; on CPU the reference math (artifacts run there with
    emulate=True; the interpreter tests call `sinkhorn` directly)."""
    if c0.device.type == "cpu":
        _check(c0, iters, eps)
        return sinkhorn_ref(c0, iters, eps)
    return sinkhorn(c0, iters, eps)


@sinkhorn_op.register_fake
def _sinkhorn_fake(c0, iters, eps):
    return torch.empty_like(c0)


# =============================================================================================
# mHC pre and post (`HyperConnection.pre` / `.post` of dsv4c/model/v4.py) as two + one launches
# =============================================================================================
# Legend: M tokens (prod of the leading dims), N hc streams, D hidden, K = N·D, MIX = (2 + N)·N
# mixing coefficients, S split-K chunks.
#
# pre(X [M, N, D], fn [MIX, K], base [MIX], scale [3]):
#   z = (fn · vec(X)) · rsqrt(mean(vec(X)²) + eps)                       (hc_project, fp32)
#   pre = σ(s0·z[:N] + b[:N]) + hc_eps;  post = 2·σ(s1·z[N:2N] + b[N:2N])
#   comb = sinkhorn(s2·z[2N:] + b[2N:] as [N, N]);  u = Σ_k pre_k·X[k]   (u in X's dtype)
# Launch 1 (`_hc_mix_kernel`, grid [⌈M/BLOCK_M⌉, S]): each program multiplies a BLOCK_M × CHUNK
#   slice of vec(X) by the matching CHUNK columns of fn (fp32 IEEE dot) and sums the squares of
#   the slice: partials zp [S, M, MIXP], ssp [S, M]. Splitting K spreads the fn read (1.5 MB at
#   Flash dims) over many SMs at batch 1.
# Launch 2 (`_hc_pre_finish_kernel`, grid [M, ⌈D/BLOCK_D⌉]): each program sums its token's partials
#   (fixed order: deterministic), forms pre and writes its BLOCK_D slice of u; the d-block 0
#   program also writes post and comb (Sinkhorn in registers, `_sinkhorn_tile`).
# post(y [M, D], X [M, N, D], post [M, N], comb [M, N, N]):
#   X'[k] = post_k·y + Σ_j comb[j, k]·X[j]   (fp32, cast to X's dtype), `_hc_post_kernel`, grid
#   [M, ⌈D/BLOCK_D⌉].
# Grids depend on shapes only and no launch reads device data on the host: capture-safe.
HC_BLOCK_K = 64
HC_CHUNK = 128  # K per split-K program (a multiple of HC_BLOCK_K)
HC_BLOCK_D = 512
HC_FINISH_WARPS = 1
# Tokens up to which hc_pre's first launch is _hc_mix_rows_kernel (one row a program, fn read once a row from L2),
# above them the tiled _hc_mix_kernel. run81 (H200, a site: hc_post then hc_pre, Flash dims, CUDA graph, inputs
# past twice the L2): the row kernel 15.6 / 22.9 / 34.3 µs at 16 / 32 / 64 tokens against the tile's 46.7 /
# 41.7 / 52.5. run82 (H200, the 2-layer slice, FP8 block experts, GPU alone, interleaved): 64 against 8 took
# batch 64 3.137 / 3.138 vs 3.208 / 3.209 ms, batch 32 2.306 / 2.301 vs 2.340 / 2.349.
HC_ROWS_MAX = 64
HC_ROWS_WARPS = 2
# Tokens up to which hc_post_pre chains the pair (two launches): _hc_post_mix_kernel's programs load fn's tiles
# once a token, so at many tokens hc_post then hc_pre's own launches read less.
HC_CHAIN_MAX = 8
# Token rows per program of the deterministic mode's first hc_pre launch (hc_pre_rows): 1 is the row kernel; 16,
# 32 or 64 the tiled `_hc_mix_kernel` with that BLOCK_M at every token count (its fp32 IEEE dot sums each row
# alone, in one order for a fixed tile: batch-invariant). run60 (H100, the 2-layer slice's deterministic verify of
# 1 + 3 tokens, FP8 block experts, GPU alone, interleaved): batch 64 8.201 / 8.184 ms with 16 against 8.279 /
# 8.275 with the row kernel (313 µs of it), batch 8 3.428 vs 3.434 ms; run62: tests/test_deterministic.py -m gpu
# passes with 16.
# In the deterministic decode step it costs (run63, H200, GPU alone): batch 1 0.812 vs 0.801 ms, batch 8 1.300 vs
# 1.292. The two kernels round differently, so the tile cannot follow the token count; kept for the verify.
HC_BI_ROW_BLOCK = 16
# d columns per program of _hc_post_mix_kernel: N·32 = 128 of K a program, 12 KB of fn at Flash dims, as the
# row kernel's measured best (chunk 128, HC_ROWS_WARPS; 128 programs a token at D = 4096)
HC_CHAIN_BLOCK_D = 32
# _hc_post_mix_kernel requests its fn tiles (a weight) before its PDL wait up to this many token rows, after it
# from one more (0: never). Each token's programs load the same tiles, so early loads at M rows are M copies of
# fn's 1.5 MB (Flash) requested while the predecessor (wo_b's GEMV) still runs. run57 (H100, the 2-layer slice
# at batch 1): the critical path's small kernels 161 µs early, 170 / 174 µs late (the step on the GPU alone 0.837
# ms, 0.837 / 0.848 late: within the runs' spread). run73 (H100, the same at batch 8): late 1.459 / 1.457 ms
# against early 1.477 / 1.473 (1.011x). The fast finish's Sinkhorn as 16 scalars per thread (`_sinkhorn4_io`)
# was tried in run57 too: 50 µs slower a step, dropped.
HC_EARLY_FN_MAX_ROWS = 1
# H200, one hc_pre replayed in a CUDA graph at Flash dims (N 4, D 4096), BENCHMARKS.md fourth session:
# chunk 512 / 4 warps took 32 / 33 / 59 us at M = 1 / 8 / 64; chunk 128 / 2 warps 26 / 26 / 33 us.
# Seventh session: with the Sinkhorn input reloaded (in _hc_pre_finish_kernel) and the row launch for
# M <= 8, chunk 128 and 1 finish warp take 9.4 / 10.4 / 19.3 us (2 warps 10.1 / 11.0 / 20.1; without
# the reload 22 / 23 / 32).


@triton.jit
def _hc_mix_kernel(x_ptr, fn_ptr, zp_ptr, ssp_ptr, M, K, MIX,
                   CHUNK: tl.constexpr, MIXP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
                   PDL: tl.constexpr = False):
    pdl_wait(PDL)
    # x [M, K] (any float dtype), fn [MIX, K] fp32 -> zp [S, M, MIXP], ssp [S, M] fp32
    pid_m, pid_s = tl.program_id(0), tl.program_id(1)
    m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    j = tl.arange(0, MIXP)
    kk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, MIXP), dtype=tl.float32)
    ss = tl.zeros((BLOCK_M,), dtype=tl.float32)
    k0 = pid_s * CHUNK
    for k1 in range(0, CHUNK, BLOCK_K):
        k = k0 + k1 + kk
        xm = (m[:, None] < M) & (k[None, :] < K)
        x = tl.load(x_ptr + m[:, None].to(tl.int64) * K + k[None, :], mask=xm, other=0.0).to(tl.float32)
        wm = (k[:, None] < K) & (j[None, :] < MIX)
        w = tl.load(fn_ptr + j[None, :].to(tl.int64) * K + k[:, None], mask=wm, other=0.0)  # [BLOCK_K, MIXP]
        acc = tl.dot(x, w, acc, input_precision="ieee")
        ss += tl.sum(x * x, axis=1)
    row = pid_s.to(tl.int64) * M + m
    tl.store(zp_ptr + row[:, None] * MIXP + j[None, :], acc, mask=(m < M)[:, None] & (j[None, :] < MIXP))
    tl.store(ssp_ptr + row, ss, mask=m < M)


@triton.jit
def _hc_mix_rows_kernel(x_ptr, fn_ptr, zp_ptr, ssp_ptr, M, K, MIX,
                        CHUNK: tl.constexpr, MIXP: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr = False):
    pdl_wait(PDL)
    # the same partials as _hc_mix_kernel, one token row per program and no tl.dot (few rows: the
    # dot's 16-row minimum would waste 15/16 of it): zp[s, m, j] = Σ_k fn[j, k]·x[m, k] over chunk s
    m, pid_s = tl.program_id(0), tl.program_id(1)
    j = tl.arange(0, MIXP)
    kk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((MIXP,), dtype=tl.float32)
    ss = tl.zeros((BLOCK_K,), dtype=tl.float32)
    k0 = pid_s * CHUNK
    for k1 in range(0, CHUNK, BLOCK_K):
        k = k0 + k1 + kk
        x = tl.load(x_ptr + m.to(tl.int64) * K + k, mask=k < K, other=0.0).to(tl.float32)  # [BLOCK_K]
        wm = (j[:, None] < MIX) & (k[None, :] < K)
        w = tl.load(fn_ptr + j[:, None].to(tl.int64) * K + k[None, :], mask=wm, other=0.0)  # [MIXP, BLOCK_K]
        acc += tl.sum(w * x[None, :], axis=1)
        ss += x * x
    row = pid_s.to(tl.int64) * M + m
    tl.store(zp_ptr + row * MIXP + j, acc)
    tl.store(ssp_ptr + row, tl.sum(ss, axis=0))


@triton.jit
def _sigmoid_like_torch(t, INTERPRET: tl.constexpr):
    # torch's CUDA sigmoid: 1 / (1 + expf(-t)), an IEEE division (Triton's tl.sigmoid: approximate exp and /)
    return tl.div_rn(tl.full(t.shape, 1.0, tl.float32), 1.0 + _exp_like_torch(-t, INTERPRET))


@triton.jit
def _hc_sumsq_kernel(x_ptr, ssp_ptr, K, BW: tl.constexpr, YS: tl.constexpr, STEPS: tl.constexpr,
                     VEC: tl.constexpr, LOG_BW: tl.constexpr, LOG_YS: tl.constexpr, PDL: tl.constexpr = False):
    pdl_wait(PDL)
    # ssp[m] = Σ_k x[m, k]² in PyTorch's CUDA order for the launch's rows (eager's mean of vec(X)²)
    row = tl.program_id(0).to(tl.int64)
    tl.store(ssp_ptr + row, row_sumsq(x_ptr + row * K, K, BW, YS, STEPS, VEC, LOG_BW, LOG_YS))


@triton.jit
def _finish_post_comb(zp_ptr, zrow, sm, r, scale_ptr, base_ptr, post_ptr, comb_ptr, pid_m, hc_eps,
                      N: tl.constexpr, ITERS: tl.constexpr, EXACT: tl.constexpr, INTERPRET: tl.constexpr):
    """hc_pre's finish, token pid_m: post = 2·sigmoid(s₁·z_post·r + b) and comb = Sinkhorn(s₂·z_comb·r + b)
    from the token's mix partials (rows zrow, valid where sm). EXACT: PyTorch's sigmoid and CUDA summation
    orders (the exact finish kernel), else the fast ones."""
    n = tl.arange(0, N)
    z_post = tl.sum(tl.load(zp_ptr + zrow[:, None] + N + n[None, :], mask=sm[:, None], other=0.0), axis=0) * r
    if EXACT:
        post = 2 * _sigmoid_like_torch(tl.load(scale_ptr + 1) * z_post + tl.load(base_ptr + N + n), INTERPRET)
    else:
        post = 2 * tl.sigmoid(tl.load(scale_ptr + 1) * z_post + tl.load(base_ptr + N + n))
    tl.store(post_ptr + pid_m.to(tl.int64) * N + n, post)
    ij = n[:, None] * N + n[None, :]  # [N(i), N(j)]
    zc = tl.load(zp_ptr + zrow[:, None, None] + 2 * N + ij[None, :, :], mask=sm[:, None, None], other=0.0)
    c0 = tl.load(scale_ptr + 2) * (tl.sum(zc, axis=0) * r) + tl.load(base_ptr + 2 * N + ij)
    # c0 inherits the layout of the [S_P, N, N] partials it was summed from: spread over every
    # warp, each Sinkhorn reduction then needs shared memory and barriers. Stored and loaded back,
    # the [N, N] tile gets the compact layout of a fresh load (H200: the launch 18.4 -> 6.1 us).
    tl.store(comb_ptr + pid_m.to(tl.int64) * N * N + ij, c0)
    tl.debug_barrier()
    if EXACT and N == 4:  # PyTorch's CUDA summation orders (_sinkhorn4_io), in place
        one = tl.arange(0, 1)[:, None]
        _sinkhorn4_io(comb_ptr, comb_ptr, pid_m.to(tl.int64) * 16 + one, one < 1, hc_eps, ITERS, INTERPRET)
    else:
        c0 = tl.load(comb_ptr + pid_m.to(tl.int64) * N * N + ij)
        if EXACT:
            comb = _sinkhorn_tile_exact(c0, hc_eps, ITERS, 0, 1, INTERPRET)
        else:
            comb = _sinkhorn_tile(c0, hc_eps, ITERS, 0, 1)
        tl.store(comb_ptr + pid_m.to(tl.int64) * N * N + ij, comb)


@triton.jit
def _hc_pre_finish_kernel(x_ptr, zp_ptr, ssp_ptr, base_ptr, scale_ptr, u_ptr, post_ptr, comb_ptr,
                          M, D, S, inv_k, eps, hc_eps,
                          ITERS: tl.constexpr, N: tl.constexpr, MIXP: tl.constexpr, S_P: tl.constexpr,
                          BLOCK_D: tl.constexpr, HEAD: tl.constexpr = False, PDL: tl.constexpr = False):
    pdl_wait(PDL)
    pid_m, pid_d = tl.program_id(0), tl.program_id(1)
    s = tl.arange(0, S_P)
    n = tl.arange(0, N)
    sm = s < S
    zrow = (s.to(tl.int64) * M + pid_m) * MIXP  # [S_P] offsets of this token's partial rows
    ss = tl.sum(tl.load(ssp_ptr + s.to(tl.int64) * M + pid_m, mask=sm, other=0.0), axis=0)
    r = 1.0 / tl.sqrt_rn(ss * inv_k + eps)  # rsqrt(mean(x²) + eps)
    z_pre = tl.sum(tl.load(zp_ptr + zrow[:, None] + n[None, :], mask=sm[:, None], other=0.0), axis=0) * r
    pre = tl.sigmoid(tl.load(scale_ptr) * z_pre + tl.load(base_ptr + n)) + hc_eps  # [N]

    d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    dm = d < D
    xoffs = pid_m.to(tl.int64) * N * D + n[:, None] * D + d[None, :]
    x = tl.load(x_ptr + xoffs, mask=dm[None, :], other=0.0).to(tl.float32)  # [N, BLOCK_D]
    u = tl.sum(pre[:, None] * x, axis=0)
    tl.store(u_ptr + pid_m.to(tl.int64) * D + d, u.to(u_ptr.dtype.element_ty), mask=dm)

    if not HEAD and pid_d == 0:  # HEAD (hc_head): z holds the N pre coefficients only
        _finish_post_comb(zp_ptr, zrow, sm, r, scale_ptr, base_ptr, post_ptr, comb_ptr, pid_m, hc_eps, N, ITERS,
                          False, False)


@triton.jit
def _hc_pre_finish_exact_kernel(x_ptr, zp_ptr, ssp_ptr, base_ptr, scale_ptr, u_ptr, post_ptr, comb_ptr,
                                M, D, S, inv_k, eps, hc_eps,
                                ITERS: tl.constexpr, N: tl.constexpr, MIXP: tl.constexpr, S_P: tl.constexpr,
                                BLOCK_D: tl.constexpr, INTERPRET: tl.constexpr, HEAD: tl.constexpr = False,
                                PDL: tl.constexpr = False):
    pdl_wait(PDL)
    # Launched without FMA contraction: every product and sum below is rounded once, as the eager
    # graph's separate ATen ops round them (s·z, + b, pre·X, the sum over the streams).
    pid_m, pid_d = tl.program_id(0), tl.program_id(1)
    s = tl.arange(0, S_P)
    n = tl.arange(0, N)
    sm = s < S
    zrow = (s.to(tl.int64) * M + pid_m) * MIXP  # [S_P] offsets of this token's partial rows
    ss = tl.sum(tl.load(ssp_ptr + s.to(tl.int64) * M + pid_m, mask=sm, other=0.0), axis=0)
    r = tl.math.rsqrt(ss * inv_k + eps)  # eager: mean, + eps, torch.rsqrt (rsqrt.approx, as CUDA's rsqrtf)
    z_pre = tl.sum(tl.load(zp_ptr + zrow[:, None] + n[None, :], mask=sm[:, None], other=0.0), axis=0) * r
    pre = _sigmoid_like_torch(tl.load(scale_ptr) * z_pre + tl.load(base_ptr + n), INTERPRET) + hc_eps  # [N]

    d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    dm = d < D
    # u = Σ_k pre_k·X[k]: eager multiplies (rounded), then sums the N products as PyTorch's reduction over
    # a non-innermost dim does: accumulator k % 4 takes the k-th product in order, then ((a0 + a1) + a2) + a3
    a0 = tl.zeros((BLOCK_D,), dtype=tl.float32)
    a1 = tl.zeros((BLOCK_D,), dtype=tl.float32)
    a2 = tl.zeros((BLOCK_D,), dtype=tl.float32)
    a3 = tl.zeros((BLOCK_D,), dtype=tl.float32)
    for k in tl.static_range(N):
        pk = tl.sum(tl.where(n == k, pre, 0.0), axis=0)  # pre[k] (adds zeros: exact)
        xk = tl.load(x_ptr + pid_m.to(tl.int64) * N * D + k * D + d, mask=dm, other=0.0).to(tl.float32)
        if k % 4 == 0:
            a0 = a0 + pk * xk
        elif k % 4 == 1:
            a1 = a1 + pk * xk
        elif k % 4 == 2:
            a2 = a2 + pk * xk
        else:
            a3 = a3 + pk * xk
    u = ((a0 + a1) + a2) + a3
    tl.store(u_ptr + pid_m.to(tl.int64) * D + d, u.to(u_ptr.dtype.element_ty), mask=dm)

    if not HEAD and pid_d == 0:
        _finish_post_comb(zp_ptr, zrow, sm, r, scale_ptr, base_ptr, post_ptr, comb_ptr, pid_m, hc_eps, N, ITERS,
                          True, INTERPRET)


@triton.jit
def _load_y(y_ptr, y2_ptr, off, dm, HAS_Y2: tl.constexpr, RNE_BF16: tl.constexpr):
    """fp32 [BLOCK_D]: y, or with HAS_Y2 the sum y + y2 rounded to y's dtype (what the eager `y + y2` stores;
    RNE_BF16: under the interpreter, whose bf16 cast truncates)."""
    y = tl.load(y_ptr + off, mask=dm, other=0.0).to(tl.float32)
    if HAS_Y2:
        y2 = tl.load(y2_ptr + off, mask=dm, other=0.0).to(tl.float32)
        y = round_to(y + y2, y_ptr.dtype.element_ty, RNE_BF16)
    return y


@triton.jit
def _post_tile(y_ptr, y2_ptr, x_ptr, post_ptr, comb_ptr, tok, d, dm, D, N: tl.constexpr, BLOCK_D: tl.constexpr,
               HAS_Y2: tl.constexpr, RNE_BF16: tl.constexpr):
    """fp32 [N, BLOCK_D]: X'[k, d] = post_k·y[d] + Σ_j comb[j, k]·X[j, d] of token `tok` (0 where not dm)."""
    k = tl.arange(0, N)
    y = _load_y(y_ptr, y2_ptr, tok * D + d, dm, HAS_Y2, RNE_BF16)
    acc = tl.zeros((N, BLOCK_D), dtype=tl.float32)
    for jj in tl.static_range(N):
        cj = tl.load(comb_ptr + tok * N * N + jj * N + k)  # comb[j, :]  [N(k)]
        xj = tl.load(x_ptr + tok * N * D + jj * D + d, mask=dm, other=0.0).to(tl.float32)
        acc += cj[:, None] * xj[None, :]
    p = tl.load(post_ptr + tok * N + k)
    return p[:, None] * y[None, :] + acc


@triton.jit
def _hc_post_kernel(y_ptr, y2_ptr, x_ptr, post_ptr, comb_ptr, out_ptr, D, N: tl.constexpr, BLOCK_D: tl.constexpr,
                    HAS_Y2: tl.constexpr = False, RNE_BF16: tl.constexpr = False, PDL: tl.constexpr = False):
    pdl_wait(PDL)
    pid_m, pid_d = tl.program_id(0), tl.program_id(1)
    k = tl.arange(0, N)
    d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    dm = d < D
    tok = pid_m.to(tl.int64)
    out = _post_tile(y_ptr, y2_ptr, x_ptr, post_ptr, comb_ptr, tok, d, dm, D, N, BLOCK_D, HAS_Y2, RNE_BF16)
    tl.store(out_ptr + tok * N * D + k[:, None] * D + d[None, :], out.to(out_ptr.dtype.element_ty),
             mask=dm[None, :])


@triton.jit
def _hc_post_mix_kernel(y_ptr, y2_ptr, x_ptr, post_ptr, comb_ptr, out_ptr, fn_ptr, zp_ptr, ssp_ptr, M, D, MIX,
                        N: tl.constexpr, MIXP: tl.constexpr, BLOCK_D: tl.constexpr, EARLY_FN: tl.constexpr = False,
                        HAS_Y2: tl.constexpr = False, RNE_BF16: tl.constexpr = False, PDL: tl.constexpr = False):
    """hc_post and the first launch of the next site's hc_pre in one: the program's [N, BLOCK_D] slice of
    X' (as `_hc_post_kernel`), stored in X's dtype, then that slice's share of z and of Σ X'² over X' as
    stored: zp[pid_d, m, j] = Σ_{k, d in the slice} fn[j, k·D + d]·X'[k, d], ssp[pid_d, m] = Σ X'[k, d]².
    These are hc_pre's partials split by d-block (S = ⌈D/BLOCK_D⌉) instead of by K chunk."""
    pid_m, pid_d = tl.program_id(0), tl.program_id(1)
    k = tl.arange(0, N)
    j = tl.arange(0, MIXP)
    d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    dm = d < D
    tok = pid_m.to(tl.int64)
    if EARLY_FN:  # fn is a weight, fixed before the step: its N tiles are requested before the PDL wait
        # [N, MIXP, BD] fn[j, k·D + d]
        w_all = tl.load(fn_ptr + j[None, :, None].to(tl.int64) * (N * D) + k[:, None, None] * D + d[None, None, :],
                        mask=(j[None, :, None] < MIX) & dm[None, None, :], other=0.0)
    pdl_wait(PDL)
    xq = _post_tile(y_ptr, y2_ptr, x_ptr, post_ptr, comb_ptr, tok, d, dm, D, N, BLOCK_D, HAS_Y2,
                    RNE_BF16).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + tok * N * D + k[:, None] * D + d[None, :], xq, mask=dm[None, :])
    xr = xq.to(tl.float32)                                                            # [N, BD], 0 where not dm
    if EARLY_FN:
        acc = tl.sum(tl.sum(w_all * xr[:, None, :], axis=2), axis=0)                  # [MIXP]
    else:
        acc = tl.zeros((MIXP,), dtype=tl.float32)
        for kk in tl.static_range(N):
            row = tl.sum(tl.where(k[:, None] == kk, xr, 0.0), axis=0)                 # X'[kk, slice]  [BD]
            wm = (j[:, None] < MIX) & dm[None, :]
            w = tl.load(fn_ptr + j[:, None].to(tl.int64) * (N * D) + kk * D + d[None, :], mask=wm, other=0.0)
            acc += tl.sum(w * row[None, :], axis=1)                                   # [MIXP]
    srow = pid_d.to(tl.int64) * M + pid_m
    tl.store(zp_ptr + srow * MIXP + j, acc)
    tl.store(ssp_ptr + srow, tl.sum(tl.sum(xr * xr, axis=1), axis=0))


@triton.jit
def _hc_post_exact_kernel(y_ptr, y2_ptr, x_ptr, post_ptr, comb_ptr, out_ptr, D, N: tl.constexpr,
                          BLOCK_D: tl.constexpr, HAS_Y2: tl.constexpr = False, RNE_BF16: tl.constexpr = False,
                          PDL: tl.constexpr = False):
    pdl_wait(PDL)
    pid_m, pid_d = tl.program_id(0), tl.program_id(1)
    k = tl.arange(0, N)
    d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    dm = d < D
    tok = pid_m.to(tl.int64)
    y = _load_y(y_ptr, y2_ptr, tok * D + d, dm, HAS_Y2, RNE_BF16)
    acc = tl.zeros((N, BLOCK_D), dtype=tl.float32)
    for jj in tl.static_range(N):
        cj = tl.load(comb_ptr + tok * N * N + jj * N + k)  # comb[j, :]  [N(k)]
        xj = tl.load(x_ptr + tok * N * D + jj * D + d, mask=dm, other=0.0).to(tl.float32)
        acc = tl.fma(cj[:, None], xj[None, :], acc)  # eager's einsum is a batched GEMM: one FMA per j, in order
    p = tl.load(post_ptr + tok * N + k)
    out = p[:, None] * y[None, :] + acc  # eager: post·y rounded, then + mixed (launched without FMA fusion)
    tl.store(out_ptr + tok * N * D + k[:, None] * D + d[None, :], out.to(out_ptr.dtype.element_ty),
             mask=dm[None, :])


_HC_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _check_streams(name: str, X: torch.Tensor) -> tuple[int, int]:
    if X.dtype not in _HC_DTYPES:
        raise ValueError(f"{name}: X must be float32/bfloat16/float16, got {X.dtype}")
    if X.dim() < 3:
        raise ValueError(f"{name}: X must be [..., N, D], got shape {tuple(X.shape)}")
    n, d = X.shape[-2], X.shape[-1]
    if n < 1 or n > MAX_N or n & (n - 1):
        raise ValueError(f"{name}: N = X.shape[-2] must be a power of two <= {MAX_N}, got {n}")
    return n, d


def _check_f32(name: str, what: str, t: torch.Tensor, shape: tuple) -> None:
    if t.dtype != torch.float32:
        raise ValueError(f"{name}: {what} must be float32, got {t.dtype}")
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name}: {what} must have shape {list(shape)}, got {list(t.shape)}")


def _check_pre(X, fn, base, scale, iters: int) -> tuple[int, int]:
    n, d = _check_streams("hc_pre", X)
    mix = (2 + n) * n
    _check_f32("hc_pre", "fn", fn, (mix, n * d))
    _check_f32("hc_pre", "base", base, (mix,))
    _check_f32("hc_pre", "scale", scale, (3,))
    if int(iters) < 1:
        raise ValueError(f"hc_pre: iters must be >= 1, got {iters}")
    return n, d


def hc_pre(X: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, eps: float,
           hc_eps: float, iters: int, chunk: int = HC_CHUNK, block_d: int = HC_BLOCK_D,
           finish_warps: int | None = None, rows: bool | None = None, exact: bool | None = None,
           eager_z: bool | None = None, row_block: int = 1):
    """The mHC pre-mix of X [..., N, D] (fp32/bf16/fp16; fn [MIX, N·D], base [MIX], scale [3] fp32) ->
    (u [..., D] in X's dtype, post [..., N] fp32, comb [..., N, N] fp32). Two launches. `chunk` (K
    per split-K program, a multiple of 64), `block_d` (a power of two) and `finish_warps` (of the
    second launch) are tuning knobs; `rows` picks the one-row-per-program first launch (default:
    M <= HC_ROWS_MAX tokens). `exact` picks the variant (default: M >= EXACT_ROWS_MIN tokens): True
    the exact-order finish (`_hc_pre_finish_exact_kernel`), False the fast one (`_hc_pre_finish_kernel`).
    `eager_z` (default: `exact` and not `rows`; only with `exact`) takes z from eager's own ops instead
    of the first launch: the fp32 copy of X, torch's linear (cuBLAS on CUDA) and the sum of squares in
    PyTorch's CUDA order (`_hc_sumsq_kernel`), so that z, and with it u, post and comb, round exactly as
    eager's on CUDA. `row_block` (with `rows`): token rows per program of the first launch (1: the row kernel;
    16, 32, 64: the tiled one with that tile). CPU tensors run under the Triton interpreter."""
    n, d = _check_pre(X, fn, base, scale, iters)
    lead = X.shape[:-2]
    u = torch.empty((*lead, d), dtype=X.dtype, device=X.device)
    post = torch.empty((*lead, n), dtype=torch.float32, device=X.device)
    comb = torch.empty((*lead, n, n), dtype=torch.float32, device=X.device)
    _pre_launches("hc_pre", X, fn, base, scale, (u, post, comb), (2 + n) * n, False, eps, hc_eps, iters, chunk,
                  block_d, finish_warps, rows, exact, eager_z, row_block)
    return u, post, comb


def _pre_launches(name: str, X, fn, base, scale, outs, mix: int, head: bool, eps: float, hc_eps: float, iters: int,
                  chunk: int, block_d: int, finish_warps: int | None, rows: bool | None, exact: bool | None,
                  eager_z: bool | None, row_block: int = 1) -> None:
    """hc_pre's two launches (mix = (2 + N)·N), or hc_head's (`head`: mix = N, outs (u, u, u), u alone written).
    `row_block` 16, 32 or 64 (with rows): the tiled first launch with that tile at any token count."""
    n, d = X.shape[-2], X.shape[-1]
    if chunk < HC_BLOCK_K or chunk % HC_BLOCK_K:
        raise ValueError(f"{name}: chunk must be a positive multiple of {HC_BLOCK_K}, got {chunk}")
    if block_d < 1 or block_d & (block_d - 1):
        raise ValueError(f"{name}: block_d must be a power of two, got {block_d}")
    if row_block not in (1, 16, 32, 64):
        raise ValueError(f"{name}: row_block must be 1, 16, 32 or 64 (a tl.dot tile), got {row_block}")
    x = X.contiguous()
    fn, base, scale = fn.contiguous(), base.contiguous(), scale.contiguous()
    m, k = x.numel() // (n * d) if n * d else 0, n * d
    if m == 0:
        return
    if k == 0:
        raise ValueError(f"{name}: D must be >= 1")
    use_rows = m <= HC_ROWS_MAX if rows is None else rows
    use_exact = m >= EXACT_ROWS_MIN if exact is None else exact
    if eager_z and not use_exact:
        raise ValueError(f"{name}: eager_z needs the exact finish (exact=True)")
    if use_exact and (eager_z if eager_z is not None else not use_rows):
        zp, ssp, mixp, splits = _eager_z(x, fn, m, k, mix)
    else:
        mixp = max(16, triton.next_power_of_2(mix))
        splits = triton.cdiv(k, chunk)
        block_m = min(64, max(16, triton.next_power_of_2(m)))
        zp = torch.empty((splits, m, mixp), dtype=torch.float32, device=X.device)
        ssp = torch.empty((splits, m), dtype=torch.float32, device=X.device)
        if use_rows and row_block > 1:  # the tiled launch with a fixed tile of row_block rows
            _hc_mix_kernel[(triton.cdiv(m, row_block), splits)](x, fn, zp, ssp, m, k, mix, CHUNK=chunk, MIXP=mixp,
                                                                BLOCK_M=row_block, BLOCK_K=HC_BLOCK_K, num_warps=4,
                                                                **pdl_launch(x))
        elif use_rows:
            _hc_mix_rows_kernel[(m, splits)](x, fn, zp, ssp, m, k, mix, CHUNK=chunk, MIXP=mixp, BLOCK_K=HC_BLOCK_K,
                                             num_warps=HC_ROWS_WARPS, **pdl_launch(x))
        else:
            _hc_mix_kernel[(triton.cdiv(m, block_m), splits)](x, fn, zp, ssp, m, k, mix, CHUNK=chunk, MIXP=mixp,
                                                              BLOCK_M=block_m, BLOCK_K=HC_BLOCK_K, num_warps=4,
                                                              **pdl_launch(x))
    _finish(x, zp, ssp, base, scale, outs, splits, mixp, eps, hc_eps, iters, block_d, finish_warps, use_exact,
            head=head)


def _check_head(X, fn, base, scale) -> tuple[int, int]:
    n, d = _check_streams("hc_head", X)
    _check_f32("hc_head", "fn", fn, (n, n * d))
    _check_f32("hc_head", "base", base, (n,))
    _check_f32("hc_head", "scale", scale, (1,))
    return n, d


def hc_head(X: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, eps: float, hc_eps: float,
            rows: bool | None = None, exact: bool | None = None) -> torch.Tensor:
    """The mHC collapse before the LM head, X [..., N, D] (fn [N, N·D], base [N], scale [1] fp32) -> u [..., D]
    in X's dtype: u = Σ_k (σ(scale·z_k + base_k) + hc_eps)·X[k], z = (fn·vec(X))·rsqrt(mean(vec(X)²) + eps)
    (deepseek_v4.md, mHC; the model's `hc_head_collapse`). hc_pre's launches with N mix rows and its finish
    writing u alone (the formula of hc_pre's `pre` with scale[0]): the same variants by row count (`rows`,
    `exact`), so prefill-sized launches round like eager. CPU tensors run under the Triton interpreter."""
    n, d = _check_head(X, fn, base, scale)
    u = torch.empty((*X.shape[:-2], d), dtype=X.dtype, device=X.device)
    _pre_launches("hc_head", X, fn, base, scale, (u, u, u), n, True, eps, hc_eps, 1, HC_CHUNK, HC_BLOCK_D, None,
                  rows, exact, None)
    return u


def hc_head_ref(X: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, eps: float,
                hc_eps: float) -> torch.Tensor:
    """The eager model's `hc_head_collapse` (the specification)."""
    from dsv4c.model.v4 import hc_head_collapse

    return hc_head_collapse(X, fn, base, scale, eps, hc_eps)


def _finish(x, zp, ssp, base, scale, outs, splits: int, mixp: int, eps: float, hc_eps: float, iters: int,
            block_d: int, finish_warps: int | None, exact: bool, head: bool = False) -> None:
    """hc_pre's second launch: x [M, N, D] contiguous, the partials zp [S, M, MIXP] / ssp [S, M] -> outs
    (u [M, D], post [M, N], comb [M, N, N]); `head` (hc_head): u only, post and comb are not written."""
    u, post, comb = outs
    n, d = x.shape[-2], x.shape[-1]
    m, k = x.numel() // (n * d), n * d
    bd = min(block_d, triton.next_power_of_2(d))
    if exact:
        _hc_pre_finish_exact_kernel[(m, triton.cdiv(d, bd))](
            x, zp, ssp, base, scale, u, post, comb, m, d, splits, 1.0 / k, float(eps), float(hc_eps),
            ITERS=int(iters), N=n, MIXP=mixp, S_P=triton.next_power_of_2(splits), BLOCK_D=bd,
            INTERPRET=interpret_flag(x), HEAD=head, num_warps=finish_warps or HC_FINISH_WARPS,
            enable_fp_fusion=False, **pdl_launch(x))
    else:  # decode-sized: the kernel and launch of the tree's decode path before issue 22's re-land
        _hc_pre_finish_kernel[(m, triton.cdiv(d, bd))](
            x, zp, ssp, base, scale, u, post, comb, m, d, splits, 1.0 / k, float(eps), float(hc_eps),
            ITERS=int(iters), N=n, MIXP=mixp, S_P=triton.next_power_of_2(splits), BLOCK_D=bd, HEAD=head,
            num_warps=finish_warps or HC_FINISH_WARPS, **pdl_launch(x))


def hc_post_pre(y: torch.Tensor, X: torch.Tensor, post: torch.Tensor, comb: torch.Tensor, fn: torch.Tensor,
                base: torch.Tensor, scale: torch.Tensor, eps: float, hc_eps: float, iters: int,
                chained: bool | None = None, block_d: int = HC_CHAIN_BLOCK_D, y2: torch.Tensor | None = None):
    """One site's post-mix and the next site's pre-mix: X' = hc_post(y, X, post, comb, y2=y2), then
    (u, post', comb') = hc_pre(X', fn, base, scale, eps, hc_eps, iters) -> (X', u, post', comb').
    `chained` (default: M <= HC_CHAIN_MAX tokens, decode) takes two launches, `_hc_post_mix_kernel` (X' and
    the partials of z split by d-block) and hc_pre's fast finish; otherwise hc_post then hc_pre, as unfused
    (three launches). CPU tensors run under the Triton interpreter."""
    n, d = _check_post(y, X, post, comb, y2)
    _check_pre(X, fn, base, scale, iters)  # X' has X's shape and dtype
    if block_d < 1 or block_d & (block_d - 1):
        raise ValueError(f"hc_post_pre: block_d must be a power of two, got {block_d}")
    m = X.numel() // (n * d) if n * d else 0
    if not (m <= HC_CHAIN_MAX if chained is None else chained):
        x2 = hc_post(y, X, post, comb, y2=y2)
        return (x2, *hc_pre(x2, fn, base, scale, eps, hc_eps, iters))
    lead = X.shape[:-2]
    x, y, post, comb = X.contiguous(), y.contiguous(), post.contiguous(), comb.contiguous()
    has_y2, y2 = y2 is not None, y if y2 is None else y2.contiguous()  # without y2: y in its place, unread
    fn, base, scale = fn.contiguous(), base.contiguous(), scale.contiguous()
    x2 = torch.empty_like(x)
    outs = (torch.empty((*lead, d), dtype=X.dtype, device=X.device),
            torch.empty((*lead, n), dtype=torch.float32, device=X.device),
            torch.empty((*lead, n, n), dtype=torch.float32, device=X.device))
    if m == 0:
        return (x2, *outs)
    mix, bd = (2 + n) * n, min(block_d, triton.next_power_of_2(d))
    mixp, splits = max(16, triton.next_power_of_2(mix)), triton.cdiv(d, bd)
    zp = torch.empty((splits, m, mixp), dtype=torch.float32, device=X.device)
    ssp = torch.empty((splits, m), dtype=torch.float32, device=X.device)
    _hc_post_mix_kernel[(m, splits)](y, y2, x, post, comb, x2, fn, zp, ssp, m, d, mix, N=n, MIXP=mixp, BLOCK_D=bd,
                                     EARLY_FN=m <= HC_EARLY_FN_MAX_ROWS, HAS_Y2=has_y2, RNE_BF16=rne_bf16(y, y.dtype),
                                     num_warps=HC_ROWS_WARPS, **pdl_launch(x))
    _finish(x2, zp, ssp, base, scale, outs, splits, mixp, eps, hc_eps, iters, HC_BLOCK_D, None, False)
    return (x2, *outs)


def hc_post_pre_ref(y, X, post, comb, fn, base, scale, eps: float, hc_eps: float, iters: int, y2=None):
    """The eager model's `HyperConnection.post` then `.pre` on its output (the specification)."""
    x2 = hc_post_ref(y, X, post, comb, y2)
    return (x2, *hc_pre_ref(x2, fn, base, scale, eps, hc_eps, iters))


def _eager_z(x: torch.Tensor, fn: torch.Tensor, m: int, k: int, mix: int):
    """(zp [1, M, MIX], ssp [1, M], MIX, 1): z = linear(vec(X) in fp32, fn), eager's call, and Σ vec(X)² in
    PyTorch's CUDA order for M rows (hc_project's mean, before its · fl(1/K))."""
    zp = torch.nn.functional.linear(x.view(m, k).float(), fn).view(1, m, mix)
    ssp = torch.empty((1, m), dtype=torch.float32, device=x.device)
    lay = reduce_layout(m, k)
    _hc_sumsq_kernel[(m,)](x, ssp, k, BW=lay.lanes, YS=lay.warps, STEPS=lay.steps, VEC=lay.vectorized,
                           LOG_BW=lay.lanes.bit_length() - 1, LOG_YS=lay.warps.bit_length() - 1,
                           num_warps=max(1, min(16, lay.lanes * lay.warps // 32)), enable_fp_fusion=False,
                           **pdl_launch(x))
    return zp, ssp, mix, 1


def hc_pre_ref(X: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, eps: float,
               hc_eps: float, iters: int):
    """The eager model's `HyperConnection.pre` (the specification), unchanged: called with the
    constants it reads from its module (N from X)."""
    from dsv4c.model.v4 import HyperConnection

    hc = SimpleNamespace(n=X.shape[-2], eps=eps, hc_eps=hc_eps, iters=iters)
    return HyperConnection.pre(hc, X, fn, base, scale)


def _check_post(y, X, post, comb, y2=None) -> tuple[int, int]:
    n, d = _check_streams("hc_post", X)
    lead = tuple(X.shape[:-2])
    if y.dtype not in _HC_DTYPES or tuple(y.shape) != (*lead, d):
        raise ValueError(f"hc_post: y must be a float tensor of shape {[*lead, d]}, got {y.dtype} {list(y.shape)}")
    if y2 is not None and (y2.dtype != y.dtype or y2.shape != y.shape or y2.device != y.device):
        raise ValueError(f"hc_post: y2 must match y ({y.dtype} {list(y.shape)} on {y.device}), "
                         f"got {y2.dtype} {list(y2.shape)} on {y2.device}")
    _check_f32("hc_post", "post", post, (*lead, n))
    _check_f32("hc_post", "comb", comb, (*lead, n, n))
    return n, d


def hc_post(y: torch.Tensor, X: torch.Tensor, post: torch.Tensor, comb: torch.Tensor,
            block_d: int = HC_BLOCK_D, exact: bool | None = None, y2: torch.Tensor | None = None) -> torch.Tensor:
    """The mHC post-mix: X'[..., k, :] = post[..., k]·y + Σ_j comb[..., j, k]·X[..., j, :], fp32 math,
    in X's dtype. y [..., D], X [..., N, D], post [..., N] fp32, comb [..., N, N] fp32. One launch.
    `y2` (y's shape and dtype): y is y + y2 rounded to y's dtype, the eager sum the kernel then reads
    (passes/fuse_moe_sum.py: the routed and shared experts' outputs).
    `exact` picks the variant (default: M >= EXACT_ROWS_MIN tokens): True `_hc_post_exact_kernel` (no
    FMA contraction but eager's own), False `_hc_post_kernel`."""
    n, d = _check_post(y, X, post, comb, y2)
    if block_d < 1 or block_d & (block_d - 1):
        raise ValueError(f"hc_post: block_d must be a power of two, got {block_d}")
    x, y, post, comb = X.contiguous(), y.contiguous(), post.contiguous(), comb.contiguous()
    has_y2, y2 = y2 is not None, y if y2 is None else y2.contiguous()  # without y2: y in its place, unread
    out = torch.empty_like(x)
    m = x.numel() // (n * d) if n * d else 0
    if m == 0:
        return out
    bd = min(block_d, triton.next_power_of_2(d))
    if m >= EXACT_ROWS_MIN if exact is None else exact:
        _hc_post_exact_kernel[(m, triton.cdiv(d, bd))](y, y2, x, post, comb, out, d, N=n, BLOCK_D=bd,
                                                       HAS_Y2=has_y2, RNE_BF16=rne_bf16(y, y.dtype),
                                                       num_warps=4 if n * bd >= 1024 else 1, enable_fp_fusion=False,
                                                       **pdl_launch(y))
    else:  # decode-sized: the kernel and launch of the tree's decode path before issue 22's re-land
        _hc_post_kernel[(m, triton.cdiv(d, bd))](y, y2, x, post, comb, out, d, N=n, BLOCK_D=bd, HAS_Y2=has_y2,
                                                 RNE_BF16=rne_bf16(y, y.dtype),
                                                 num_warps=4 if n * bd >= 1024 else 1, **pdl_launch(y))
    return out


def hc_post_ref(y: torch.Tensor, X: torch.Tensor, post: torch.Tensor, comb: torch.Tensor,
                y2: torch.Tensor | None = None) -> torch.Tensor:
    """The eager model's `HyperConnection.post` (the specification), unchanged, on y or on the eager
    sum y + y2."""
    from dsv4c.model.v4 import HyperConnection

    return HyperConnection.post(y if y2 is None else y + y2, X, post, comb)


# ---------------------------------------------------------------------------------------------
# custom ops for the FX rewrite of the eager mHC subgraphs (passes/fuse_hc.py)


@torch.library.custom_op("dsv4c::hc_pre", mutates_args=())
def hc_pre_op(X: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, eps: float,
              hc_eps: float, iters: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`hc_pre` on CUDA tensors; on CPU the model's own function (bit-exact with the unfused graph)."""
    if X.device.type == "cpu":
        _check_pre(X, fn, base, scale, iters)
        return hc_pre_ref(X, fn, base, scale, eps, hc_eps, iters)
    return hc_pre(X, fn, base, scale, eps, hc_eps, iters)


@hc_pre_op.register_fake
def _hc_pre_fake(X, fn, base, scale, eps, hc_eps, iters):
    lead, n, d = X.shape[:-2], X.shape[-2], X.shape[-1]
    return (X.new_empty((*lead, d)), X.new_empty((*lead, n), dtype=torch.float32),
            X.new_empty((*lead, n, n), dtype=torch.float32))


@torch.library.custom_op("dsv4c::hc_post", mutates_args=())
def hc_post_op(y: torch.Tensor, X: torch.Tensor, post: torch.Tensor, comb: torch.Tensor,
               y2: torch.Tensor | None = None) -> torch.Tensor:
    """`hc_post` on CUDA tensors; on CPU the model's own function (bit-exact with the unfused graph)."""
    if X.device.type == "cpu":
        _check_post(y, X, post, comb, y2)
        return hc_post_ref(y, X, post, comb, y2)
    return hc_post(y, X, post, comb, y2=y2)


@hc_post_op.register_fake
def _hc_post_fake(y, X, post, comb, y2=None):
    return torch.empty_like(X)


@torch.library.custom_op("dsv4c::hc_post_pre", mutates_args=())
def hc_post_pre_op(y: torch.Tensor, X: torch.Tensor, post: torch.Tensor, comb: torch.Tensor, fn: torch.Tensor,
                   base: torch.Tensor, scale: torch.Tensor, eps: float, hc_eps: float, iters: int,
                   y2: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`hc_post_pre` on CUDA tensors; on CPU the model's own functions (bit-exact with the unfused pair)."""
    if X.device.type == "cpu":
        _check_post(y, X, post, comb, y2)
        _check_pre(X, fn, base, scale, iters)
        return hc_post_pre_ref(y, X, post, comb, fn, base, scale, eps, hc_eps, iters, y2)
    return hc_post_pre(y, X, post, comb, fn, base, scale, eps, hc_eps, iters, y2=y2)


@hc_post_pre_op.register_fake
def _hc_post_pre_fake(y, X, post, comb, fn, base, scale, eps, hc_eps, iters, y2=None):
    return (torch.empty_like(X), *_hc_pre_fake(X, fn, base, scale, eps, hc_eps, iters))


@torch.library.custom_op("dsv4c::hc_head", mutates_args=())
def hc_head_op(X: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, eps: float,
               hc_eps: float) -> torch.Tensor:
    """`hc_head` on CUDA tensors; on CPU the model's own function (bit-exact with the unfused graph)."""
    if X.device.type == "cpu":
        _check_head(X, fn, base, scale)
        return hc_head_ref(X, fn, base, scale, eps, hc_eps)
    return hc_head(X, fn, base, scale, eps, hc_eps)


@hc_head_op.register_fake
def _hc_head_fake(X, fn, base, scale, eps, hc_eps):
    return X.new_empty((*X.shape[:-2], X.shape[-1]))


@torch.library.custom_op("dsv4c::hc_pre_rows", mutates_args=())
def hc_pre_rows_op(X: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, eps: float,
                   hc_eps: float, iters: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`hc_pre` with the one-row-per-program first launch and the fast finish at every token count (the
    deterministic mode: the default switches to the tiled kernel above HC_ROWS_MAX rows, which sums in
    another order, and to the exact variant from EXACT_ROWS_MIN). CPU: the model's function, as
    `dsv4c::hc_pre`."""
    if X.device.type == "cpu":
        _check_pre(X, fn, base, scale, iters)
        return hc_pre_ref(X, fn, base, scale, eps, hc_eps, iters)
    return hc_pre(X, fn, base, scale, eps, hc_eps, iters, rows=True, exact=False, row_block=HC_BI_ROW_BLOCK)


@hc_pre_rows_op.register_fake
def _hc_pre_rows_fake(X, fn, base, scale, eps, hc_eps, iters):
    return _hc_pre_fake(X, fn, base, scale, eps, hc_eps, iters)


@torch.library.custom_op("dsv4c::hc_post_bi", mutates_args=())
def hc_post_bi_op(y: torch.Tensor, X: torch.Tensor, post: torch.Tensor, comb: torch.Tensor,
                  y2: torch.Tensor | None = None) -> torch.Tensor:
    """`hc_post` with the fast kernel at every token count (the deterministic mode: `dsv4c::hc_post` picks
    its variant by the token count). CPU: the model's function, as `dsv4c::hc_post`."""
    if X.device.type == "cpu":
        _check_post(y, X, post, comb, y2)
        return hc_post_ref(y, X, post, comb, y2)
    return hc_post(y, X, post, comb, exact=False, y2=y2)


@hc_post_bi_op.register_fake
def _hc_post_bi_fake(y, X, post, comb, y2=None):
    return torch.empty_like(X)


@torch.library.custom_op("dsv4c::sinkhorn_bi", mutates_args=())
def sinkhorn_bi_op(c0: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """`sinkhorn` with the fast kernel and one matrix per program at every matrix count (the deterministic
    mode: `dsv4c::sinkhorn` picks its variant, and the fast kernel its tile, by the count). CPU: the model's
    function, as `dsv4c::sinkhorn`."""
    if c0.device.type == "cpu":
        _check(c0, iters, eps)
        return sinkhorn_ref(c0, iters, eps)
    return sinkhorn(c0, iters, eps, block_m=1, exact=False)


@sinkhorn_bi_op.register_fake
def _sinkhorn_bi_fake(c0, iters, eps):
    return torch.empty_like(c0)
