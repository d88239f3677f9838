"""V4 decode attention (`dsv4c::v4_attention_static`) as two Triton launches.

Public API::

    v4_attention_fused(q, kv, slots, pos0, n_real, ring, sinks, entries, selected, window, m,
                       config=None) -> o                          # two launches, capture-safe
    v4_attention_fused_ref(...)                                    # the static op itself (the spec)

Custom op (same signature as `dsv4c::v4_attention_static`; CUDA = the kernels, CPU = the static op)::

    dsv4c::v4_attention_fused(q, kv, slots, pos0, n_real, ring(a!), sinks, entries, selected, window, m) -> o

Legend: B batch, T chunk tokens, H heads, d head dim, n_slots cache slots (last = scratch), S ring rows,
W window, m compress ratio (0 = no entries), E entry capacity, k selected entries per token (CSA),
BH heads per program, BN keys per block, SPLIT programs that share one (token, head block)'s keys.

Function (identical to the static op): for the query of row b, token t at qpos = pos0[b] + t the keys
(K = V) are
  * window: positions p in [qpos - W + 1, pos0 - 1], p >= 0, read from ring[slots[b], p mod S] (only
    positions >= pos0 - S are still there; the static op reads the same ones);
  * chunk: the chunk's own rows t' <= t (from kv, not the ring);
  * entries (m > 0): CSA (`selected` given) the rows entries[slots[b], selected[b, t, j]] with
    selected >= 0 (distinct indices, as the indexer's top-k gives; a duplicate would count twice
    here and once in the static op); HCA (`selected` None) the rows i < (qpos + 1) // m.
  o = Σ softmax(q·k / sqrt(d)) k with exp(sinks[h]) added to the denominator only; o fp32.
  Then ring[slots[b], (pos0 + t) mod S] = kv[b, t] for n_real[b] - S <= t < n_real[b] (the last S real
  rows: a prefill chunk longer than the ring leaves its newest S positions); other rows write nothing
  (the static op sends them to the scratch slot instead; its contents stay unspecified). T is any length:
  decode (1), verify (1 + k) and prefill chunks alike.

Design (flash decoding):
  1. `_attn_split_kernel`, grid (B·T, cdiv(H, BH), SPLIT). The keys of one query form a virtual list
     of three segments (window positions pos0 - NW … pos0 - 1 with NW = min(S, W - 1), chunk rows,
     entries), each cut into blocks of BN keys; program s takes the blocks g ≡ s (mod SPLIT) of the
     global block numbering. Blocks that cannot hold a valid key (before position 0 or the window
     start, chunk rows after t, HCA entries past the visible count) are skipped by the in-kernel loop
     bounds. Each key block is loaded once and serves both QK^T (bf16 tensor-core dot, fp32
     accumulation: products exact) and PV; p is split into bf16 hi + lo (two dots, ~2^-17 relative)
     instead of one bf16 rounding (2^-9). Online softmax in base 2. It writes the unnormalised
     partial (acc, max, sum); with SPLIT = 1 it applies the sink and writes o itself.
  2. `_combine_kernel`, grid (B·T, cdiv(H, CH)): merges the SPLIT partials with the sink, writes o,
     and (head block 0) writes the chunk's real rows into the ring. CH = BH, or fewer heads per program
     at small B·T (`V4AttnConfig.combine_programs`).
  Deterministic mode (`POS_BLOCKS`, `BATCH_INVARIANT`): the window and the chunk form one list of
  positions p_lo … qpos, cut into blocks aligned to the absolute position (block g = p // BN; p < pos0
  read from the ring, p >= pos0 from kv), entries numbered from 0, and SPLIT a constant: a key's
  block, its program and its place in the reduction depend on qpos alone, so T = 1 and T = 1 + k
  give a row the same bits (needs S >= W - 1: every V4 cache ring has S = W + k_max).
  The ring write is in the second launch, after every read of the first: no ordering hazard for any
  S, W, T (a write in the same launch as the reads would need S >= W + T - 1: the written rows hold
  positions pos0 + t and the read rows positions >= pos0 - W + 1, which share a row mod S iff S
  divides a distance in [1, W + T - 2]). The grid depends on shapes only and nothing is read back
  to the host: capture-safe. CPU tensors run under the Triton interpreter (bf16 dots in fp32 there).

sm_90 compile (on the CPU machine, cuobjdump --dump-resource-usage; d = 512, bf16, default config: BH 16,
BN 32, 8 warps, 2 stages): the split kernel takes 128 registers under Triton 3.6 (124 under 3.9), no stack,
50 KB shared: two programs per SM. The block-table path with the table lookup as shifts (RB constexpr) would
take 141-145 and fit one program per SM, so its launch caps registers at 128 (`paged_max_registers`; 8 B of
stack); HCA's paged path fits 128 uncapped. fp32 activations (IEEE dots) spill at d = 512: correct but not
tuned; the benchmark runs bf16.
"""
from __future__ import annotations

