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

Legend: B batch, T chunk tokens (static, T <= S), n_slots cache slots (last = scratch), H heads,
d head dim, S ring rows, W window, m compress ratio, c overlap factor (2 for m = 4), w entry width,
E entry capacity, G groups a chunk can touch, V virtual rows (open group + chunk), K experts per token.
"""
from __future__ import annotations

import torch

from dsv4c.model.common import rms, rope_interleaved, selection_mask
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
    B, T, H, d = q.shape
    S = ring.shape[1]
    assert T <= S, f"v4_attention_static: chunk of {T} tokens exceeds the {S} ring rows"
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
        keys = torch.cat([keys, entries[slots]], 1)
        mask = torch.cat([mask, vis], 2)
    out = sink_attention(q.float(), keys.float(), mask, sinks)
    write = t[None, :] < n_real[:, None]  # [B, T]
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

    The open group's r = pos0 mod m rows and the chunk's rows form V = m + T virtual rows, cut into
    G = ceil(V / m) groups; group g closes iff (g+1)·m <= r + n_real and then becomes entry
    (pos0 - r)/m + g. Every group is pooled; only the closing ones are written (the rest go to scratch)."""
    B, T, cw = kv.shape
    n_slots = state_kv.shape[0]
    c = state_kv.shape[1] // m
    w = entries.shape[-1]
    dev = kv.device
    cur = (c - 1) * m
    G = -(-(m + T) // m)
    V = G * m
    r = torch.remainder(pos0, m)  # [B]
    t = torch.arange(T, device=dev)
    g_new = score.float() + ape.float()[torch.remainder(pos0[:, None] + t, m)]  # [B, T, cw]
    old_kv, old_sc = state_kv[slots, cur:], state_score[slots, cur:]  # [B, m, cw]
    v = torch.arange(V, device=dev)
    src = (v[None, :] - r[:, None]).clamp(0, T - 1)  # [B, V] chunk row feeding virtual row v
    from_old = v[None, :] < r[:, None]
    old_idx = v.clamp(max=m - 1)[None, :, None].expand(B, V, cw)
    buf_kv = torch.where(from_old[..., None], old_kv.gather(1, old_idx),
                         kv.float().gather(1, src[..., None].expand(B, V, cw)))  # [B, V, cw]
    buf_sc = torch.where(from_old[..., None], old_sc.gather(1, old_idx), g_new.gather(1, src[..., None].expand(B, V, cw)))
    n_valid = r + n_real  # [B]
    grp_kv, grp_sc = buf_kv.view(B, G, m, cw), buf_sc.view(B, G, m, cw)
    if c == 2:
        prev_kv = torch.cat([state_kv[slots, None, :m], grp_kv[:, :-1]], 1)  # [B, G, m, cw]
        prev_sc = torch.cat([state_score[slots, None, :m], grp_sc[:, :-1]], 1)
        slot_kv = torch.cat([prev_kv[..., :w], grp_kv[..., w:]], 2)  # [B, G, 2m, w]
        slot_sc = torch.cat([prev_sc[..., :w], grp_sc[..., w:]], 2)
    else:
        slot_kv, slot_sc = grp_kv, grp_sc
    pooled = (slot_sc.softmax(2) * slot_kv).sum(2)  # [B, G, w]
    e = (norm_weight.float() * rms(pooled, eps)).to(entries.dtype)
    g = torch.arange(G, device=dev)
    entry_idx = torch.div(pos0 - r, m, rounding_mode="floor")[:, None] + g  # [B, G]
    cos, sin = _cos_sin(inv_freq, entry_idx * m)
    e = rope_interleaved(e, cos, sin)
    closes = (g[None, :] + 1) * m <= n_valid[:, None]  # [B, G]
    ws, wr = _scratch_redirect(slots, entry_idx, closes, n_slots)
    entries[ws, wr] = e
    n_close = torch.div(n_valid, m, rounding_mode="floor")  # [B]
    # the open group's rows after the chunk: virtual rows n_close·m + j for j < rem, old rows after
    rem = n_valid - n_close * m
    jj = torch.arange(m, device=dev)
    take = (n_close * m)[:, None] + jj  # [B, m]
    keep_new = jj[None, :] < rem[:, None]
    take = take.clamp(max=V - 1)[..., None].expand(B, m, cw)
    new_open_kv = torch.where(keep_new[..., None], buf_kv.gather(1, take), old_kv)
    new_open_sc = torch.where(keep_new[..., None], buf_sc.gather(1, take), old_sc)
    if c == 2:  # the newest closed group becomes the previous group
        last = (n_close - 1).clamp(min=0)[:, None, None, None].expand(B, 1, m, cw)
        closed_any = (n_close > 0)[:, None, None]
        new_prev_kv = torch.where(closed_any, grp_kv.gather(1, last)[:, 0], state_kv[slots, :m])
        new_prev_sc = torch.where(closed_any, grp_sc.gather(1, last)[:, 0], state_score[slots, :m])
        new_open_kv = torch.cat([new_prev_kv, new_open_kv], 1)
        new_open_sc = torch.cat([new_prev_sc, new_open_sc], 1)
    state_kv[slots] = new_open_kv
    state_score[slots] = new_open_sc


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
