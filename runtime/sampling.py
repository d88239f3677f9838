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


# ------------------------------------------------------------------------------------------------
# batched, on the device (the pipelined MTP rounds, runtime/speculative.py)
# ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class RowParams:
    """Per-row sampling parameters as device tensors [B], plus the host flags that decide which
    stages run (so no step reads a device value back)."""

    temperature: torch.Tensor  # [B] fp32, 0 = greedy
    top_k: torch.Tensor  # [B] int64, 0 = off
    top_p: torch.Tensor  # [B] fp32
    any_top_k: bool
    any_top_p: bool
    all_greedy: bool

    @classmethod
    def of(cls, params: list[SamplingParams], device) -> "RowParams":
        t = torch.tensor([p.temperature for p in params], dtype=torch.float32)
        k = torch.tensor([p.top_k for p in params], dtype=torch.int64)
        tp = torch.tensor([p.top_p for p in params], dtype=torch.float32)
        return cls(t.to(device), k.to(device), tp.to(device), bool(k.any()), bool((tp < 1).any()),
                   bool((t == 0).all()))


def processed_probs_rows(logits: torch.Tensor, rp: RowParams) -> torch.Tensor:
    """`processed_probs` with each row's own parameters: logits [B, ..., V] -> fp32 probabilities.
    Greedy rows are one-hot at the argmax. Same stages and tie rules as `processed_probs`."""
    logits = logits.float()
    view = (-1,) + (1,) * (logits.dim() - 1)
    greedy = (rp.temperature == 0).view(view)
    onehot = torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    if rp.all_greedy:
        return onehot
    x = logits / torch.where(greedy, 1.0, rp.temperature.view(view))
    if rp.any_top_k:
        V = x.shape[-1]
        top = x.sort(-1, descending=True).values
        idx = (rp.top_k.clamp(1, V) - 1).view(view).expand(*x.shape[:-1], 1)
        kth = top.gather(-1, idx)
        kth = torch.where((rp.top_k > 0).view(view), kth, float("-inf"))
        x = x.masked_fill(x < kth, float("-inf"))
    probs = x.softmax(-1)
    if rp.any_top_p:
        sorted_p, order = probs.sort(-1, descending=True)
        keep = (sorted_p.cumsum(-1) - sorted_p < rp.top_p.view(view)) | (rp.top_p >= 1).view(view)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_p * keep)
    probs = probs / probs.sum(-1, keepdim=True)
    return torch.where(greedy, onehot, probs)


_M32 = 0xFFFFFFFF


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer finaliser (murmur3's fmix32) on int64 tensors holding values < 2^32: the
    products may wrap past 2^63, and the mask keeps their low 32 bits, which wrapping preserves."""
    x = x ^ (x >> 16)
    x = (x * 0x85EBCA6B) & _M32
    x = x ^ (x >> 13)
    x = (x * 0xC2B2AE35) & _M32
    return x ^ (x >> 16)


def counter_uniforms(seed: torch.Tensor, counter: torch.Tensor, n: int) -> torch.Tensor:
    """Counter-based uniforms in [0, 1): [B, n] fp64, a pure function of (seed[b], counter[b], j).

    The RNG contract of the pipelined MTP rounds: a request's draws depend only on its seed and the
    position of the round (the counter), never on the batch it shares, how many rounds are in flight
    or on the host; one call per round draws every uniform the round may need. 48 bits each (two
    24-bit halves of independent hashes)."""
    j = torch.arange(2 * n, device=seed.device, dtype=torch.int64)
    key = _mix32((counter[:, None] & _M32) ^ _mix32(j[None] + 0x9E3779B9))
    h = _mix32((seed[:, None] & _M32) ^ key ^ _mix32((seed[:, None] >> 32) & _M32))  # [B, 2n]
    hi, lo = (h[:, 0::2] >> 8).double(), (h[:, 1::2] >> 8).double()
    return (hi * 2.0 ** 24 + lo) * 2.0 ** -48


def draw_rows(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """One token per row of probs [B, V] (need not be normalised) by inverse CDF at u [B] in [0, 1).
    The chosen token has positive mass: the first index whose CDF exceeds u * total."""
    cdf = probs.double().cumsum(-1)
    t = (u * cdf[:, -1])[:, None]
    return torch.searchsorted(cdf, t, right=True)[:, 0].clamp_max(probs.shape[-1] - 1)
