"""Token sampling: temperature, then top-k and top-p, then renormalisation (speculative_decoding.md §3.2
defines acceptance on exactly this processed distribution)."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off

    def __post_init__(self):
        if self.temperature < 0:
            raise ValueError(f"temperature: must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p: must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k: must be >= 0, got {self.top_k}")


def processed_probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """logits [..., V] -> the distribution actually sampled from (fp32). Greedy: one-hot argmax."""
    logits = logits.float()
    if p.temperature == 0:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    logits = logits / p.temperature
    if p.top_k:
        kth = logits.topk(min(p.top_k, logits.shape[-1]), dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = logits.softmax(-1)
    if p.top_p < 1:
        sorted_p, order = probs.sort(-1, descending=True)
        keep = sorted_p.cumsum(-1) - sorted_p < p.top_p  # keep the smallest prefix reaching top_p
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_p * keep)
    return probs / probs.sum(-1, keepdim=True)


def sample(logits: torch.Tensor, p: SamplingParams, gen: torch.Generator) -> int:
    """One token from logits [V]."""
    if p.temperature == 0:
        return int(logits.argmax())
    return int(torch.multinomial(processed_probs(logits, p), 1, generator=gen))
