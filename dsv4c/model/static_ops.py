"""Capture-safe implementations of the cache ops, for graphs with a fixed number of tokens per row.

The reference ops (`v4_ops`, `v3_ops`, `moe`) are the specification: they loop over sequences and
read positions with `int()`, so a CUDA graph cannot capture them. The ops here compute the same
function with fixed shapes, no host synchronisation and no data-dependent control flow, so the
decode/verify/MTP graphs (T = 1 + k tokens per row) can be captured whole.
`dsv4c.passes.select_kernels` swaps them in, as the target says (`dsv4c.targets`, `Target.kernels`).

**The scratch slot.** A graph cannot skip a write without knowing on the host that it should. So
every write that must not happen (rows at or after `n_real`, groups that do not close, padding rows)
goes to the *last* cache slot, `n_slots - 1`, instead. That slot is scratch: the runtime allocates
one more slot than it serves and never gives the last one to a sequence; padding rows of a bucket
use it as their slot (`SegmentExecutor(pad_slot=n_slots - 1)`). Real rows must have distinct slots.
With those two rules no two writes of one call hit the same real cache row, so the order of
scattered writes never matters.

Legend: B batch, T chunk tokens (static; any length, prefill chunks included), n_slots cache slots (last = scratch), H heads,
d head dim, S ring rows, W window, m compress ratio, c overlap factor (2 for m = 4), w entry width,
E entry capacity, G groups a chunk can touch, V virtual rows (open group + chunk), K experts per token.
"""
from __future__ import annotations

import torch

from dsv4c.model.common import paged_address, paged_rows, rms, rope_interleaved, selection_mask
from dsv4c.model.v4_ops import _cos_sin, sink_attention, visible_count


def _scratch_redirect(slots: torch.Tensor, idx: torch.Tensor, write: torch.Tensor, n_slots: int):
    """(slot, row) pairs for a masked scatter: where `write` is False, send it to the scratch slot.
    slots [B], idx [B, X], write [B, X] -> (slot [B, X], row [B, X])."""
    scratch = torch.full_like(idx, n_slots - 1)
    slot = torch.where(write, slots[:, None].expand_as(idx), scratch)
    row = torch.where(write, idx, torch.zeros_like(idx))
    return slot, row


# ------------------------------------------------------------------------------------------------
# V4 attention: window ring + compressed entries
# ------------------------------------------------------------------------------------------------
@torch.library.custom_op("dsv4c::v4_attention_static", mutates_args=("ring",))
def v4_attention_static(q: torch.Tensor, kv: torch.Tensor, slots: torch.Tensor, pos0: torch.Tensor,
                        n_real: torch.Tensor, ring: torch.Tensor, sinks: torch.Tensor, entries: torch.Tensor | None,
                        selected: torch.Tensor | None, window: int, m: int) -> torch.Tensor:
    """Same contract as `dsv4c::v4_attention`, capture-safe (see the module docstring)."""
    return _attention_static(q, kv, slots, pos0, n_real, ring, sinks, None if entries is None else entries[slots],
                             selected, window, m)


@torch.library.custom_op("dsv4c::v4_attention_paged_static", mutates_args=("ring",))
def v4_attention_paged_static(q: torch.Tensor, kv: torch.Tensor, slots: torch.Tensor, pos0: torch.Tensor,
                              n_real: torch.Tensor, ring: torch.Tensor, sinks: torch.Tensor, pool: torch.Tensor,
                              block_table: torch.Tensor, selected: torch.Tensor | None, window: int,
                              m: int) -> torch.Tensor:
    """Same contract as `dsv4c::v4_attention_paged`, capture-safe: the batch's entries gathered through
    the block table (the slot op gathers `entries[slots]` the same way)."""
    return _attention_static(q, kv, slots, pos0, n_real, ring, sinks, paged_rows(pool, block_table, slots),
                             selected, window, m)