import dataclasses
import math

import torch
import triton
import triton.language as tl
from dsv4c.kernels._tl import pdl_launch, pdl_wait

LOG2E = 1.4426950408889634
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

# Accuracy of this kernel vs the static op (rel_err, fp64), per activation dtype. Both compute in fp32
# from the same inputs; what differs is summation order, exp2 vs exp, and for bf16/fp16 the hi/lo
# split of p (residual ~2^-17 of p). Largest measured on the CPU interpreter over the CPU test cases
# (tests/test_kernels_v4_attention.py): fp32 1.5e-7, bf16 1.3e-6; a torch simulation of the bf16 hi/lo
# split at Flash-like sizes (700 keys, d 512) gives 2e-6. Thresholds: ~10x fp32, and the 1e-5 target
# for bf16 (the H200 runs). fp16 is accepted but not measured.
REL_ERR: dict[torch.dtype, float] = {torch.float32: 2e-6, torch.bfloat16: 1e-5, torch.float16: 1e-5}


@dataclasses.dataclass(frozen=True)
class V4AttnConfig:
    """Tile configuration. block_h heads and block_n keys per step; split = programs per (token, head
    block) (None: enough to give about `target_programs` programs, at most one per key block)."""
    block_h: int = 16
    block_n: int = 32
    num_warps: int = 8  # sm_90, d = 512: 4 warps spill at block_n 32 (255 regs + 64 B stack), 8 do not
    num_stages: int = 2
    split: int | None = None
    target_programs: int = 264  # two per SM of an H200 (132 SMs)
    # batch-invariant (deterministic mode): SPLIT = invariant_split, never from B·T or T, and key blocks
    # aligned to absolute positions (POS_BLOCKS), so a row's partials and their merge order depend on
    # neither how many rows share the launch nor how many tokens its own row carries
    batch_invariant: bool = False
    invariant_split: int = 8
    # block-table path: a register cap. The slot path compiles to 128 registers at the defaults (sm_90,
    # Triton 3.6 and 3.9), two programs of 8 warps per SM; the table lookup (constexpr rows per block)
    # takes it to 141-145 and one program per SM, so the paged launch asks for 128 (ptxas: 8 B of stack).
    # None: the compiler's choice.
    paged_max_registers: int | None = 128
    # The combine's head block: 0 keeps block_h; > 0 halves it (down to 1 head) until the combine has about
    # this many programs. At batch 1 block_h 16 gives 4 programs for 64 heads, each reading all SPLIT partials
    # of 16 heads in turn. The per-head merge is the same arithmetic in any block; batch-invariant configs keep
    # block_h all the same, so their launch never depends on B·T. run56 (H100, the 2-layer slice at batch 1):
    # 264 took the step's replay on the GPU alone from 0.851 to 0.846 ms (attention's critical path 37 -> 30 µs).
    combine_programs: int = 264

    def __post_init__(self):
        for name in ("block_h", "block_n"):
            v = getattr(self, name)
            if v < 16 or v & (v - 1):
                raise ValueError(f"V4AttnConfig.{name}: a power of two >= 16 (tl.dot), got {v}")
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"V4AttnConfig.num_warps: 1, 2, 4, 8 or 16, got {self.num_warps}")
        if self.split is not None and self.split < 1:
            raise ValueError(f"V4AttnConfig.split: at least 1, got {self.split}")
        if self.combine_programs < 0:
            raise ValueError(f"V4AttnConfig.combine_programs: 0 (off) or a program count, got {self.combine_programs}")
        if self.paged_max_registers is not None and not 24 <= self.paged_max_registers <= 255:
            raise ValueError(f"V4AttnConfig.paged_max_registers: 24..255 or None, got {self.paged_max_registers}")


# ------------------------------------------------------------------------------------------------
# device code
# ------------------------------------------------------------------------------------------------
@triton.jit
def _dot(a, b, acc, LOWP: tl.constexpr, INTERPRET: tl.constexpr):
    """acc + a [M, K] @ b [K, N] in fp32: the stored low-precision operands on the tensor cores
    (exact products), fp32 operands in IEEE fp32; the interpreter multiplies in fp32."""
    if INTERPRET:
        return acc + tl.dot(a.to(tl.float32), b.to(tl.float32))
    elif LOWP:
        return tl.dot(a, b, acc)
    else:
        return tl.dot(a, b, acc, input_precision="ieee")


