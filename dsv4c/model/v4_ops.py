"""DeepSeek-V4 attention-with-cache as custom ops (design.md: one custom op per dynamic thing).

Each op has a readable reference implementation, which loops over sequences and works on plain
Python positions, and a fake (shape-only) implementation for `torch.export`. The caches are static
buffers of `n_slots` sequences that the ops update in place (`mutates_args`). Batch row b uses cache
row `slots[b]` and starts at position `pos0[b]`: sequences in a batch may sit at different positions,
and a batch may hold any subset of the cached sequences.

Padding contract: `n_real [B]` says how many of the T chunk rows of each sequence are real. Rows at
or after n_real are computed (their outputs are garbage and get dropped) but write nothing to any cache.

Legend: B batch, n_slots cached sequences, T chunk tokens, H heads, d head dim, r rope dim, m compress ratio, c overlap factor,
w entry width, E entry capacity, HI/dI indexer heads/dim, k indexer top-k, S ring slots.
"""
from __future__ import annotations

import math

import torch

from dsv4c.model.common import paged_rows, rms, rope_interleaved, selection_mask, topk_visible


def _cos_sin(inv_freq: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    ang = pos.float()[..., None] * inv_freq.float()
    return ang.cos(), ang.sin()


# ------------------------------------------------------------------------------------------------
# compressor update
# ------------------------------------------------------------------------------------------------
@torch.library.custom_op("dsv4c::v4_compress", mutates_args=("state_kv", "state_score", "entries"))
def v4_compress(kv: torch.Tensor, score: torch.Tensor, slots: torch.Tensor, pos0: torch.Tensor, n_real: torch.Tensor,
                ape: torch.Tensor, norm_weight: torch.Tensor, inv_freq: torch.Tensor, state_kv: torch.Tensor,
                state_score: torch.Tensor, entries: torch.Tensor, m: int, eps: float) -> None:
    """Keep the chunk's compressor rows and write the entry of every group that closes in the chunk.

    kv, score [B, T, c·w] fp32 (score without `ape`); entries [n_slots, E, w]: entry i pools the group
    of positions i·m … i·m+m-1 (for CSA, c = 2, with the first w channels of the previous group),
    post-norm, RoPE at i·m. state_kv/state_score [n_slots, R, c·w] fp32: the rows of recent
    positions, position p at row p mod R, R >= c·m + the verify's extra rows. A closing group reads
    at most c·m - 1 rows from before the chunk. Rows are indexed by position, so a chunk whose tail
    is rejected (speculative decoding) leaves the accepted positions' rows in place, and the next
    chunk overwrites the rejected ones before any group reads them."""
    c = kv.shape[-1] // entries.shape[-1]
    for b in range(kv.shape[0]):
        p0, n, s = int(pos0[b]), int(n_real[b]), int(slots[b])
        _compress_row(kv[b, :n], score[b, :n] + ape.float()[(p0 + torch.arange(n, device=kv.device)) % m],
                      p0, m, c, norm_weight, inv_freq, state_kv[s], state_score[s], entries[s], eps)


def _compress_row(k, g, p0, m, c, norm_weight, inv_freq, st_kv, st_sc, entries, eps) -> None:
    """One sequence, group by group (the grouping of `dsv4c.model.v4.Compressor`). k, g [n, c·w]."""
    R, w, n = st_kv.shape[0], entries.shape[-1], k.shape[0]
    base = (p0 // m - (c - 1)) * m  # the first position a group closing in this chunk reads
    rows_kv = torch.cat([_past_rows(st_kv, base, p0, 0.0), k])  # positions base … p0+n-1
    rows_sc = torch.cat([_past_rows(st_sc, base, p0, float("-inf")), g])
    closing = range(p0 // m, (p0 + n) // m)  # groups whose last position (j+1)·m-1 is in the chunk
    pooled = []
    for j in closing:
        lo = j * m - base
        slot_kv, slot_sc = rows_kv[lo : lo + m], rows_sc[lo : lo + m]  # [m, c·w]
        if c == 2:  # the previous group's first w channels, then this group's last w
            slot_kv = torch.cat([rows_kv[lo - m : lo, :w], slot_kv[:, w:]])  # [2m, w]
            slot_sc = torch.cat([rows_sc[lo - m : lo, :w], slot_sc[:, w:]])
        pooled.append((slot_sc.softmax(0) * slot_kv).sum(0))  # [w]
    if pooled:
        e = (norm_weight.float() * rms(torch.stack(pooled), eps)).to(entries.dtype)  # [groups, w]
        cos, sin = _cos_sin(inv_freq, torch.tensor(closing, device=k.device) * m)
        entries[closing.start : closing.stop] = rope_interleaved(e, cos, sin)
    for t in range(max(0, n - R), n):  # the last R positions stay for later chunks
        st_kv[(p0 + t) % R], st_sc[(p0 + t) % R] = k[t], g[t]


@torch.library.custom_op("dsv4c::v4_compress_paged", mutates_args=("state_kv", "state_score", "pool"))
def v4_compress_paged(kv: torch.Tensor, score: torch.Tensor, slots: torch.Tensor, pos0: torch.Tensor,
                      n_real: torch.Tensor, ape: torch.Tensor, norm_weight: torch.Tensor, inv_freq: torch.Tensor,
                      state_kv: torch.Tensor, state_score: torch.Tensor, pool: torch.Tensor, block_table: torch.Tensor,
                      m: int, eps: float) -> None:
    """`dsv4c::v4_compress` with the entries in blocks (`dsv4c.model.common.PagedLayout`): entry i of the
    sequence in slot s lives at pool[block_table[s, i // rb], i mod rb], rb = pool.shape[1] entries per block.
    Computes what `v4_compress` computes on that sequence's entries and writes only its closing groups."""
    c, rb = kv.shape[-1] // pool.shape[-1], pool.shape[1]
    for b in range(kv.shape[0]):
        p0, n, s = int(pos0[b]), int(n_real[b]), int(slots[b])
        ent = pool[block_table[s]].flatten(0, 1)  # [E, w] a copy; the closing rows are written back below
        _compress_row(kv[b, :n], score[b, :n] + ape.float()[(p0 + torch.arange(n, device=kv.device)) % m],
                      p0, m, c, norm_weight, inv_freq, state_kv[s], state_score[s], ent, eps)
        i = torch.arange(p0 // m, (p0 + n) // m, device=kv.device)
        if i.numel():
            pool[block_table[s, i // rb], i % rb] = ent[i]


@v4_compress_paged.register_fake
def _(kv, score, slots, pos0, n_real, ape, norm_weight, inv_freq, state_kv, state_score, pool, block_table, m, eps):
    return None


def _past_rows(state: torch.Tensor, lo: int, hi: int, fill: float) -> torch.Tensor:
    """The kept rows of positions lo … hi-1 ([hi-lo, c·w]); `fill` for positions before 0 (the
    previous group of group 0: zero rows with -inf scores weigh nothing)."""
    if hi <= lo:
        return state[:0]
    R = state.shape[0]
    return torch.stack([state[p % R] if p >= 0 else torch.full_like(state[0], fill) for p in range(lo, hi)])


@v4_compress.register_fake
def _(kv, score, slots, pos0, n_real, ape, norm_weight, inv_freq, state_kv, state_score, entries, m, eps):
    return None


# ------------------------------------------------------------------------------------------------
# indexer top-k
# ------------------------------------------------------------------------------------------------
def visible_count(pos: torch.Tensor, m: int) -> torch.Tensor:
    """Entries visible to a query at `pos`: w is visible iff (w+1)·m <= pos+1."""
    return torch.div(pos + 1, m, rounding_mode="floor")


@torch.library.custom_op("dsv4c::v4_indexer_topk", mutates_args=())
def v4_indexer_topk(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, slots: torch.Tensor,
                    pos0: torch.Tensor, topk: int, m: int) -> torch.Tensor:
    """Lightning-indexer selection (deepseek_v4.md §4.1(e)).

    q [B, T, HI, dI] (RoPE applied), weights [B, T, HI] fp32 (already × HI^-½), keys [n_slots, E, dI] ->
    idx [B, T, topk] int64: the top-min(topk, visible) visible entries by
    Σ_h weights_h · dI^-½ · relu(q_h·K_w); -1 fills unused slots."""
    return _indexer_select(q, weights, keys[slots], pos0, topk, m)


def _indexer_select(q, weights, rows, pos0, topk: int, m: int) -> torch.Tensor:
    """The indexer's selection over the batch's key rows [B, E, dI]."""
    T = q.shape[1]
    E = rows.shape[1]
    pos = pos0[:, None] + torch.arange(T, device=q.device)  # [B, T]
    dots = torch.einsum("bthi,bsi->bths", q.float(), rows.float()).relu()
    score = torch.einsum("bth,bths->bts", weights.float() * q.shape[-1] ** -0.5, dots)
    visible = torch.arange(E, device=q.device) < visible_count(pos, m)[..., None]  # [B, T, E]
    return topk_visible(score, visible, topk)


@v4_indexer_topk.register_fake
def _(q, weights, keys, slots, pos0, topk, m):
    return q.new_empty((q.shape[0], q.shape[1], topk), dtype=torch.int64)


@torch.library.custom_op("dsv4c::v4_indexer_topk_paged", mutates_args=())
def v4_indexer_topk_paged(q: torch.Tensor, weights: torch.Tensor, pool: torch.Tensor, block_table: torch.Tensor,
                          slots: torch.Tensor, pos0: torch.Tensor, topk: int, m: int) -> torch.Tensor:
    """`dsv4c::v4_indexer_topk` over keys in blocks: the keys of slot s are `paged_rows(pool, block_table)`.
    Capture-safe as it stands (fixed shapes, no host reads)."""
    return _indexer_select(q, weights, paged_rows(pool, block_table, slots), pos0, topk, m)


@v4_indexer_topk_paged.register_fake
def _(q, weights, pool, block_table, slots, pos0, topk, m):
    return q.new_empty((q.shape[0], q.shape[1], topk), dtype=torch.int64)


# ------------------------------------------------------------------------------------------------
# attention
# ------------------------------------------------------------------------------------------------
@torch.library.custom_op("dsv4c::v4_attention", mutates_args=("ring",))
def v4_attention(q: torch.Tensor, kv: torch.Tensor, slots: torch.Tensor, pos0: torch.Tensor, n_real: torch.Tensor,
                 ring: torch.Tensor,
                 sinks: torch.Tensor, entries: torch.Tensor | None, selected: torch.Tensor | None, window: int,
                 m: int) -> torch.Tensor:
    """Shared-KV attention over the window and the compressed entries, sinks in the denominator.

    q [B, T, H, d], kv [B, T, d] (both RoPE'd); ring [n_slots, S, d] holds position p at row p mod S and
    receives the chunk's real rows; entries [n_slots, E, d] (m > 0); selected [B, T, k] (CSA: the indexer's
    choice, -1 = none; HCA: None = every visible entry). -> o [B, T, H, d] fp32, before inverse RoPE."""
    rows = None if entries is None else (lambda b, s: entries[s])
    return _attention_loop(q, kv, slots, pos0, n_real, ring, sinks, rows, selected, window, m)


def _attention_loop(q, kv, slots, pos0, n_real, ring, sinks, rows, selected, window: int, m: int) -> torch.Tensor:
    """The reference attention; `rows(b, s)` gives batch row b's entries [E, d] (None: no entries)."""
    entries = rows
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    for b in range(q.shape[0]):
        p0, n, s = int(pos0[b]), int(n_real[b]), int(slots[b])
        keys, key_pos = _window_keys(kv[b], p0, n, ring[s], window)
        pos = p0 + torch.arange(q.shape[1], device=q.device)
        rel = pos[:, None] - key_pos[None, :]
        mask = (rel >= 0) & (rel < window)  # [T, S]
        if entries is not None:
            ent = rows(b, s)  # [E, d]
            E = ent.shape[0]
            if selected is None:
                vis = torch.arange(E, device=q.device) < visible_count(pos, m)[:, None]
            else:
                vis = selection_mask(selected[b], E)
            keys = torch.cat([keys, ent])
            mask = torch.cat([mask, vis], 1)
        out[b] = sink_attention(q[b, None].float(), keys[None].float(), mask[None], sinks)[0]
    return out


@torch.library.custom_op("dsv4c::v4_attention_paged", mutates_args=("ring",))
def v4_attention_paged(q: torch.Tensor, kv: torch.Tensor, slots: torch.Tensor, pos0: torch.Tensor,
                       n_real: torch.Tensor, ring: torch.Tensor, sinks: torch.Tensor, pool: torch.Tensor,
                       block_table: torch.Tensor, selected: torch.Tensor | None, window: int, m: int) -> torch.Tensor:
    """`dsv4c::v4_attention` with the entries in blocks: slot s's entries are pool[block_table[s]] in order
    (`dsv4c.model.common.PagedLayout`). Same function as the slot op on the same entries."""
    return _attention_loop(q, kv, slots, pos0, n_real, ring, sinks, lambda b, s: pool[block_table[s]].flatten(0, 1),
                           selected, window, m)


@v4_attention_paged.register_fake
def _(q, kv, slots, pos0, n_real, ring, sinks, pool, block_table, selected, window, m):
    return torch.empty(q.shape, dtype=torch.float32, device=q.device)


def _window_keys(kv, p0, n, ring, window):
    """Cached rows of positions [p0-W+1, p0) then the chunk's rows; write the chunk's real rows."""
    T, S = kv.shape[0], ring.shape[0]
    old = torch.arange(max(0, p0 - window + 1), p0, device=kv.device)
    keys = torch.cat([ring[old % S], kv.to(ring.dtype)])
    pos = torch.cat([old, p0 + torch.arange(T, device=kv.device)])
    keep = min(n, S)
    new = p0 + torch.arange(n - keep, n, device=kv.device)
    ring[new % S] = kv[n - keep : n].to(ring.dtype)
    return keys, pos


def sink_attention(q: torch.Tensor, keys: torch.Tensor, mask: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """q [B, T, H, d], keys [B, S, d] (K = V), mask [B|1, T, S] bool -> [B, T, H, d]: softmax over the
    allowed keys with exp(sink_h) added to the denominator only (the sink has no value)."""
    B, T, H, d = q.shape
    logits = torch.einsum("bthd,bsd->bths", q, keys) / math.sqrt(d)  # [B, T, H, S]
    logits = logits.masked_fill(~mask[:, :, None, :], float("-inf"))
    sink = sinks.float().view(1, 1, H, 1).expand(B, T, H, 1)
    p = torch.cat([logits, sink], -1).softmax(-1)[..., :-1]
    return torch.einsum("bths,bsd->bthd", p, keys)


@v4_attention.register_fake
def _(q, kv, slots, pos0, n_real, ring, sinks, entries, selected, window, m):
    return torch.empty(q.shape, dtype=torch.float32, device=q.device)


# ------------------------------------------------------------------------------------------------
# fused per-head q norm + RoPE (the target of passes/fuse_projections.py)
# ------------------------------------------------------------------------------------------------
@torch.library.custom_op("dsv4c::head_rms_rope", mutates_args=())
def head_rms_rope(q: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, eps: float) -> torch.Tensor:
    """rope(rms(q_h)) per head: the unweighted per-head RMS norm of V4's query (in fp32, cast back),
    then interleaved RoPE on the last 2·r/2 channels. q [B, T, H, d]; cos/sin [B, T, r/2]."""
    return rope_interleaved(rms(q, eps).to(q.dtype), cos[:, :, None], sin[:, :, None])


@head_rms_rope.register_fake
def _(q, cos, sin, eps):
    return torch.empty_like(q)