@v4_attention_paged_static.register_fake
def _(q, kv, slots, pos0, n_real, ring, sinks, pool, block_table, selected, window, m):
    return torch.empty(q.shape, dtype=torch.float32, device=q.device)


def _attention_static(q, kv, slots, pos0, n_real, ring, sinks, ent_rows, selected, window: int, m: int):
    """The static attention over the batch's entry rows `ent_rows [B, E, d]` (None: no entries)."""
    entries = ent_rows
    B, T, H, d = q.shape
    S = ring.shape[1]
    dev = q.device
    t = torch.arange(T, device=dev)
    qpos = pos0[:, None] + t  # [B, T]
    j = torch.arange(S, device=dev)
    last = pos0[:, None] - 1
    ring_pos = last - torch.remainder(last - j, S)  # [B, S]: newest position < pos0 stored in row j
    keys = torch.cat([ring[slots], kv.to(ring.dtype)], 1)  # [B, S+T, d] (read before the write below)
    key_pos = torch.cat([ring_pos, qpos], 1)  # [B, S+T]
    rel = qpos[:, :, None] - key_pos[:, None, :]  # [B, T, S+T]
    mask = (rel >= 0) & (rel < window) & (key_pos[:, None, :] >= 0)
    if entries is not None:
        E = entries.shape[1]
        if selected is None:
            vis = torch.arange(E, device=dev) < visible_count(qpos, m)[..., None]  # [B, T, E]
        else:
            vis = selection_mask(selected, E)
        keys = torch.cat([keys, entries], 1)
        mask = torch.cat([mask, vis], 2)
    out = sink_attention(q.float(), keys.float(), mask, sinks)
    # [B, T]: the last S real rows (a chunk longer than the ring leaves its newest S positions there,
    # and no two written rows share a ring row)
    write = (t[None, :] < n_real[:, None]) & (t[None, :] >= (n_real - S)[:, None])
    ws, wr = _scratch_redirect(slots, torch.remainder(qpos, S), write, ring.shape[0])
    ring[ws, wr] = kv.to(ring.dtype)
    return out


@v4_attention_static.register_fake
def _(q, kv, slots, pos0, n_real, ring, sinks, entries, selected, window, m):
    return torch.empty(q.shape, dtype=torch.float32, device=q.device)


# ------------------------------------------------------------------------------------------------
# V4 compressor update
# ------------------------------------------------------------------------------------------------
@torch.library.custom_op("dsv4c::v4_compress_static", mutates_args=("state_kv", "state_score", "entries"))
def v4_compress_static(kv: torch.Tensor, score: torch.Tensor, slots: torch.Tensor, pos0: torch.Tensor,
                       n_real: torch.Tensor, ape: torch.Tensor, norm_weight: torch.Tensor, inv_freq: torch.Tensor,
                       state_kv: torch.Tensor, state_score: torch.Tensor, entries: torch.Tensor, m: int,
                       eps: float) -> None:
    """Same contract as `dsv4c::v4_compress`, capture-safe.

    With r = pos0 mod m, the V = (c-1)·m + G·m virtual rows cover positions pos0 - r - (c-1)·m
    onwards, G = ceil((m + T) / m): the kept rows before pos0 (fill values before position 0), then
    the chunk's rows. Group g (positions pos0 - r + g·m …) closes iff (g+1)·m <= r + n_real and then
    becomes entry (pos0 - r)/m + g; for CSA its previous group is virtual group g. Every group is
    pooled; only the closing ones are written (the rest go to scratch). The chunk's last R real rows
    are kept at row position mod R."""
    e, entry_idx, closes = _compress_static(kv, score, slots, pos0, n_real, ape, norm_weight, inv_freq, state_kv,
                                            state_score, entries.shape[-1], entries.dtype, m, eps)
    ws, wr = _scratch_redirect(slots, entry_idx, closes, entries.shape[0])
    entries[ws, wr] = e