@triton.jit
def _round_to(x, dtype: tl.constexpr):
    """fp32 x rounded to `dtype`, as fp32 (exact in dtype). bf16 by bit arithmetic (nearest, ties
    to even; x finite), so the interpreter, whose casts truncate, rounds like the GPU."""
    if dtype == tl.bfloat16:
        bits = x.to(tl.int32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
        return bits.to(tl.float32, bitcast=True)
    else:
        return x.to(dtype).to(tl.float32)


@triton.jit
def _attend_block(q, k, valid, m_i, l_i, acc, qk_scale, LOWP: tl.constexpr, INTERPRET: tl.constexpr):
    """One online-softmax step (base 2) of q [BH, BD] over the key block k [BN, BD] (K = V); valid [BN]."""
    s = _dot(q, tl.trans(k), tl.zeros([q.shape[0], k.shape[0]], tl.float32), LOWP, INTERPRET) * qk_scale
    s = tl.where(valid[None, :], s, float("-inf"))                                   # [BH, BN]
    m_new = tl.maximum(m_i, tl.max(s, 1))  # m_i starts finite (-1e30): no inf - inf
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    if LOWP:  # p = hi + lo in the operand dtype: two dots, residual ~2^-17 of p
        p_hi = _round_to(p, k.dtype)
        p_lo = _round_to(p - p_hi, k.dtype)
        acc = _dot(p_hi.to(k.dtype), k, acc, LOWP, INTERPRET)
        acc = _dot(p_lo.to(k.dtype), k, acc, LOWP, INTERPRET)
    else:
        acc = _dot(p, k, acc, LOWP, INTERPRET)
    return m_new, l_i, acc


@triton.jit
def _first_block(lo, seg_off, s, SPLIT: tl.constexpr, INTERPRET: tl.constexpr):
    """The smallest local block index i >= lo of a segment starting at global block seg_off with
    (seg_off + i) mod SPLIT == s."""
    return _loop_bound(lo + ((s - seg_off - lo) % SPLIT + SPLIT) % SPLIT, INTERPRET)


@triton.jit
def _loop_bound(x, INTERPRET: tl.constexpr):
    """x usable as a `range` bound. The interpreter holds every scalar as a 1-element array, which
    numpy 2 refuses to turn into a Python int (`range(tensor, ...)` fails there), so it gets the int;
    the compiler never visits that branch (INTERPRET is a constexpr)."""
    if INTERPRET:
        return x.handle.data.item()
    else:
        return x


@triton.jit
def _paged_rows(sel_ptr, bt_ptr, bt, slot, i, n, n_keys, NSEL, E, NB, RB: tl.constexpr, BLOCK_N: tl.constexpr,
                ENT_MODE: tl.constexpr):
    """(pool rows [BN] int64, valid [BN]) of entry tile i (entries i·BN + n): entry e of the slot is row
    e mod RB of block bt[slot, e // RB], with e int32 (< E = NB·RB) and RB a constexpr, so // and % are
    shifts (or a multiply) rather than a 64-bit division by a runtime value. Consecutive entries (HCA) with
    RB a multiple of BN lie in one block: one table entry per tile."""
    j = i * BLOCK_N + n
    if ENT_MODE == 1:
        idx = tl.load(sel_ptr + bt.to(tl.int64) * NSEL + j, mask=j < NSEL, other=-1)
        valid = (idx >= 0) & (idx < E)
        e = tl.where(valid, idx, 0).to(tl.int32)  # < E = NB·RB
    else:
        valid = j < n_keys
        e = tl.where(valid, j, 0)
    if ENT_MODE == 2 and RB % BLOCK_N == 0:
        j0 = i * BLOCK_N
        blk = tl.load(bt_ptr + slot * NB + j0 // RB, mask=j0 < n_keys, other=0)  # one entry for the tile
    else:
        blk = tl.load(bt_ptr + slot * NB + e // RB, mask=valid, other=0)
    return blk.to(tl.int64) * RB + e % RB, valid


@triton.jit
def _finish(acc, m_i, l_i, sink_log2):
    """o = acc / (l + 2^(sink - m)) with everything rescaled to max(m, sink) (base 2)."""
    mx = tl.maximum(m_i, sink_log2)
    w = tl.exp2(m_i - mx)
    den = l_i * w + tl.exp2(sink_log2 - mx)
    return acc * (w / den)[:, None]


@triton.jit
def _attn_split_kernel(
        q_ptr, kv_ptr, ring_ptr, ent_ptr, sel_ptr, slots_ptr, pos0_ptr, sinks_ptr,
        o_ptr, pacc_ptr, pm_ptr, pl_ptr,
        sq_b, sq_t, sq_h, skv_b, skv_t,
        T, H, S, E, NSEL, W, NW, M_RATIO, qk_scale,
        D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
        SPLIT: tl.constexpr, ENT_MODE: tl.constexpr, LOWP: tl.constexpr, INTERPRET: tl.constexpr,
        POS_BLOCKS: tl.constexpr, bt_ptr=None, NB=1, RB: tl.constexpr = 1, PAGED: tl.constexpr = False,
        PDL: tl.constexpr = False):
    pdl_wait(PDL)
    # q [B, T, H, D] (strides sq_*, last 1); kv [B, T, D] (strides skv_*, last 1); ring [n_slots, S, D],
    # entries [n_slots, E, D], selected [B, T, NSEL] contiguous. ENT_MODE 0: no entries, 1: selected
    # (CSA), 2: the visible prefix (HCA). Partials pacc [B·T, SPLIT, H, D], pm / pl [B·T, SPLIT, H].
    # PAGED: entries is a pool [N + 1, RB, D]; entry i of the slot at row i mod RB of block
    # bt[slot, i // RB] (block table [n_slots, NB] int64, E = NB·RB; RB a constexpr: // and % are shifts
    # or multiplies, on int32 entry ids).
    bt = tl.program_id(0)
    hb = tl.program_id(1)
    sp = tl.program_id(2)
    b = bt // T
    t = bt % T
    slot = tl.load(slots_ptr + b)
    pos0 = tl.load(pos0_ptr + b)
    qpos = pos0 + t
    h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    dd = tl.arange(0, BLOCK_D)
    hm = h < H
    dm = dd < D
    q = tl.load(q_ptr + b.to(tl.int64) * sq_b + t * sq_t + h[:, None] * sq_h + dd[None, :],
                mask=hm[:, None] & dm[None, :], other=0.0)                             # [BH, BD]
    m_i = tl.full([BLOCK_H], -1e30, tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    n = tl.arange(0, BLOCK_N)

    if POS_BLOCKS:
        # window and chunk as one list of positions p_lo .. qpos cut into blocks aligned to the absolute
        # position (block g holds g·BN … g·BN + BN - 1): a key's block, its program and its place in the
        # reduction depend on qpos alone, not on pos0 or T (decode T = 1 and a verify of 1 + k tokens
        # reduce the same key tiles in the same order). p < pos0 comes from the ring, p >= pos0 from kv.
        nwb = 0
        p_lo = tl.maximum(tl.maximum(qpos - W + 1, 0), pos0 - NW)
        ring_base = ring_ptr + slot * S * D
        for g in range(_first_block(p_lo // BLOCK_N, 0, sp, SPLIT, INTERPRET),
                       _loop_bound(qpos // BLOCK_N + 1, INTERPRET), SPLIT):
            p = g * BLOCK_N + n
            valid = (p >= p_lo) & (p <= qpos)
            old = valid & (p < pos0)
            new = valid & (p >= pos0)
            src = tl.where(old, ring_base + (tl.where(old, p, 0) % S) * D,
                           kv_ptr + b.to(tl.int64) * skv_b + tl.where(new, p - pos0, 0) * skv_t)  # [BN] rows
            k = tl.load(src[:, None] + dd[None, :], mask=valid[:, None] & dm[None, :], other=0.0)
            m_i, l_i, acc = _attend_block(q, k, valid, m_i, l_i, acc, qk_scale, LOWP, INTERPRET)
    else:
        # window: virtual key i holds position pos0 - NW + i (i < NW); valid iff >= 0 and >= qpos - W + 1
        nwb = tl.cdiv(NW, BLOCK_N)
        p_lo = tl.maximum(tl.maximum(qpos - W + 1, 0), pos0 - NW)
        lo = (p_lo - (pos0 - NW)) // BLOCK_N
        ring_base = ring_ptr + slot * S * D
        for i in range(_first_block(lo, 0, sp, SPLIT, INTERPRET), _loop_bound(nwb, INTERPRET), SPLIT):
            p = pos0 - NW + i * BLOCK_N + n
            valid = (p >= p_lo) & (p < pos0)
            row = tl.where(valid, p, 0) % S
            k = tl.load(ring_base + row[:, None] * D + dd[None, :], mask=valid[:, None] & dm[None, :], other=0.0)
            m_i, l_i, acc = _attend_block(q, k, valid, m_i, l_i, acc, qk_scale, LOWP, INTERPRET)

        # chunk rows t' <= t (t - t' < W): blocks from the window's first row on (a long prefill chunk
        # does not scan its earlier rows)
        ncb = tl.cdiv(t + 1, BLOCK_N)
        c_lo = tl.maximum(t - W + 1, 0) // BLOCK_N
        for i in range(_first_block(c_lo, nwb, sp, SPLIT, INTERPRET), _loop_bound(ncb, INTERPRET), SPLIT):
            tp = i * BLOCK_N + n
            valid = (tp <= t) & (t - tp < W)
            k = tl.load(kv_ptr + b.to(tl.int64) * skv_b + tp[:, None] * skv_t + dd[None, :],
                        mask=valid[:, None] & dm[None, :], other=0.0)
            m_i, l_i, acc = _attend_block(q, k, valid, m_i, l_i, acc, qk_scale, LOWP, INTERPRET)

    # entries
    if ENT_MODE != 0:
        ent_base = ent_ptr + slot * E * D
        if POS_BLOCKS:
            off = 0
        else:
            off = nwb + tl.cdiv(T, BLOCK_N)
        if ENT_MODE == 1:
            n_keys = NSEL
        else:
            n_keys = tl.minimum((qpos + 1) // M_RATIO, E)
        i0 = _first_block(0, off, sp, SPLIT, INTERPRET)
        i1 = _loop_bound(tl.cdiv(n_keys, BLOCK_N), INTERPRET)
        if PAGED:  # the slot path's loop, the keys' pool rows through the block table
            for i in range(i0, i1, SPLIT):
                prow, valid = _paged_rows(sel_ptr, bt_ptr, bt, slot, i, n, n_keys, NSEL, E, NB, RB, BLOCK_N, ENT_MODE)
                k = tl.load(ent_ptr + prow[:, None] * D + dd[None, :], mask=valid[:, None] & dm[None, :], other=0.0)
                m_i, l_i, acc = _attend_block(q, k, valid, m_i, l_i, acc, qk_scale, LOWP, INTERPRET)
        else:
            for i in range(i0, i1, SPLIT):
                j = i * BLOCK_N + n
                if ENT_MODE == 1:
                    idx = tl.load(sel_ptr + bt.to(tl.int64) * NSEL + j, mask=j < NSEL, other=-1)
                    valid = (idx >= 0) & (idx < E)
                else:
                    idx = j
                    valid = j < n_keys
                row = tl.where(valid, idx, 0)
                k = tl.load(ent_base + row[:, None] * D + dd[None, :], mask=valid[:, None] & dm[None, :],
                            other=0.0)
                m_i, l_i, acc = _attend_block(q, k, valid, m_i, l_i, acc, qk_scale, LOWP, INTERPRET)

    if SPLIT == 1:
        sink = tl.load(sinks_ptr + h, mask=hm, other=0.0).to(tl.float32) * 1.4426950408889634
        o = _finish(acc, m_i, l_i, sink)
        tl.store(o_ptr + (bt.to(tl.int64) * H + h[:, None]) * D + dd[None, :], o, mask=hm[:, None] & dm[None, :])
    else:
        row_ml = (bt.to(tl.int64) * SPLIT + sp) * H + h                                 # [BH]
        tl.store(pm_ptr + row_ml, m_i, mask=hm)
        tl.store(pl_ptr + row_ml, l_i, mask=hm)
        tl.store(pacc_ptr + row_ml[:, None] * D + dd[None, :], acc, mask=hm[:, None] & dm[None, :])


@triton.jit
def _combine_kernel(kv_ptr, ring_ptr, slots_ptr, pos0_ptr, nreal_ptr, sinks_ptr, o_ptr, pacc_ptr, pm_ptr, pl_ptr,
                    skv_b, skv_t, T, H, S,
                    D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr, SPLIT: tl.constexpr,
                    PDL: tl.constexpr = False):
    pdl_wait(PDL)
    # o [B·T, H, D] fp32 from the SPLIT partials (skipped when SPLIT = 1: the first kernel wrote o);
    # then head block 0 writes kv[b, t] to ring[slots[b], (pos0[b] + t) mod S] if n_real[b] - S <= t < n_real[b]
    bt = tl.program_id(0)
    hb = tl.program_id(1)
    dd = tl.arange(0, BLOCK_D)
    dm = dd < D
    if SPLIT > 1:
        h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
        hm = h < H
        row0 = bt.to(tl.int64) * SPLIT * H + h                                          # [BH] split 0
        mx = tl.full([BLOCK_H], -1e30, tl.float32)
        for s in range(SPLIT):
            mx = tl.maximum(mx, tl.load(pm_ptr + row0 + s * H, mask=hm, other=-1e30))
        l_sum = tl.zeros([BLOCK_H], tl.float32)
        acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
        for s in range(SPLIT):
            w = tl.exp2(tl.load(pm_ptr + row0 + s * H, mask=hm, other=-1e30) - mx)
            l_sum += w * tl.load(pl_ptr + row0 + s * H, mask=hm, other=0.0)
            part = tl.load(pacc_ptr + (row0 + s * H)[:, None] * D + dd[None, :], mask=hm[:, None] & dm[None, :],
                           other=0.0)
            acc += w[:, None] * part
        sink = tl.load(sinks_ptr + h, mask=hm, other=0.0).to(tl.float32) * 1.4426950408889634
        o = _finish(acc, mx, l_sum, sink)
        tl.store(o_ptr + (bt.to(tl.int64) * H + h[:, None]) * D + dd[None, :], o, mask=hm[:, None] & dm[None, :])
    if hb == 0:
        b = bt // T
        t = bt % T
        nr = tl.load(nreal_ptr + b)
        if (t < nr) & (t >= nr - S):
            slot = tl.load(slots_ptr + b)
            row = (tl.load(pos0_ptr + b) + t) % S
            x = tl.load(kv_ptr + b.to(tl.int64) * skv_b + t * skv_t + dd, mask=dm)
            tl.store(ring_ptr + (slot * S + row) * D + dd, x, mask=dm)


# ------------------------------------------------------------------------------------------------
# host side
# ------------------------------------------------------------------------------------------------
def _check(q, kv, slots, pos0, n_real, ring, sinks, entries, selected, window, m, block_table=None) -> None:
    name = "v4_attention_fused"
    if q.dim() != 4:
        raise ValueError(f"{name}: q must be [B, T, H, d], got shape {list(q.shape)}")
    B, T, H, d = q.shape
    if q.dtype not in _DTYPES:
        raise ValueError(f"{name}: q must be float32/bfloat16/float16, got {q.dtype}")
    for tname, x, shape in (("kv", kv, (B, T, d)), ("ring", ring, (ring.shape[0], ring.shape[1], d))):
        if x.dim() != 3 or tuple(x.shape) != shape:
            raise ValueError(f"{name}: {tname} must be {list(shape)} (from q {list(q.shape)}), got {list(x.shape)}")
        if x.dtype != q.dtype:
            raise ValueError(f"{name}: {tname} dtype {x.dtype} differs from q's {q.dtype} (one act dtype)")
    for tname, x in (("q", q), ("kv", kv)):
        if x.stride(-1) != 1:
            raise ValueError(f"{name}: {tname} needs a unit stride in its last dim, got strides {x.stride()}")
    if not ring.is_contiguous():
        raise ValueError(f"{name}: ring must be contiguous, got strides {ring.stride()}")
    n_slots, S = ring.shape[:2]
    for tname, x in (("slots", slots), ("pos0", pos0), ("n_real", n_real)):
        if x.dtype != torch.int64 or tuple(x.shape) != (B,) or not x.is_contiguous():
            raise ValueError(f"{name}: {tname} must be contiguous int64 [{B}], got {x.dtype} {list(x.shape)}")
    if sinks.dtype != torch.float32 or tuple(sinks.shape) != (H,) or not sinks.is_contiguous():
        raise ValueError(f"{name}: sinks must be contiguous float32 [{H}], got {sinks.dtype} {list(sinks.shape)}")
    if S < 1:
        raise ValueError(f"{name}: ring must have at least one row per slot, got {list(ring.shape)}")
    if window < 1:
        raise ValueError(f"{name}: window must be >= 1, got {window}")
    if block_table is not None:  # paged: entries is the pool [N + 1, RB, d]
        if block_table.dtype != torch.int64 or block_table.dim() != 2 or block_table.shape[0] != n_slots \
                or not block_table.is_contiguous() or entries is None:
            raise ValueError(f"{name}: block_table must be contiguous int64 [{n_slots}, NB] with a pool of entries, "
                             f"got {block_table.dtype} {list(block_table.shape)}")
        n_slots = entries.shape[0]
    if entries is not None:
        if entries.dim() != 3 or entries.shape[0] != n_slots or entries.shape[2] != d:
            raise ValueError(f"{name}: entries must be [{n_slots}, E, {d}], got {list(entries.shape)}")
        if entries.dtype != q.dtype or not entries.is_contiguous():
            raise ValueError(f"{name}: entries must be contiguous {q.dtype}, got {entries.dtype} strides "
                             f"{entries.stride()}")
        if selected is None and m < 1:
            raise ValueError(f"{name}: m must be >= 1 for HCA entries (selected None), got {m}")
    if selected is not None:
        if entries is None:
            raise ValueError(f"{name}: selected given without entries")
        if selected.dtype != torch.int64 or selected.dim() != 3 or tuple(selected.shape[:2]) != (B, T) \
                or not selected.is_contiguous():
            raise ValueError(f"{name}: selected must be contiguous int64 [{B}, {T}, k], got {selected.dtype} "
                             f"{list(selected.shape)}")
    devs = {x.device for x in (q, kv, slots, pos0, n_real, ring, sinks, entries, selected) if x is not None}
    if len(devs) != 1:
        raise ValueError(f"{name}: all tensors must be on one device, got {sorted(map(str, devs))}")


def _grid_split(B: int, T: int, H: int, n_blocks: int, cfg: V4AttnConfig) -> int:
    if cfg.split is not None:
        return cfg.split
    if cfg.batch_invariant:  # from the config alone: neither B·T nor T (nor the key count) changes it
        return cfg.invariant_split
    base = B * T * triton.cdiv(H, cfg.block_h)
    return max(1, min(n_blocks, triton.cdiv(cfg.target_programs, base)))


def _combine_heads(BT: int, H: int, cfg: V4AttnConfig) -> int:
    """Heads per combine program (`V4AttnConfig.combine_programs`)."""
    ch = cfg.block_h
    if cfg.combine_programs and not cfg.batch_invariant:
        while ch > 1 and BT * triton.cdiv(H, ch) < cfg.combine_programs:
            ch //= 2
    return ch


def v4_attention_fused(q: torch.Tensor, kv: torch.Tensor, slots: torch.Tensor, pos0: torch.Tensor,
                       n_real: torch.Tensor, ring: torch.Tensor, sinks: torch.Tensor, entries: torch.Tensor | None,
                       selected: torch.Tensor | None, window: int, m: int,
                       config: V4AttnConfig | None = None, block_table: torch.Tensor | None = None) -> torch.Tensor:
    """`dsv4c::v4_attention_static` in two launches (see the module doc). q [B, T, H, d], kv [B, T, d]
    (last-dim stride 1), ring [n_slots, S, d] and entries [n_slots, E, d] contiguous, all one dtype;
    slots/pos0/n_real int64 [B]; sinks fp32 [H]; selected int64 [B, T, k] or None. -> o [B, T, H, d]
    fp32; ring updated in place. CPU tensors run under the Triton interpreter. With `block_table`
    [n_slots, NB] (paged, `dsv4c::v4_attention_paged_static`): entries is a pool [N + 1, RB, d] read
    through the table, E = NB·RB."""
    _check(q, kv, slots, pos0, n_real, ring, sinks, entries, selected, window, m, block_table)
    cfg = config or V4AttnConfig()
    B, T, H, d = q.shape
    S = ring.shape[1]
    o = torch.empty((B, T, H, d), dtype=torch.float32, device=q.device)
    if o.numel() == 0:
        return o
    E = entries.shape[1] if entries is not None else 0
    paged = {}
    interp = q.device.type == "cpu"
    if block_table is not None:
        paged = dict(bt_ptr=block_table, NB=block_table.shape[1], RB=E, PAGED=True)
        if cfg.paged_max_registers is not None and not interp:
            paged["maxnreg"] = cfg.paged_max_registers
        E = block_table.shape[1] * E
    n_sel = selected.shape[2] if selected is not None else 0
    ent_mode = 0 if entries is None else (1 if selected is not None else 2)
    n_ent = (n_sel if ent_mode == 1 else E) if ent_mode else 0
    nw = min(S, window - 1)
    bn = cfg.block_n
    n_blocks = triton.cdiv(nw, bn) + triton.cdiv(T, bn) + triton.cdiv(n_ent, bn)
    split = _grid_split(B, T, H, n_blocks, cfg)
    hb = triton.cdiv(H, cfg.block_h)
    if split > 1:
        pacc = torch.empty((B * T, split, H, d), dtype=torch.float32, device=q.device)
        pm = torch.empty((B * T, split, H), dtype=torch.float32, device=q.device)
        pl = torch.empty_like(pm)
    else:
        pacc = pm = pl = o  # unused
    ent = entries if entries is not None else ring  # dummy pointers when absent (never read)
    sel = selected if selected is not None else slots
    lowp = q.dtype != torch.float32
    block_d = triton.next_power_of_2(d)
    _attn_split_kernel[(B * T, hb, split)](
        q, kv, ring, ent, sel, slots, pos0, sinks, o, pacc, pm, pl,
        q.stride(0), q.stride(1), q.stride(2), kv.stride(0), kv.stride(1),
        T, H, S, E, n_sel, window, nw, max(m, 1), LOG2E / math.sqrt(d),
        D=d, BLOCK_D=block_d, BLOCK_H=cfg.block_h, BLOCK_N=bn, SPLIT=split, ENT_MODE=ent_mode, LOWP=lowp,
        INTERPRET=interp, POS_BLOCKS=cfg.batch_invariant, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        **paged, **pdl_launch(q))
    ch = _combine_heads(B * T, H, cfg) if split > 1 else cfg.block_h
    _combine_kernel[(B * T, triton.cdiv(H, ch) if split > 1 else 1)](
        kv, ring, slots, pos0, n_real, sinks, o, pacc, pm, pl, kv.stride(0), kv.stride(1), T, H, S,
        D=d, BLOCK_D=block_d, BLOCK_H=ch, SPLIT=split, num_warps=8 if ch >= 8 else 4, **pdl_launch(kv))
    return o


def v4_attention_fused_ref(q: torch.Tensor, kv: torch.Tensor, slots: torch.Tensor, pos0: torch.Tensor,
                           n_real: torch.Tensor, ring: torch.Tensor, sinks: torch.Tensor,
                           entries: torch.Tensor | None, selected: torch.Tensor | None, window: int,
                           m: int) -> torch.Tensor:
    """The static op (dsv4c/model/static_ops.py `v4_attention_static`), unchanged: the specification."""
    from dsv4c.model.static_ops import v4_attention_static

    return v4_attention_static(q, kv, slots, pos0, n_real, ring, sinks, entries, selected, window, m)


@torch.library.custom_op("dsv4c::v4_attention_fused", mutates_args=("ring",))
def v4_attention_fused_op(q: torch.Tensor, kv: torch.Tensor, slots: torch.Tensor, pos0: torch.Tensor,
                          n_real: torch.Tensor, ring: torch.Tensor, sinks: torch.Tensor, entries: torch.Tensor | None,
                          selected: torch.Tensor | None, window: int, m: int) -> torch.Tensor:
    """`dsv4c::v4_attention_static` as two Triton launches on CUDA tensors; on CPU the static op."""
    if q.device.type == "cpu":
        _check(q, kv, slots, pos0, n_real, ring, sinks, entries, selected, window, m)
        return v4_attention_fused_ref(q, kv, slots, pos0, n_real, ring, sinks, entries, selected, window, m)
    return v4_attention_fused(q, kv, slots, pos0, n_real, ring, sinks, entries, selected, window, m)


@v4_attention_fused_op.register_fake
def _v4_attention_fused_fake(q, kv, slots, pos0, n_real, ring, sinks, entries, selected, window, m):
    return torch.empty(q.shape, dtype=torch.float32, device=q.device)


BATCH_INVARIANT = V4AttnConfig(batch_invariant=True)


@torch.library.custom_op("dsv4c::v4_attention_fused_det", mutates_args=("ring",))
def v4_attention_fused_det_op(q: torch.Tensor, kv: torch.Tensor, slots: torch.Tensor, pos0: torch.Tensor,
                              n_real: torch.Tensor, ring: torch.Tensor, sinks: torch.Tensor,
                              entries: torch.Tensor | None, selected: torch.Tensor | None, window: int,
                              m: int) -> torch.Tensor:
    """`v4_attention_fused` with `BATCH_INVARIANT` (`--kernel v4_attention=fused_det`): a fixed split
    and key blocks aligned to absolute positions (`POS_BLOCKS`, module doc), so a row's output depends
    on neither the batch size nor the tokens per row (a verify row equals the decode row at its position
    bit for bit, given the same keys). On CPU the static op."""
    if q.device.type == "cpu":
        _check(q, kv, slots, pos0, n_real, ring, sinks, entries, selected, window, m)
        return v4_attention_fused_ref(q, kv, slots, pos0, n_real, ring, sinks, entries, selected, window, m)
    return v4_attention_fused(q, kv, slots, pos0, n_real, ring, sinks, entries, selected, window, m, BATCH_INVARIANT)


@v4_attention_fused_det_op.register_fake
def _v4_attention_fused_det_fake(q, kv, slots, pos0, n_real, ring, sinks, entries, selected, window, m):
    return torch.empty(q.shape, dtype=torch.float32, device=q.device)


# ------------------------------------------------------------------------------------------------
# paged entries (dsv4c.model.common.PagedLayout): the same kernels, entries read through the block table
# ------------------------------------------------------------------------------------------------
def v4_attention_paged_fused_ref(q: torch.Tensor, kv: torch.Tensor, slots: torch.Tensor, pos0: torch.Tensor,
                                 n_real: torch.Tensor, ring: torch.Tensor, sinks: torch.Tensor, pool: torch.Tensor,
                                 block_table: torch.Tensor, selected: torch.Tensor | None, window: int,
                                 m: int) -> torch.Tensor:
    """The paged static op (dsv4c/model/static_ops.py `v4_attention_paged_static`): the specification."""
    from dsv4c.model.static_ops import v4_attention_paged_static

    return v4_attention_paged_static(q, kv, slots, pos0, n_real, ring, sinks, pool, block_table, selected, window, m)


@torch.library.custom_op("dsv4c::v4_attention_paged_fused", mutates_args=("ring",))
def v4_attention_paged_fused_op(q: torch.Tensor, kv: torch.Tensor, slots: torch.Tensor, pos0: torch.Tensor,
                                n_real: torch.Tensor, ring: torch.Tensor, sinks: torch.Tensor, pool: torch.Tensor,
                                block_table: torch.Tensor, selected: torch.Tensor | None, window: int,
                                m: int) -> torch.Tensor:
    """`dsv4c::v4_attention_paged_static` as the two Triton launches on CUDA tensors; on CPU the static op."""
    if q.device.type == "cpu":
        _check(q, kv, slots, pos0, n_real, ring, sinks, pool, selected, window, m, block_table)
        return v4_attention_paged_fused_ref(q, kv, slots, pos0, n_real, ring, sinks, pool, block_table, selected,
                                            window, m)
    return v4_attention_fused(q, kv, slots, pos0, n_real, ring, sinks, pool, selected, window, m,
                              block_table=block_table)


@v4_attention_paged_fused_op.register_fake
def _v4_attention_paged_fused_fake(q, kv, slots, pos0, n_real, ring, sinks, pool, block_table, selected, window, m):
    return torch.empty(q.shape, dtype=torch.float32, device=q.device)
