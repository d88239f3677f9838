"""The last step of the routed experts: each token's K expert outputs summed into one row.

Public API::

    combine_slots(y, inv, topk, out) -> out    # one Triton launch
    combine_slots_ref(y, inv, topk, out)        # torch: gather, sum over K in fp32, one rounding

Legend: T tokens, K choices per token, N_A = T·K assignments, N rows of y (N_A, or the padded rows
of the sorted layout), D hidden.

    out[t, :] = Σ_j y[row(t, j), :]       row(t, j) = inv[t·K + j] (sorted layout) or t·K + j (direct)

in fp32, added in j order, rounded once to out's dtype. The weights were applied before w2, so this
is a plain sum. Eagerly it was `torch.sum(y.view(T, K, D), 1)` (plus a gather `y[inv]` for the
sorted layout): one or two launches of ATen's generic reduction, ~5 us each at decode shapes on an
H200 where the data is 48 KB. Here one program per (token, D-block), grid fixed by the shapes:
capture-safe. CPU tensors run under the Triton interpreter.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsv4c.kernels._tl import pdl_supported, pdl_wait

BLOCK_D = 1024
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@triton.jit
def _moe_combine_kernel(y_ptr, inv_ptr, out_ptr, D, stride_y, stride_o, K: tl.constexpr, HAS_INV: tl.constexpr,
                        BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl_wait(PDL)   # launched early (programmatic dependent launch): y is ready once this returns
    t = tl.program_id(0).to(tl.int64)
    d = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    dm = d < D
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for j in tl.static_range(K):
        if HAS_INV:
            row = tl.load(inv_ptr + t * K + j).to(tl.int64)
        else:
            row = t * K + j
        acc += tl.load(y_ptr + row * stride_y + d, mask=dm, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * stride_o + d, acc.to(out_ptr.dtype.element_ty), mask=dm)


def _check(y: torch.Tensor, inv: torch.Tensor | None, topk: int, out: torch.Tensor) -> int:
    if y.dim() != 2 or out.dim() != 2 or y.shape[1] != out.shape[1]:
        raise ValueError(f"combine_slots: y [N, D] and out [T, D] must share D, got y {list(y.shape)}, "
                         f"out {list(out.shape)}")
    if y.dtype not in _DTYPES or out.dtype not in _DTYPES:
        raise ValueError(f"combine_slots: y and out must be bf16/fp16/fp32, got {y.dtype}, {out.dtype}")
    if y.stride(1) != 1 or out.stride(1) != 1:
        raise ValueError("combine_slots: y and out need unit stride in D")
    if topk < 1:
        raise ValueError(f"combine_slots: topk must be >= 1, got {topk}")
    n_a = out.shape[0] * topk
    if inv is None:
        if y.shape[0] < n_a:
            raise ValueError(f"combine_slots: y has {y.shape[0]} rows, the direct layout needs T·K = {n_a}")
    elif inv.dtype not in (torch.int32, torch.int64) or inv.shape != (n_a,) or not inv.is_contiguous():
        raise ValueError(f"combine_slots: inv must be a contiguous int32/int64 [T·K = {n_a}], got "
                         f"{inv.dtype} {list(inv.shape)}")
    return n_a


def combine_slots(y: torch.Tensor, inv: torch.Tensor | None, topk: int, out: torch.Tensor,
                  pdl: bool = False) -> torch.Tensor:
    """out [T, D] = Σ_j y[row(t, j)] (see the module doc); returns out. pdl: launch with
    programmatic dependent launch (sm_90+ GPUs only; the caller's chain must allow it, see
    kernels/moe_fp4_gemv.py)."""
    _check(y, inv, topk, out)
    t, d = out.shape
    if t == 0:
        return out
    if pdl and not pdl_supported(y.device):
        raise ValueError(f"combine_slots: pdl needs a CUDA GPU of capability >= 9.0, got {y.device}")
    launch = {"launch_pdl": True} if pdl else {}
    _moe_combine_kernel[(t, triton.cdiv(d, BLOCK_D))](y, inv if inv is not None else y, out, d, y.stride(0),
                                                       out.stride(0), K=topk, HAS_INV=inv is not None, BLOCK=BLOCK_D,
                                                       PDL=pdl, num_warps=4, **launch)
    return out


def combine_slots_ref(y: torch.Tensor, inv: torch.Tensor | None, topk: int, out: torch.Tensor) -> torch.Tensor:
    """The eager form: gather (sorted layout), sum over K in fp32, one rounding into out."""
    _check(y, inv, topk, out)
    t, d = out.shape
    rows = y[: t * topk] if inv is None else y[inv]
    out.copy_(rows.view(t, topk, d).float().sum(1))
    return out