@torch.library.custom_op("dsv4c::v4_compress_paged_static", mutates_args=("state_kv", "state_score", "pool"))
def v4_compress_paged_static(kv: torch.Tensor, score: torch.Tensor, slots: torch.Tensor, pos0: torch.Tensor,
                             n_real: torch.Tensor, ape: torch.Tensor, norm_weight: torch.Tensor,
                             inv_freq: torch.Tensor, state_kv: torch.Tensor, state_score: torch.Tensor,
                             pool: torch.Tensor, block_table: torch.Tensor, m: int, eps: float) -> None:
    """Same contract as `dsv4c::v4_compress_paged`, capture-safe: the closing groups' entries go through
    the block table, the others to the scratch block (the pool's last)."""
    e, entry_idx, closes = _compress_static(kv, score, slots, pos0, n_real, ape, norm_weight, inv_freq, state_kv,
                                            state_score, pool.shape[-1], pool.dtype, m, eps)
    blk, row = paged_address(block_table, slots, entry_idx, pool.shape[1], closes, pool.shape[0] - 1)
    pool[blk, row] = e


@v4_compress_paged_static.register_fake
def _(kv, score, slots, pos0, n_real, ape, norm_weight, inv_freq, state_kv, state_score, pool, block_table, m, eps):
    return None


