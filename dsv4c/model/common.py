"""Building blocks shared by the V4 and V3 reference models.

Dimension legend used in shape comments across dsv4c/model:
  B batch, T tokens of the chunk, S cached/key positions, D hidden, H heads, d head dim,
  r rope dim, E routed experts, K experts per token, I expert width, N hc streams.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from dsv4c.config import YarnScaling


def rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    """Unweighted RMS norm over the last dim, in fp32 (returns fp32)."""
    xf = x.float()
    return xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)


class RMSNorm(nn.Module):
    """`w ⊙ rms(x)`. V4 order (default): multiply in fp32, cast once. V3 order
    (`cast_first=True`, HF V3): cast `rms(x)` to the input dtype, then multiply."""

    def __init__(self, dim: int, eps: float, cast_first: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.cast_first = cast_first

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.cast_first:
            return self.weight * rms(x, self.eps).to(x.dtype)
        return (self.weight.float() * rms(x, self.eps)).to(x.dtype)


def rope_inv_freq(rope_dim: int, theta: float, yarn: YarnScaling | None) -> torch.Tensor:
    """f_i = theta^(-2i/r), with YaRN's ramp between the unscaled and the /factor frequencies
    (deepseek_v4.md §3.1). fp32 [r/2]."""
    f = 1.0 / (theta ** (torch.arange(0, rope_dim, 2, dtype=torch.int64).float() / rope_dim))
    if yarn is None:
        return f
    L0 = yarn.original_max_position_embeddings

    def corr(beta: float) -> float:
        return rope_dim * math.log(L0 / (beta * 2 * math.pi)) / (2 * math.log(theta))

    lo = max(math.floor(corr(yarn.beta_fast)), 0)
    hi = min(math.ceil(corr(yarn.beta_slow)), rope_dim - 1)
    if lo == hi:
        hi += 0.001
    ramp = ((torch.arange(rope_dim // 2, dtype=torch.float32) - lo) / (hi - lo)).clamp(0, 1)
    return f / yarn.factor * ramp + f * (1 - ramp)


def yarn_mscale(factor: float, mscale: float) -> float:
    """0.1·mscale·ln(factor) + 1 (1 when factor <= 1)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


class RotaryTable(nn.Module):
    """cos/sin of `p·f_i` for integer positions, fp32. Not a checkpoint tensor."""

    def __init__(self, rope_dim: int, theta: float, yarn: YarnScaling | None):
        super().__init__()
        self.rope_dim, self.theta, self.yarn = rope_dim, theta, yarn
        self.register_buffer("inv_freq", self.make_inv_freq(), persistent=False)

    def make_inv_freq(self) -> torch.Tensor:
        return rope_inv_freq(self.rope_dim, self.theta, self.yarn)

    def _apply(self, fn, recurse: bool = True):
        # Recompute instead of casting: `.to(bf16)` would round the frequencies, `to_empty` would
        # leave them uninitialised.
        super()._apply(fn, recurse)
        self.inv_freq = self.make_inv_freq().to(self.inv_freq.device)
        return self

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # positions [...] int -> cos, sin [..., r/2]
        return rotary_table(positions, self.inv_freq)


