"""Routed-expert compute, shared by V4 and V3.

`moe_experts_loop` is the readable reference: one token, one chosen expert at a time.
`torch.ops.dsv4c.moe_experts` is the same function as a `torch.library.custom_op` with a fake
(shape-only) implementation, so that `torch.export` sees one opaque node with static output shape
[T, D] instead of data-dependent gathers. Passes find it by name and the quantize pass rewrites it.

Shapes: T tokens, D hidden, E experts, K experts per token, I expert width.
"""
from __future__ import annotations

import torch

from dsv4c.model.common import swiglu


def moe_experts_loop(x: torch.Tensor, idx: torch.Tensor, weight: torch.Tensor, w1: torch.Tensor,
                     w3: torch.Tensor, w2: torch.Tensor, swiglu_limit: float) -> torch.Tensor:
    """Σ_j weight[t,j] · expert_{idx[t,j]}(x[t]). A repeated expert id adds its contributions.
    x [T, D]; idx [T, K] int; weight [T, K] fp32; w1, w3 [E, I, D]; w2 [E, D, I] -> [T, D]."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(idx.shape[1]):
            e = int(idx[t, j])
            y = swiglu(x[t : t + 1], w1[e], w3[e], w2[e], swiglu_limit)
            out[t] += (y[0].float() * weight[t, j]).to(x.dtype)
    return out


@torch.library.custom_op("dsv4c::moe_experts", mutates_args=())
def moe_experts(x: torch.Tensor, idx: torch.Tensor, weight: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor,
                w2: torch.Tensor, swiglu_limit: float) -> torch.Tensor:
    """Grouped form of `moe_experts_loop`: sort the (token, choice) pairs by expert, run each expert
    that got tokens once. One host sync (the per-expert counts)."""
    out = torch.zeros_like(x)
    flat_idx = idx.reshape(-1)  # [T*K]
    order = flat_idx.argsort(stable=True)
    rows = order // idx.shape[1]  # token of each sorted pair
    flat_w = weight.reshape(-1)[order]
    counts = torch.bincount(flat_idx, minlength=w1.shape[0]).tolist()
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        t, wt = rows[start : start + n], flat_w[start : start + n]
        start += n
        y = swiglu(x[t], w1[e], w3[e], w2[e], swiglu_limit)
        out.index_add_(0, t, (y.float() * wt[:, None]).to(x.dtype))
    return out


@moe_experts.register_fake
def _moe_experts_fake(x, idx, weight, w1, w3, w2, swiglu_limit):
    return torch.empty_like(x)