def _compress_static(kv, score, slots, pos0, n_real, ape, norm_weight, inv_freq, state_kv, state_score, w: int,
                     dtype: torch.dtype, m: int, eps: float):
    """The static compressor without the entry write: keeps the chunk's rows in the state and returns
    (entries [B, G, w], entry index [B, G], closes [B, G])."""
    B, T, cw = kv.shape
    n_slots, R = state_kv.shape[:2]
    c = cw // w
    dev = kv.device
    G = -(-(m + T) // m)
    r = torch.remainder(pos0, m)  # [B]
    t = torch.arange(T, device=dev)
    g_new = score.float() + ape.float()[torch.remainder(pos0[:, None] + t, m)]  # [B, T, cw]
    v = torch.arange((c - 1) * m + G * m, device=dev)
    p = (pos0 - r - (c - 1) * m)[:, None] + v  # [B, V] the position of each virtual row
    from_past = (p < pos0[:, None])[..., None]
    before_0 = (p < 0)[..., None]
    kept = (slots[:, None], torch.remainder(p, R))
    src = (p - pos0[:, None]).clamp(0, T - 1)[..., None].expand(-1, -1, cw)  # the chunk row of each virtual row
    buf_kv = torch.where(from_past, state_kv[kept].masked_fill(before_0, 0.0), kv.float().gather(1, src))
    buf_sc = torch.where(from_past, state_score[kept].masked_fill(before_0, float("-inf")), g_new.gather(1, src))
    grp_kv = buf_kv[:, (c - 1) * m :].view(B, G, m, cw)
    grp_sc = buf_sc[:, (c - 1) * m :].view(B, G, m, cw)
    if c == 2:
        prev_kv, prev_sc = buf_kv[:, : G * m].view(B, G, m, cw), buf_sc[:, : G * m].view(B, G, m, cw)
        slot_kv = torch.cat([prev_kv[..., :w], grp_kv[..., w:]], 2)  # [B, G, 2m, w]
        slot_sc = torch.cat([prev_sc[..., :w], grp_sc[..., w:]], 2)
    else:
        slot_kv, slot_sc = grp_kv, grp_sc
    pooled = (slot_sc.softmax(2) * slot_kv).sum(2)  # [B, G, w]
    e = (norm_weight.float() * rms(pooled, eps)).to(dtype)
    g = torch.arange(G, device=dev)
    entry_idx = torch.div(pos0 - r, m, rounding_mode="floor")[:, None] + g  # [B, G]
    cos, sin = _cos_sin(inv_freq, entry_idx * m)
    e = rope_interleaved(e, cos, sin)
    closes = (g[None, :] + 1) * m <= (r + n_real)[:, None]  # [B, G]
    keep = (t[None, :] < n_real[:, None]) & (t[None, :] >= (n_real - R)[:, None])  # [B, T]
    ks, kr = _scratch_redirect(slots, torch.remainder(pos0[:, None] + t, R), keep, n_slots)
    state_kv[ks, kr] = kv.float()
    state_score[ks, kr] = g_new
    return e, entry_idx, closes


@v4_compress_static.register_fake
def _(kv, score, slots, pos0, n_real, ape, norm_weight, inv_freq, state_kv, state_score, entries, m, eps):
    return None


# ------------------------------------------------------------------------------------------------
# V3 / V3.2 cache writes
# ------------------------------------------------------------------------------------------------
def _write_rows_static(rows: torch.Tensor, slots: torch.Tensor, pos0: torch.Tensor, n_real: torch.Tensor,
                       cache: torch.Tensor) -> None:
    """cache[slots[b], pos0[b] + t] = rows[b, t] for t < n_real[b]; the other rows go to scratch."""
    t = torch.arange(rows.shape[1], device=rows.device)
    write = t[None, :] < n_real[:, None]
    ws, wr = _scratch_redirect(slots, pos0[:, None] + t, write, cache.shape[0])
    cache[ws, wr] = rows.to(cache.dtype)


@torch.library.custom_op("dsv4c::mla_cache_update_static", mutates_args=("latent", "kpe"))
def mla_cache_update_static(c_kv: torch.Tensor, k_pe: torch.Tensor, slots: torch.Tensor, pos0: torch.Tensor,
                            n_real: torch.Tensor, latent: torch.Tensor, kpe: torch.Tensor) -> None:
    """Same contract as `dsv4c::mla_cache_update`, capture-safe."""
    _write_rows_static(c_kv, slots, pos0, n_real, latent)
    _write_rows_static(k_pe, slots, pos0, n_real, kpe)


@mla_cache_update_static.register_fake
def _(c_kv, k_pe, slots, pos0, n_real, latent, kpe):
    return None


@torch.library.custom_op("dsv4c::dsa_cache_update_static", mutates_args=("index_keys",))
def dsa_cache_update_static(k_idx: torch.Tensor, slots: torch.Tensor, pos0: torch.Tensor, n_real: torch.Tensor,
                            index_keys: torch.Tensor) -> None:
    """Same contract as `dsv4c::dsa_cache_update`, capture-safe."""
    _write_rows_static(k_idx, slots, pos0, n_real, index_keys)


@dsa_cache_update_static.register_fake
def _(k_idx, slots, pos0, n_real, index_keys):
    return None


def _write_rows_paged_static(rows, slots, pos0, n_real, pool, block_table) -> None:
    """Paged `_write_rows_static`: the real rows through the block table, the others to the scratch block."""
    t = torch.arange(rows.shape[1], device=rows.device)
    write = t[None, :] < n_real[:, None]
    blk, row = paged_address(block_table, slots, pos0[:, None] + t, pool.shape[1], write, pool.shape[0] - 1)
    pool[blk, row] = rows.to(pool.dtype)


@torch.library.custom_op("dsv4c::mla_cache_update_paged_static", mutates_args=("latent", "kpe"))
def mla_cache_update_paged_static(c_kv: torch.Tensor, k_pe: torch.Tensor, slots: torch.Tensor, pos0: torch.Tensor,
                                  n_real: torch.Tensor, latent: torch.Tensor, kpe: torch.Tensor,
                                  block_table: torch.Tensor) -> None:
    """Same contract as `dsv4c::mla_cache_update_paged`, capture-safe."""
    _write_rows_paged_static(c_kv, slots, pos0, n_real, latent, block_table)
    _write_rows_paged_static(k_pe, slots, pos0, n_real, kpe, block_table)


@mla_cache_update_paged_static.register_fake
def _(c_kv, k_pe, slots, pos0, n_real, latent, kpe, block_table):
    return None


@torch.library.custom_op("dsv4c::dsa_cache_update_paged_static", mutates_args=("index_keys",))
def dsa_cache_update_paged_static(k_idx: torch.Tensor, slots: torch.Tensor, pos0: torch.Tensor, n_real: torch.Tensor,
                                  index_keys: torch.Tensor, block_table: torch.Tensor) -> None:
    """Same contract as `dsv4c::dsa_cache_update_paged`, capture-safe."""
    _write_rows_paged_static(k_idx, slots, pos0, n_real, index_keys, block_table)


@dsa_cache_update_paged_static.register_fake
def _(k_idx, slots, pos0, n_real, index_keys, block_table):
    return None


# ------------------------------------------------------------------------------------------------
# routed experts
# ------------------------------------------------------------------------------------------------
@torch.library.custom_op("dsv4c::moe_experts_gathered", mutates_args=())
def moe_experts_gathered(x: torch.Tensor, idx: torch.Tensor, weight: torch.Tensor, w1: torch.Tensor,
                         w3: torch.Tensor, w2: torch.Tensor, swiglu_limit: float) -> torch.Tensor:
    """Same function as `dsv4c::moe_experts`, capture-safe: each (token, choice) pair gathers its
    expert's weights and runs a batched matmul. It moves T·K expert matrices, so it suits decode-sized
    T only; the Triton grouped kernels are the fast capture-safe form."""
    T, K = idx.shape
    D = x.shape[1]
    e = idx.reshape(-1)  # [T·K]
    xs = x.repeat_interleave(K, 0, output_size=T * K)[:, None, :]  # [T·K, 1, D]
    g = torch.bmm(xs, w1[e].transpose(1, 2))  # [T·K, 1, I]
    u = torch.bmm(xs, w3[e].transpose(1, 2))
    if swiglu_limit > 0:
        g = g.clamp(max=swiglu_limit)
        u = u.clamp(-swiglu_limit, swiglu_limit)
    y = torch.bmm(torch.nn.functional.silu(g) * u, w2[e].transpose(1, 2))  # [T·K, 1, D]
    y = (y[:, 0].float() * weight.reshape(-1, 1)).to(x.dtype).view(T, K, D)
    out = torch.zeros_like(x)
    for j in range(K):  # the reference adds one choice at a time, in x's dtype
        out = out + y[:, j]
    return out


@moe_experts_gathered.register_fake
def _(x, idx, weight, w1, w3, w2, swiglu_limit):
    return torch.empty_like(x)


# ------------------------------------------------------------------------------------------------
# fp32 linears of low-precision operands
# ------------------------------------------------------------------------------------------------
@torch.library.custom_op("dsv4c::linear_f32", mutates_args=())
def linear_f32(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """`linear(x.float(), w.float())` without the fp32 copy of w. x [..., D] and w [N, D] in one
    low-precision dtype -> fp32 [..., N].

    Products of two bf16 (or fp16) values are exact in fp32, so a GEMM that multiplies the stored
    operands and accumulates in fp32 computes the same sums; only the summation order can differ.
    On CUDA that is cuBLAS with an fp32 output (`torch.mm(..., out_dtype=torch.float32)`): it reads
    w once in its own dtype, where the reference first writes and then reads an fp32 copy (for the
    V4 head: 1 GB read, 2 GB written and 2 GB read again per step). On the CPU it is the reference."""
    if x.device.type != "cuda":
        return torch.nn.functional.linear(x.float(), w.float())
    x2 = x.reshape(-1, x.shape[-1])                                               # [M, D]
    if x2.shape[0] == 0:
        return x.new_empty((*x.shape[:-1], w.shape[0]), dtype=torch.float32)
    return torch.mm(x2, w.t(), out_dtype=torch.float32).view(*x.shape[:-1], w.shape[0])


@linear_f32.register_fake
def _(x, w):
    return x.new_empty((*x.shape[:-1], w.shape[0]), dtype=torch.float32)