def rotary_table(positions: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [..., r/2] fp32 of `positions [...]` (int) times inv_freq [r/2]: one fp32 product each."""
    ang = positions.float()[..., None] * inv_freq.to(positions.device)
    return ang.cos(), ang.sin()


def rope_angles(pos0: torch.Tensor, T: int, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The table of a chunk: cos, sin [B, T, r/2] at positions pos0[b] + t, pos0 [B] int64
    (passes/fuse_rope_angles.py makes this one `dsv4c::rope_angles` launch)."""
    return rotary_table(pos0[:, None] + torch.arange(T, device=pos0.device), inv_freq)


def rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Rotate the last `2·cos.shape[-1]` channels of x in interleaved pairs (x[2i], x[2i+1]).

    x [..., C]; cos/sin broadcastable to [..., r/2]. Computed in fp32, cast back.
    `inverse=True` rotates by the negative angle."""
    r = 2 * cos.shape[-1]
    keep, rot = x[..., : x.shape[-1] - r], x[..., x.shape[-1] - r :].float()
    a, b = rot[..., 0::2], rot[..., 1::2]
    s = -sin if inverse else sin
    out = torch.stack((a * cos - b * s, a * s + b * cos), dim=-1).flatten(-2)
    return torch.cat((keep, out.to(x.dtype)), dim=-1)


def rope_half_split(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate all channels of x (width 2·r/2) in half-split pairs (x[i], x[i+r/2])."""
    h = x.shape[-1] // 2
    xf = x.float()
    a, b = xf[..., :h], xf[..., h:]
    return torch.cat((a * cos - b * sin, a * sin + b * cos), dim=-1).to(x.dtype)


def selection_mask(selected: torch.Tensor, num_keys: int) -> torch.Tensor:
    """selected [..., k] key indices (-1 = unused) -> bool [..., num_keys], True at the selected keys."""
    slot = torch.where(selected < 0, num_keys, selected)  # -1 goes to an extra column, then dropped
    mask = torch.zeros(*selected.shape[:-1], num_keys + 1, dtype=torch.bool, device=selected.device)
    return mask.scatter(-1, slot, True)[..., :num_keys]


def topk_visible(score: torch.Tensor, visible: torch.Tensor, topk: int) -> torch.Tensor:
    """Indexer selection shared by V4's CSA and V3.2's DSA: the top-min(topk, visible) visible keys of
    `score [B, T, L]` by score, as key indices [B, T, topk] with -1 in unused slots."""
    B, T, L = score.shape
    out = torch.full((B, T, topk), -1, dtype=torch.int64, device=score.device)
    k = min(topk, L)
    if k:
        top = score.masked_fill(~visible, float("-inf")).topk(k, dim=-1)
        out[..., :k] = top.indices.masked_fill(top.values == float("-inf"), -1)
    return out


def swiglu(x: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor, limit: float = 0.0) -> torch.Tensor:
    """down(silu(gate(x)) ⊙ up(x)); with limit > 0 the V4 clamp: gate ≤ L, |up| ≤ L.
    x [T, D]; w1, w3 [I, D]; w2 [D, I]."""
    g = x @ w1.t()
    u = x @ w3.t()
    return swiglu_act(g, u, limit) @ w2.t()


def swiglu_act(g: torch.Tensor, u: torch.Tensor, limit: float = 0.0) -> torch.Tensor:
    """silu(g) ⊙ u, with limit > 0 clamped first: g ≤ L, |u| ≤ L. g, u [..., I]. (The target of
    passes/fuse_swiglu.py.)"""
    if limit > 0:
        g = g.clamp(max=limit)
        u = u.clamp(-limit, limit)
    return torch.nn.functional.silu(g) * u


@dataclass
class StaticCache:
    """The caches of one model (or its MTP block): per-layer static buffers `[n_slots, ...]`, the next
    position of each slot, and the positions the buffers hold."""

    layers: list
    pos: torch.Tensor  # [n_slots] int64
    max_len: int

    @property
    def length(self) -> int:
        """The common position of all sequences (raises if they differ)."""
        lo, hi = int(self.pos.min()), int(self.pos.max())
        if lo != hi:
            raise ValueError(f"sequences sit at different positions ({lo}..{hi}); use cache.pos")
        return lo


def batch_meta(cache, B: int, T: int, n_real: torch.Tensor | None, slots: torch.Tensor | None):
    """(slots, pos0, n_real) for a chunk of a [B, T] batch, checked eagerly before any state changes.
    `cache` is a V4Cache or V3Cache (anything with `pos [n_slots]` and `max_len`)."""
    dev = cache.pos.device
    if slots is None:
        if cache.pos.shape[0] != B:
            raise ValueError(f"input_ids has batch {B} but the cache holds {cache.pos.shape[0]} sequences; pass slots")
        slots = torch.arange(B, device=dev)
    if n_real is None:
        n_real = torch.full((B,), T, dtype=torch.int64, device=dev)
    if slots.shape != (B,) or n_real.shape != (B,):
        raise ValueError(f"slots and n_real need shape [{B}], got {list(slots.shape)} and {list(n_real.shape)}")
    n_slots = cache.pos.shape[0]
    if B and (int(slots.min()) < 0 or int(slots.max()) >= n_slots or slots.unique().numel() != B):
        raise ValueError(f"slots {slots.tolist()} must be distinct cache rows in [0, {n_slots})")
    if B and int(n_real.max()) > T:
        raise ValueError(f"n_real {n_real.tolist()} exceeds the chunk length {T}")
    pos0 = cache.pos[slots]
    end = int((pos0 + n_real).max()) if B else 0
    if end > cache.max_len:
        raise ValueError(f"chunk reaches position {end}, beyond the cache's max_len={cache.max_len}")
    return slots, pos0, n_real


@dataclass(frozen=True)
class PagedLayout:
    """Block-based (paged) layout of the caches that grow with the sequence (issue 27, item 1).

    Those caches (V4: compressed entries and the CSA indexer's keys; V3/V3.2: latent, kpe, indexer keys)
    are pools `[n_blocks + 1, block_size / div, w]` shared by every sequence: block k of a sequence
    (positions k·b … k·b+b-1, entries of a compress ratio m: b/m rows) lives at pool row
    `block_table[slot, k]`. The last pool block is scratch: unused table entries point at it, and the
    capture-safe ops send the writes that must not happen there (as the slot caches' scratch slot).
    One block table `[n_slots, ⌈max_len / b⌉]` int64 serves every layer and field."""

    block_size: int  # b: positions per block (a multiple of every compression ratio)
    n_blocks: int  # N: pool blocks a sequence can get (the pool holds N + 1, the last scratch)

    def __post_init__(self):
        if self.block_size < 1 or self.n_blocks < 1:
            raise ValueError(f"PagedLayout: block_size and n_blocks must be >= 1, got {self.block_size}, "
                             f"{self.n_blocks}")

    def table(self, batch: int, max_len: int, device) -> torch.Tensor:
        """An empty block table [batch, ⌈max_len / b⌉]: every entry the scratch block."""
        return torch.full((batch, -(-max_len // self.block_size)), self.n_blocks, dtype=torch.int64, device=device)

    def pool(self, div: int, width: int, dtype: torch.dtype, device) -> torch.Tensor:
        if self.block_size % div:
            raise ValueError(f"PagedLayout.block_size={self.block_size} is not a multiple of the compress "
                             f"ratio {div}")
        return torch.zeros(self.n_blocks + 1, self.block_size // div, width, dtype=dtype, device=device)


def paged_rows(pool: torch.Tensor, block_table: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """The rows of sequences `slots [B]` in logical order: pool [N+1, rb, w], block_table [n_slots, nb]
    -> [B, nb·rb, w] (a gather of the batch's blocks; rows of unused table entries read scratch)."""
    return pool[block_table[slots]].flatten(1, 2)


def paged_address(block_table: torch.Tensor, slots: torch.Tensor, idx: torch.Tensor, rows_per_block: int,
                  write: torch.Tensor | None = None, scratch: int = -1) -> tuple[torch.Tensor, torch.Tensor]:
    """(pool block, row in block) of logical row `idx [B, X]` of sequence `slots [B]`; with `write [B, X]`
    the rows where it is False go to row 0 of block `scratch` (capture-safe masked scatter)."""
    nb = block_table.shape[1]
    k = torch.div(idx, rows_per_block, rounding_mode="floor").clamp(0, nb - 1)
    blk = block_table[slots[:, None].expand_as(idx), k]
    row = torch.remainder(idx, rows_per_block)
    if write is None:
        return blk, row
    return torch.where(write, blk, torch.full_like(blk, scratch)), torch.where(write, row, torch.zeros_like(row))
