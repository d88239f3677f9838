"""Shared inputs of the MoE kernel tests (test_kernels_moe_*.py): float expert weights, routing
cases and activations, all seeded."""
from __future__ import annotations

import torch


def float_weights(e, i, d, seed=0, device="cpu"):
    """fp32 (w1 [E, I, D], w3 [E, I, D], w2 [E, D, I]), Gaussian with 1/sqrt(fan-in) scale."""
    g = torch.Generator().manual_seed(seed)
    w1 = torch.randn(e, i, d, generator=g) * d ** -0.5
    w3 = torch.randn(e, i, d, generator=g) * d ** -0.5
    w2 = torch.randn(e, d, i, generator=g) * i ** -0.5
    return w1.to(device), w3.to(device), w2.to(device)


def routing(case, t, k, e, seed=1):
    """(idx [T, K], weight fp32 [T, K] in [0.5, 1.5)) for a routing case."""
    g = torch.Generator().manual_seed(seed)
    if case == "random":
        idx = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    elif case == "empty_experts":       # only experts 1 and e-2 used
        idx = torch.tensor([1, e - 2])[torch.randint(0, 2, (t, k), generator=g)]
    elif case == "one_expert_all":      # every slot of every token on expert 2
        idx = torch.full((t, k), 2)
    elif case == "repeated_ids":        # rows like [e, e]: contributions add
        idx = torch.randint(0, e, (t, 1), generator=g).repeat(1, k)
        idx[::3, -1] = (idx[::3, 0] + 1) % e
    else:
        raise ValueError(f"routing case {case!r}")
    weight = torch.rand(t, k, generator=g) + 0.5
    return idx, weight


def inputs(t, d, seed=2, device="cpu"):
    """bf16 activations [T, D]."""
    return (torch.randn(t, d, generator=torch.Generator().manual_seed(seed)) * 2).bfloat16().to(device)
