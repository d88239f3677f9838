"""DeepSeek-V3/V3.2 cache updates and DSA top-k as custom ops (design.md: one custom op per dynamic thing).

Each op has a readable reference implementation, which loops over sequences where it writes state,
and a fake (shape-only) implementation for `torch.export`. The caches are static buffers `[B, L, ·]`
that the ops update in place (`mutates_args`); position p of sequence b lives at row p. The positions
are a device tensor `pos0 [B]`, the position of each sequence's first chunk token, so sequences in a
batch may sit at different positions.

The MLA attention itself is *not* an op: the model reads the whole static cache after the update and
expands K/V through `kv_b_proj` in plain ATen, which the weight-absorption pass rewrites
(deepseek_v3_mla.md §4-§5).

Padding contract: `n_real [B]` says how many of the T chunk rows of each sequence are real. Rows at
or after n_real are computed (their outputs are garbage and get dropped) but write nothing to any cache.

Legend: B batch, T chunk tokens, L cache capacity (positions), dc kv_lora_rank, r rope dim,
HI/dI indexer heads/head dim, k index top-k.
"""
from __future__ import annotations

import torch

from dsv4c.model.common import paged_address, topk_visible


# ------------------------------------------------------------------------------------------------
# cache writes
# ------------------------------------------------------------------------------------------------
def _write_rows(rows: torch.Tensor, slots: torch.Tensor, pos0: torch.Tensor, n_real: torch.Tensor,
                cache: torch.Tensor) -> None:
    """cache[slots[b], pos0[b] + t] = rows[b, t] for the real rows t < n_real[b].
    rows [B, T, w], cache [n_slots, L, w]."""
    t = torch.arange(rows.shape[1], device=rows.device)
    real = t[None, :] < n_real[:, None]  # [B, T]
    where_slot = slots[:, None].expand_as(real)[real]
    where_pos = (pos0[:, None] + t)[real]
    cache[where_slot, where_pos] = rows[real].to(cache.dtype)


@torch.library.custom_op("dsv4c::mla_cache_update", mutates_args=("latent", "kpe"))
def mla_cache_update(c_kv: torch.Tensor, k_pe: torch.Tensor, slots: torch.Tensor, pos0: torch.Tensor,
                     n_real: torch.Tensor, latent: torch.Tensor, kpe: torch.Tensor) -> None:
    """Write the chunk's MLA cache rows at their positions (§5: 576 values per token and layer).

    c_kv [B, T, dc] (after kv_a_layernorm, not rotated) -> latent [n_slots, L, dc];
    k_pe [B, T, r] (rotated, interleaved layout) -> kpe [n_slots, L, r]; batch row b goes to slots[b]."""
    _write_rows(c_kv, slots, pos0, n_real, latent)
    _write_rows(k_pe, slots, pos0, n_real, kpe)


@mla_cache_update.register_fake
def _(c_kv, k_pe, slots, pos0, n_real, latent, kpe):
    return None


@torch.library.custom_op("dsv4c::dsa_cache_update", mutates_args=("index_keys",))
def dsa_cache_update(k_idx: torch.Tensor, slots: torch.Tensor, pos0: torch.Tensor, n_real: torch.Tensor,
                     index_keys: torch.Tensor) -> None:
    """Write the chunk's V3.2 indexer keys (§6.2-3: LayerNorm'd, rope part first, half-split rotated).
    k_idx [B, T, dI] -> index_keys [n_slots, L, dI]."""
    _write_rows(k_idx, slots, pos0, n_real, index_keys)


@dsa_cache_update.register_fake
def _(k_idx, slots, pos0, n_real, index_keys):
    return None


def _write_rows_paged(rows: torch.Tensor, slots: torch.Tensor, pos0: torch.Tensor, n_real: torch.Tensor,
                      pool: torch.Tensor, block_table: torch.Tensor) -> None:
    """`_write_rows` into a pool of blocks: position p of slot s at pool[block_table[s, p // b], p mod b]."""
    t = torch.arange(rows.shape[1], device=rows.device)
    real = t[None, :] < n_real[:, None]  # [B, T]
    blk, row = paged_address(block_table, slots, pos0[:, None] + t, pool.shape[1])
    pool[blk[real], row[real]] = rows[real].to(pool.dtype)


@torch.library.custom_op("dsv4c::mla_cache_update_paged", mutates_args=("latent", "kpe"))
def mla_cache_update_paged(c_kv: torch.Tensor, k_pe: torch.Tensor, slots: torch.Tensor, pos0: torch.Tensor,
                           n_real: torch.Tensor, latent: torch.Tensor, kpe: torch.Tensor,
                           block_table: torch.Tensor) -> None:
    """`dsv4c::mla_cache_update` with latent / kpe in blocks (`dsv4c.model.common.PagedLayout`):
    latent [N+1, b, dc], kpe [N+1, b, r], block_table [n_slots, nb]."""
    _write_rows_paged(c_kv, slots, pos0, n_real, latent, block_table)
    _write_rows_paged(k_pe, slots, pos0, n_real, kpe, block_table)


@mla_cache_update_paged.register_fake
def _(c_kv, k_pe, slots, pos0, n_real, latent, kpe, block_table):
    return None


@torch.library.custom_op("dsv4c::dsa_cache_update_paged", mutates_args=("index_keys",))
def dsa_cache_update_paged(k_idx: torch.Tensor, slots: torch.Tensor, pos0: torch.Tensor, n_real: torch.Tensor,
                           index_keys: torch.Tensor, block_table: torch.Tensor) -> None:
    """`dsv4c::dsa_cache_update` with the indexer keys in blocks: index_keys [N+1, b, dI]."""
    _write_rows_paged(k_idx, slots, pos0, n_real, index_keys, block_table)


@dsa_cache_update_paged.register_fake
def _(k_idx, slots, pos0, n_real, index_keys, block_table):
    return None


# ------------------------------------------------------------------------------------------------
# DSA top-k
# ------------------------------------------------------------------------------------------------
@torch.library.custom_op("dsv4c::dsa_topk", mutates_args=())
def dsa_topk(q_idx: torch.Tensor, weights: torch.Tensor, index_keys: torch.Tensor, pos0: torch.Tensor,
             topk: int) -> torch.Tensor:
    """Lightning-indexer selection (deepseek_v3_mla.md §6.5-6).

    q_idx [B, T, HI, dI] (RoPE applied), weights [B, T, HI] (already × HI^-½), index_keys [B, L, dI] ->
    idx [B, T, topk] int64: for the query at position p = pos0[b] + t, the top-min(topk, p+1) keys
    s <= p by score(s) = Σ_h weights_h · relu(q_h·K_s · dI^-½), in fp32; -1 fills unused slots."""
    T = q_idx.shape[1]
    L = index_keys.shape[1]
    pos = pos0[:, None] + torch.arange(T, device=q_idx.device)  # [B, T]
    dots = torch.einsum("bthd,bsd->bths", q_idx.float(), index_keys.float()) * q_idx.shape[-1] ** -0.5
    score = torch.einsum("bth,bths->bts", weights.float(), dots.relu())  # [B, T, L]
    visible = torch.arange(L, device=q_idx.device) <= pos[..., None]  # [B, T, L]
    return topk_visible(score, visible, topk)


@dsa_topk.register_fake
def _(q_idx, weights, index_keys, pos0, topk):
    return q_idx.new_empty((q_idx.shape[0], q_idx.shape[1], topk), dtype=torch.int64)
