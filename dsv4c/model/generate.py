"""Greedy decoding with the eager reference models (a check, not the runtime)."""
from __future__ import annotations

import torch


@torch.no_grad()
def greedy(model: torch.nn.Module, prompt: torch.Tensor, max_new_tokens: int) -> torch.Tensor:
    """prompt [B, P] -> generated ids [B, max_new_tokens]: one prefill, then one token per step."""
    cache = model.new_cache(prompt.shape[0])
    logits = model(prompt, cache)
    out = []
    for _ in range(max_new_tokens):
        nxt = logits[:, -1].argmax(-1, keepdim=True)
        out.append(nxt)
        logits = model(nxt, cache)
    return torch.cat(out, 1) if out else prompt[:, :0]
