"""The mHC Sinkhorn normalisation (`dsv4c.model.v4.sinkhorn`) as one Triton kernel.

Public API::

    sinkhorn(c0, iters, eps, block_m=None) -> Tensor   # [..., N, N] fp32, the Triton kernel
    sinkhorn_ref(c0, iters, eps) -> Tensor             # the model's eager math (the spec)

Custom op (the target of passes/fuse_sinkhorn.py; fake impl = empty_like(c0))::

    dsv4c::sinkhorn(Tensor c0, int iters, float eps) -> Tensor

Semantics (deepseek_v4.md, mHC): per [N, N] matrix, softmax over the last dim (max subtracted),
+eps, divide each column by (its sum + eps), then (iters - 1) times: rows by (row sum + eps),
columns by (column sum + eps). Eagerly that is 6·iters − 1 tiny ATen kernels per mHC site (119 for
iters = 20, N = 4); here one program holds BLOCK_M whole matrices in registers for all iterations,
so a site is one launch. ITERS is a constexpr (the loop bound; the Triton interpreter cannot range
over a runtime scalar): one compiled variant per model config. The kernel performs the same operations in the same order as the eager code; divisions
are IEEE round-to-nearest (`tl.div_rn`, not the approximate fp32 `/`), so fp32 results agree with
`sinkhorn_ref` to a few ulp (the sums of N terms and `exp` may round differently).

Launch: grid = ceil(M / BLOCK_M) for M = prod(leading dims), fixed by the shape, no host sync:
capture-safe (split_at_routers.OP_CAPTURE). M = 0 launches nothing.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_N = 16  # N·N fp32 per matrix in registers; hc_mult is 4


@triton.jit
def _sinkhorn_kernel(c_ptr, out_ptr, M, eps, ITERS: tl.constexpr, N: tl.constexpr, BLOCK_M: tl.constexpr):
    # M matrices [N, N], contiguous; this program handles matrices [pid·BLOCK_M, (pid+1)·BLOCK_M)
    pid = tl.program_id(0)
    m = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    i = tl.arange(0, N)
    j = tl.arange(0, N)
    offs = m[:, None, None].to(tl.int64) * (N * N) + i[None, :, None] * N + j[None, None, :]
    mask = (m < M)[:, None, None] & (offs >= 0)  # full [BLOCK_M, N, N] mask of real matrices
    x = tl.load(c_ptr + offs, mask=mask, other=0.0)  # [BLOCK_M, N(i), N(j)]

    # softmax over j, then + eps
    e = tl.exp(x - tl.max(x, axis=2, keep_dims=True))
    c = tl.div_rn(e, tl.sum(e, axis=2, keep_dims=True)) + eps
    # columns: sum over i
    c = tl.div_rn(c, tl.sum(c, axis=1, keep_dims=True) + eps)
    for _ in range(ITERS - 1):
        c = tl.div_rn(c, tl.sum(c, axis=2, keep_dims=True) + eps)  # rows
        c = tl.div_rn(c, tl.sum(c, axis=1, keep_dims=True) + eps)  # columns
    tl.store(out_ptr + offs, c, mask=mask)


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


def sinkhorn(c0: torch.Tensor, iters: int, eps: float, block_m: int | None = None) -> torch.Tensor:
    """Sinkhorn of every [N, N] matrix of c0 [..., N, N] (fp32, any leading dims, any strides: a
    non-contiguous c0 is copied once). `block_m` (matrices per program, a power of two) defaults to
    min(64, next_pow2(M)). CPU tensors run under the Triton interpreter (TRITON_INTERPRET=1)."""
    n = _check(c0, iters, eps)
    x = c0.contiguous()
    out = torch.empty_like(x)
    m = x.numel() // (n * n)
    if m == 0:
        return out
    bm = block_m if block_m is not None else min(64, triton.next_power_of_2(m))
    if bm < 1 or bm & (bm - 1):
        raise ValueError(f"sinkhorn: block_m must be a power of two, got {bm}")
    _sinkhorn_kernel[(triton.cdiv(m, bm),)](x, out, m, float(eps), ITERS=int(iters), N=n, BLOCK_M=bm,
                                           num_warps=1 if bm * n * n <= 512 else 2)
    return out


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
