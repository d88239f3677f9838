"""The V4 lightning-indexer selection (`dsv4c::v4_indexer_topk`) as two Triton launches.

Public API::

    v4_indexer_topk_fused(q, weights, keys, slots, pos0, topk, m) -> Tensor   # two Triton launches
    v4_indexer_topk_fused_ref(q, weights, keys, slots, pos0, topk, m)          # the model's op, ascending
    v4_indexer_scores(q, weights, keys, slots, pos0, m) -> Tensor             # launch 1 alone (tests)
    v4_indexer_scores_ref(q, weights, keys, slots, pos0, m)                   # its fp32 PyTorch twin

Custom op (for the lead to wire in; CPU = the reference)::

    dsv4c::v4_indexer_topk_fused(Tensor q, Tensor weights, Tensor keys, Tensor slots, Tensor pos0,
                                 int topk, int m) -> Tensor

Dimensions: B batch rows, T tokens per row, HI indexer heads, dI indexer head dim, E entry capacity
of a slot (ceil(max_len / m)), K = topk, n_slots cache slots, m compress ratio (4 for CSA).

Semantics (deepseek_v4.md §4.1(e), `dsv4c.model.v4_ops.v4_indexer_topk`): for query (b, t) at
position p = pos0[b] + t, entry e is visible iff (e + 1)·m <= p + 1, i.e. e < n_vis = (p + 1) // m,
and scores Σ_h weights[b, t, h] · dI^-½ · relu(q[b, t, h] · keys[slots[b], e]). The result
[B, T, K] int64 holds the SAME SET of entries as the model op, the top-min(K, n_vis) visible ones,
but in ASCENDING ENTRY ORDER followed by -1 padding (the model op orders them by score). The only
consumer, the attention's `selection_mask`, reads the list as a set. Ties at the K-th score are
broken towards the lowest entry indices (deterministic; torch.topk may pick others of equal score).

Launch 1 (`_scores_kernel`, grid (B·T, cdiv(E, BLOCK_E))): one [HI, dI] x [dI, BLOCK_E] `tl.dot`
with fp32 accumulation (bf16 products are exact in fp32, so only the summation order differs from
the reference), relu, then the weighted sum over heads; -inf where invisible. Blocks wholly past
n_vis skip the dot and only store -inf. Scores go to an fp32 scratch [B·T, E].

Launch 2 (`_select_kernel`, grid (B·T,)): if n_vis <= K, write 0..n_vis-1 then -1 (the decode case:
n_vis = pos/4 against K = 512). Otherwise find the K-th largest score exactly, as the uint32 image
of its fp32 bits under the order-preserving map (flip all bits of negatives, the sign bit of the
rest), by a radix search: 8 passes of 4 bits, each counting, for the 16 candidate next digits at
once, how many visible scores are >= the candidate. Then one pass writes, compacted in ascending
order with prefix sums, every entry above the threshold and the first (K - #above) entries equal
to it. A row of E <= MAX_ROW scores stays in registers for all passes. A longer one (E > MAX_ROW: contexts
past 4·MAX_ROW = 8192 tokens) is selected in stages (`_select_sliced`, while 2·K <= MAX_ROW): slices of
MAX_ROW entries side by side, each keeping its top K with their scores, until one slice holds the survivors;
the same set and order as one program would take. Otherwise one program re-reads the row in chunks of MAX_ROW
(from L1/L2: it was written by launch 1 just before), 8 counting passes and 2 writing passes over all of it:
at 65536 tokens (E = 16384) the slice's batch-1 decode step was 0.32 ms slower than at 1024 (2026-12-06, run39),
this one-program selection the likely share of it (not profiled).

Both grids are fixed by the shapes, nothing is read back to the host: capture-safe. `slots` must
index real cache slots (not checked on device; `batch_meta` checks it on the host).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from dsv4c.kernels._tl import interpret_flag, pdl_launch, pdl_wait

__all__ = ["v4_indexer_scores", "v4_indexer_scores_ref", "v4_indexer_topk_fused", "v4_indexer_topk_fused_op",
           "v4_indexer_topk_fused_ref", "v4_indexer_topk_paged_fused_op", "v4_indexer_topk_paged_fused_ref"]

_ACT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
BLOCK_E = 64        # entries per program of launch 1
FP32_D_STEP = 16    # dI step of launch 1's fp32 dot (16-bit inputs take dI in one step)
MAX_ROW = 2048      # scores per chunk of launch 2 (a row up to this length stays in registers)
DIGIT_BITS = 4      # radix digit of the threshold search: 32 / 4 = 8 counting passes
BLOCK_K = 512       # output positions per store of the select-all path


# ------------------------------------------------------------------------------------------------
# launch 1: scores
# ------------------------------------------------------------------------------------------------
@triton.jit
def _n_visible(pos0_ptr, row, T, E, m):
    """Visible entries of query row = b·T + t: clamp((pos0[b] + t + 1) // m, 0, E)."""
    b = row // T
    t = row - b * T
    p1 = tl.load(pos0_ptr + b) + t + 1
    return tl.minimum(tl.maximum(p1, 0) // m, E)


@triton.jit
def _scores_kernel(q_ptr, w_ptr, k_ptr, slots_ptr, pos0_ptr, s_ptr, T, E, m, scale,
                   HI: tl.constexpr, DI: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
                   D_STEP: tl.constexpr, BLOCK_E: tl.constexpr, INTERPRET: tl.constexpr,
                   bt_ptr=None, NB=1, RB: tl.constexpr = 1, PAGED: tl.constexpr = False, PDL: tl.constexpr = False):
    pdl_wait(PDL)
    # q [B·T, HI, DI], w [B·T, HI] fp32, keys [n_slots, E, DI], s (out) [B·T, E] fp32; all contiguous.
    # PAGED: keys is a pool [N + 1, RB, DI], entry e of the slot at row e mod RB of block bt[slot, e // RB]
    # (block table [n_slots, NB] int64, E = NB·RB; RB a constexpr: // and % are shifts or multiplies). A tile
    # inside one block (RB a multiple of BLOCK_E) reads one table entry, else one per entry (same address
    # for the entries of a block)
    row = tl.program_id(0).to(tl.int64)
    e = tl.program_id(1) * BLOCK_E + tl.arange(0, BLOCK_E)
    n_vis = _n_visible(pos0_ptr, row, T, E, m)
    s_row = s_ptr + row * E
    if tl.program_id(1) * BLOCK_E >= n_vis:
        tl.store(s_row + e, tl.full((BLOCK_E,), float("-inf"), tl.float32), mask=e < E)
    else:
        h = tl.arange(0, BLOCK_H)
        hm = h < HI
        slot = tl.load(slots_ptr + row // T)
        if PAGED:
            e0 = tl.program_id(1) * BLOCK_E
            if RB % BLOCK_E == 0:
                blk = tl.load(bt_ptr + slot * NB + e0 // RB).to(tl.int64)              # e0 < n_vis <= E
            else:
                blk = tl.load(bt_ptr + slot * NB + e // RB, mask=e < n_vis, other=0).to(tl.int64)
            krow = blk * RB + e % RB                                               # [BLOCK_E] pool rows
        else:
            krow = slot * E + e
        dots = tl.zeros((BLOCK_H, BLOCK_E), tl.float32)
        for d0 in tl.static_range(0, BLOCK_D, D_STEP):  # one step for 16-bit inputs (tensor cores)
            d = d0 + tl.arange(0, D_STEP)
            dm = d < DI
            q = tl.load(q_ptr + row * (HI * DI) + h[:, None] * DI + d[None, :], mask=hm[:, None] & dm[None, :],
                        other=0.0)                                                 # [BLOCK_H, D_STEP]
            k = tl.load(k_ptr + krow[None, :] * DI + d[:, None],
                        mask=dm[:, None] & (e < n_vis)[None, :], other=0.0)        # [D_STEP, BLOCK_E]
            if INTERPRET:  # the interpreter's dot would multiply bf16 bit patterns; fp32 products are the same
                q = q.to(tl.float32)
                k = k.to(tl.float32)
            dots = tl.dot(q, k, dots, input_precision="ieee")                      # [BLOCK_H, BLOCK_E]
        w = tl.load(w_ptr + row * HI + h, mask=hm, other=0.0) * scale              # [BLOCK_H]
        s = tl.sum(tl.maximum(dots, 0.0) * w[:, None], axis=0)                     # [BLOCK_E]
        s = tl.where(e < n_vis, s, float("-inf"))
        tl.store(s_row + e, s, mask=e < E)


# ------------------------------------------------------------------------------------------------
# launch 2: selection
# ------------------------------------------------------------------------------------------------
@triton.jit
def _ordered_bits(s):
    """uint32 image of fp32 s, monotone in s: negatives get all bits flipped, the rest the sign bit."""
    bits = s.to(tl.uint32, bitcast=True)
    neg = bits >> 31
    return bits ^ ((neg * 0x7FFFFFFF) | 0x80000000)


@triton.jit
def _load_keys(s_row, c0, n_vis, CHUNK: tl.constexpr):
    """(entry ids, ordered keys, visible mask) of chunk [c0, c0 + CHUNK) of a score row."""
    e = c0 + tl.arange(0, CHUNK)
    valid = e < n_vis
    u = _ordered_bits(tl.load(s_row + e, mask=valid, other=0.0))
    return e, u, valid


@triton.jit
def _count_ge(u, valid, cand):
    """[R] counts of valid keys u [C] >= each candidate cand [R]."""
    ge = (u[None, :] >= cand[:, None]) & valid[None, :]
    return tl.sum(ge.to(tl.int32), axis=1)


@triton.jit
def _select_kernel(s_ptr, pos0_ptr, out_ptr, T, E, m, K: tl.constexpr, CHUNK: tl.constexpr,
                   N_CHUNKS: tl.constexpr, BLOCK_K: tl.constexpr, DIGIT: tl.constexpr, PDL: tl.constexpr = False):
    pdl_wait(PDL)
    # s [B·T, E] fp32 scores, out [B·T, K] int64
    row = tl.program_id(0).to(tl.int64)
    n_vis = _n_visible(pos0_ptr, row, T, E, m)
    out_row = out_ptr + row * K
    s_row = s_ptr + row * E
    if n_vis <= K:
        for j0 in range(0, K, BLOCK_K):
            j = j0 + tl.arange(0, BLOCK_K)
            tl.store(out_row + j, tl.where(j < n_vis, j, -1).to(tl.int64), mask=j < K)
    elif N_CHUNKS == 1:
        e, u, valid = _load_keys(s_row, 0, n_vis, CHUNK)
        thr = _threshold(u, valid, K, DIGIT)
        # write: every key > thr, then the lowest-index keys == thr until K are taken; ascending entry order
        need = K - tl.sum(((u > thr) & valid).to(tl.int32), axis=0)
        _write_chunk(out_row, e, u, valid, thr, need, 0, 0, K)
    else:
        RADIX: tl.constexpr = 1 << DIGIT
        digits = tl.arange(0, RADIX).to(tl.uint32)
        # thr: the K-th largest key, built digit by digit from the top; count(keys >= thr) >= K throughout
        thr = tl.zeros((), tl.uint32)
        for p in tl.static_range(32 // DIGIT):
            cand = thr + (digits << (32 - DIGIT * (p + 1)))                        # [RADIX], ascending
            cnt = tl.zeros((RADIX,), tl.int32)
            for c in range(N_CHUNKS):
                e, u, valid = _load_keys(s_row, c * CHUNK, n_vis, CHUNK)
                cnt += _count_ge(u, valid, cand)
            best = tl.sum((cnt >= K).to(tl.int32), axis=0) - 1                      # cnt is non-increasing
            thr = thr + (best.to(tl.uint32) << (32 - DIGIT * (p + 1)))
        # write: every key > thr, then the lowest-index keys == thr until K are taken; ascending entry order
        need = K
        for c in range(N_CHUNKS):
            e, u, valid = _load_keys(s_row, c * CHUNK, n_vis, CHUNK)
            need -= tl.sum(((u > thr) & valid).to(tl.int32), axis=0)
        taken = 0
        ties = 0
        for c in range(N_CHUNKS):
            e, u, valid = _load_keys(s_row, c * CHUNK, n_vis, CHUNK)
            taken, ties = _write_chunk(out_row, e, u, valid, thr, need, taken, ties, K)


@triton.jit
def _threshold(u, valid, K: tl.constexpr, DIGIT: tl.constexpr):
    """The K-th largest valid key of u [C] (in registers): built digit by digit from the top, DIGIT bits a
    pass, keeping count(valid keys >= thr) >= K."""
    RADIX: tl.constexpr = 1 << DIGIT
    digits = tl.arange(0, RADIX).to(tl.uint32)
    thr = tl.zeros((), tl.uint32)
    for p in tl.static_range(32 // DIGIT):
        cand = thr + (digits << (32 - DIGIT * (p + 1)))                            # [RADIX], ascending
        best = tl.sum((_count_ge(u, valid, cand) >= K).to(tl.int32), axis=0) - 1    # counts are non-increasing
        thr = thr + (best.to(tl.uint32) << (32 - DIGIT * (p + 1)))
    return thr


@triton.jit
def _select_slice_kernel(s_ptr, id_ptr, pos0_ptr, cs_ptr, cid_ptr, T, L, m, K: tl.constexpr, SLICE: tl.constexpr,
                         BLOCK_K: tl.constexpr, FIRST: tl.constexpr, LAST: tl.constexpr, DIGIT: tl.constexpr,
                         PDL: tl.constexpr = False):
    """Program (row, s) of one stage of the sliced selection (rows longer than MAX_ROW): the top K of the row's
    candidates [s·SLICE, (s+1)·SLICE) by (score desc, id asc), their ids (and, unless LAST, their scores)
    written in ascending id order at [row, s·K ...] of cid / cs [rows, S·K], then (-1, -inf) up to K.
    FIRST: the candidates are the score row [rows, L] itself, id = position, valid below n_vis; else ids come
    from id_ptr [rows, L] (-1: empty). LAST (one slice): cid is the op's output [rows, K]."""
    pdl_wait(PDL)
    row = tl.program_id(0).to(tl.int64)
    sl = tl.program_id(1)
    p = sl * SLICE + tl.arange(0, SLICE)
    if FIRST:
        valid = p < _n_visible(pos0_ptr, row, T, L, m)
        ids = p.to(tl.int64)
    else:
        ids = tl.load(id_ptr + row * L + p, mask=p < L, other=-1)
        valid = ids >= 0
    sc = tl.load(s_ptr + row * L + p, mask=valid, other=0.0)
    u = _ordered_bits(sc)
    if tl.sum(valid.to(tl.int32), axis=0) > K:
        thr = _threshold(u, valid, K, DIGIT)
        eq = ((u == thr) & valid).to(tl.int32)
        need = K - tl.sum(((u > thr) & valid).to(tl.int32), axis=0)
        take = (((u > thr) & valid) | ((eq != 0) & (tl.cumsum(eq, axis=0) - eq < need))).to(tl.int32)
    else:
        take = valid.to(tl.int32)
    dst = tl.cumsum(take, axis=0) - take                                           # ascending positions
    base = (row * tl.num_programs(1) + sl) * K
    tl.store(cid_ptr + base + dst, ids, mask=take != 0)
    j = tl.arange(0, BLOCK_K)
    pad = (j >= tl.sum(take, axis=0)) & (j < K)
    tl.store(cid_ptr + base + j, tl.full((BLOCK_K,), -1, tl.int64), mask=pad)
    if not LAST:
        tl.store(cs_ptr + base + dst, sc, mask=take != 0)
        tl.store(cs_ptr + base + j, tl.full((BLOCK_K,), float("-inf"), tl.float32), mask=pad)


@triton.jit
def _write_chunk(out_row, e, u, valid, thr, need, taken, ties, K: tl.constexpr):
    """Store the chunk's selected entries at out_row[taken + rank]; returns the updated (taken, ties)."""
    eq = ((u == thr) & valid).to(tl.int32)
    tie_rank = ties + tl.cumsum(eq, axis=0) - eq                                   # exclusive
    take = (((u > thr) & valid) | ((eq != 0) & (tie_rank < need))).to(tl.int32)
    dst = taken + tl.cumsum(take, axis=0) - take
    tl.store(out_row + dst, e.to(tl.int64), mask=(take != 0) & (dst < K))  # exactly K are taken; never past the row
    return taken + tl.sum(take, axis=0), ties + tl.sum(eq, axis=0)


# ------------------------------------------------------------------------------------------------
# host side
# ------------------------------------------------------------------------------------------------
def _check(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, slots: torch.Tensor, pos0: torch.Tensor,
           topk: int, m: int) -> None:
    name = "v4_indexer_topk_fused"
    if q.dim() != 4:
        raise ValueError(f"{name}: q must be [B, T, HI, dI], got shape {list(q.shape)}")
    B, T, HI, dI = q.shape
    if q.dtype not in _ACT_DTYPES:
        raise ValueError(f"{name}: q must be bfloat16/float16/float32, got {q.dtype}")
    if keys.dim() != 3 or keys.shape[2] != dI:
        raise ValueError(f"{name}: keys must be [n_slots, E, dI={dI}], got shape {list(keys.shape)}")
    if keys.dtype != q.dtype:
        raise ValueError(f"{name}: keys dtype {keys.dtype} differs from q dtype {q.dtype}")
    if tuple(weights.shape) != (B, T, HI):
        raise ValueError(f"{name}: weights must be [B, T, HI] = {[B, T, HI]}, got shape {list(weights.shape)}")
    if weights.dtype != torch.float32:
        raise ValueError(f"{name}: weights must be float32, got {weights.dtype}")
    for t_name, t in (("slots", slots), ("pos0", pos0)):
        if tuple(t.shape) != (B,) or t.dtype != torch.int64:
            raise ValueError(f"{name}: {t_name} must be int64 [B={B}], got {t.dtype} {list(t.shape)}")
    for t_name, t in (("q", q), ("weights", weights), ("keys", keys), ("slots", slots), ("pos0", pos0)):
        if not t.is_contiguous():
            raise ValueError(f"{name}: {t_name} must be contiguous, got strides {list(t.stride())}")
        if t.device != q.device:
            raise ValueError(f"{name}: {t_name} is on {t.device}, q on {q.device}")
    if topk < 0:
        raise ValueError(f"{name}: topk must be >= 0, got {topk}")
    if m < 1:
        raise ValueError(f"{name}: m must be >= 1, got {m}")
    if HI < 1 or dI < 1:
        raise ValueError(f"{name}: q needs HI >= 1 and dI >= 1, got shape {list(q.shape)}")


def _scores_into(scores: torch.Tensor, q, weights, keys, slots, pos0, m: int, block_table=None) -> None:
    B, T, HI, dI = q.shape
    E = keys.shape[1]
    paged = {}
    if block_table is not None:  # keys: a pool [N + 1, RB, dI]
        paged = dict(bt_ptr=block_table, NB=block_table.shape[1], RB=E, PAGED=True)
        E = block_table.shape[1] * E
    block_d = max(16, triton.next_power_of_2(dI))
    # fp32 dots run on FMA units (ieee precision, no tf32): a small K step keeps the operands in registers
    d_step = min(block_d, FP32_D_STEP) if q.dtype == torch.float32 else block_d
    grid = (B * T, triton.cdiv(E, BLOCK_E))
    _scores_kernel[grid](q, weights, keys, slots, pos0, scores, T, E, m, dI ** -0.5, HI=HI, DI=dI,
                         BLOCK_H=max(16, triton.next_power_of_2(HI)), BLOCK_D=block_d, D_STEP=d_step,
                         BLOCK_E=BLOCK_E, INTERPRET=interpret_flag(q), num_warps=4, **paged, **pdl_launch(q))


def v4_indexer_scores(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, slots: torch.Tensor,
                      pos0: torch.Tensor, m: int) -> torch.Tensor:
    """Launch 1 alone: fp32 scores [B, T, E], -inf where invisible (see the module doc)."""
    _check(q, weights, keys, slots, pos0, 0, m)
    B, T = q.shape[:2]
    E = keys.shape[1]
    scores = torch.empty(B, T, E, dtype=torch.float32, device=q.device)
    if scores.numel():
        _scores_into(scores, q, weights, keys, slots, pos0, m)
    return scores


def v4_indexer_topk_fused(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, slots: torch.Tensor,
                          pos0: torch.Tensor, topk: int, m: int, block_table: torch.Tensor | None = None) -> torch.Tensor:
    """idx [B, T, topk] int64: the model op's set of entries in ascending entry order, -1 after (module
    doc). Two launches (rows past MAX_ROW entries: one more per stage of `_select_sliced`); CPU tensors run
    under the Triton interpreter. With `block_table` [n_slots, NB] (paged): keys is a pool [N + 1, RB, dI]
    read through the table, E = NB·RB."""
    _check(q, weights, keys, slots, pos0, topk, m)
    B, T = q.shape[:2]
    E = keys.shape[1]
    if block_table is not None:
        _check_table(block_table, keys)
        E *= block_table.shape[1]
    out = torch.empty(B, T, topk, dtype=torch.int64, device=q.device)
    if out.numel() == 0:
        return out
    if E == 0:
        return out.fill_(-1)
    scores = torch.empty(B, T, E, dtype=torch.float32, device=q.device)
    _scores_into(scores, q, weights, keys, slots, pos0, m, block_table)
    if E > MAX_ROW and 2 * topk <= MAX_ROW:
        _select_sliced(scores.view(B * T, E), pos0, out.view(B * T, topk), T, m, topk)
        return out
    chunk = min(MAX_ROW, triton.next_power_of_2(E))
    _select_kernel[(B * T,)](scores, pos0, out, T, E, m, K=topk, CHUNK=chunk, N_CHUNKS=triton.cdiv(E, chunk),
                             BLOCK_K=min(BLOCK_K, triton.next_power_of_2(topk)), DIGIT=DIGIT_BITS,
                             num_warps=8 if chunk >= 1024 else 4, **pdl_launch(scores))
    return out


def _select_sliced(scores: torch.Tensor, pos0: torch.Tensor, out: torch.Tensor, T: int, m: int, topk: int) -> None:
    """Launch 2 for rows longer than MAX_ROW, in stages: each stage cuts every row into slices of MAX_ROW
    candidates, one program a slice keeps its top K (ids ascending, with their scores), so a row of L candidates
    becomes ceil(L / MAX_ROW)·K, until one slice holds them all and writes `out`. A row's top K by (score desc,
    id asc) is within the union of its slices' top K (each slice's share of it is a prefix of that slice's
    order), so the result is the one-program selection's, exactly; the slices run side by side instead of one
    program re-reading the row 8 + 2 times. Needs 2·K <= MAX_ROW (each stage at least halves a long row)."""
    R, L = scores.shape
    s, ids, first = scores, scores, True  # ids unused in the first stage (the position is the id)
    while True:
        S = triton.cdiv(L, MAX_ROW)
        last = S == 1
        slice_ = MAX_ROW if not last else max(16, triton.next_power_of_2(L))
        cs = s if last else torch.empty(R, S * topk, dtype=torch.float32, device=s.device)
        cid = out if last else torch.empty(R, S * topk, dtype=torch.int64, device=s.device)
        _select_slice_kernel[(R, S)](s, ids, pos0, cs, cid, T, L, m, K=topk, SLICE=slice_,
                                     BLOCK_K=triton.next_power_of_2(max(topk, 1)), FIRST=first, LAST=last,
                                     DIGIT=DIGIT_BITS, num_warps=8 if slice_ >= 1024 else 4, **pdl_launch(s))
        if last:
            return
        s, ids, L, first = cs, cid, S * topk, False


def v4_indexer_scores_ref(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, slots: torch.Tensor,
                          pos0: torch.Tensor, m: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The model op's score in `dtype` (fp64 for error measurements), -inf where invisible: [B, T, E]."""
    from dsv4c.model.v4_ops import visible_count

    T, E = q.shape[1], keys.shape[1]
    pos = pos0[:, None] + torch.arange(T, device=q.device)                        # [B, T]
    dots = torch.einsum("bthi,bsi->bths", q.to(dtype), keys[slots].to(dtype)).relu()
    score = torch.einsum("bth,bths->bts", weights.to(dtype) * q.shape[-1] ** -0.5, dots)
    visible = torch.arange(E, device=q.device) < visible_count(pos, m)[..., None]
    return score.masked_fill(~visible, float("-inf"))


def v4_indexer_topk_fused_ref(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, slots: torch.Tensor,
                              pos0: torch.Tensor, topk: int, m: int) -> torch.Tensor:
    """The model's `v4_indexer_topk` with the fused op's output convention: its entries sorted ascending,
    -1 after (ties at the K-th score are torch.topk's choice here, lowest-index in the kernel)."""
    from dsv4c.model.v4_ops import v4_indexer_topk

    return _ascending(v4_indexer_topk(q, weights, keys, slots, pos0, topk, m))


def _ascending(idx: torch.Tensor) -> torch.Tensor:
    """Sort each row's entries ascending, keeping -1 (unused) at the end."""
    big = torch.iinfo(torch.int64).max
    s = idx.masked_fill(idx < 0, big).sort(dim=-1).values
    return s.masked_fill(s == big, -1)


@torch.library.custom_op("dsv4c::v4_indexer_topk_fused", mutates_args=())
def v4_indexer_topk_fused_op(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, slots: torch.Tensor,
                             pos0: torch.Tensor, topk: int, m: int) -> torch.Tensor:
    """`v4_indexer_topk_fused` on CUDA tensors; on CPU the model op's selection in ascending order."""
    if q.device.type == "cpu":
        _check(q, weights, keys, slots, pos0, topk, m)
        return v4_indexer_topk_fused_ref(q, weights, keys, slots, pos0, topk, m)
    return v4_indexer_topk_fused(q, weights, keys, slots, pos0, topk, m)


@v4_indexer_topk_fused_op.register_fake
def _v4_indexer_topk_fused_fake(q, weights, keys, slots, pos0, topk, m):
    return q.new_empty((q.shape[0], q.shape[1], topk), dtype=torch.int64)


# ------------------------------------------------------------------------------------------------
# paged keys (dsv4c.model.common.PagedLayout): launch 1 reads the keys through the block table
# ------------------------------------------------------------------------------------------------
def _check_table(block_table: torch.Tensor, pool: torch.Tensor) -> None:
    if block_table.dtype != torch.int64 or block_table.dim() != 2 or not block_table.is_contiguous() \
            or block_table.device != pool.device:
        raise ValueError(f"v4_indexer_topk_paged_fused: block_table must be contiguous int64 [n_slots, NB] on "
                         f"{pool.device}, got {block_table.dtype} {list(block_table.shape)} on {block_table.device}")


def v4_indexer_topk_paged_fused_ref(q: torch.Tensor, weights: torch.Tensor, pool: torch.Tensor,
                                    block_table: torch.Tensor, slots: torch.Tensor, pos0: torch.Tensor, topk: int,
                                    m: int) -> torch.Tensor:
    """The model's `v4_indexer_topk_paged`, entries sorted ascending (the fused op's output convention)."""
    from dsv4c.model.v4_ops import v4_indexer_topk_paged

    return _ascending(v4_indexer_topk_paged(q, weights, pool, block_table, slots, pos0, topk, m))


@torch.library.custom_op("dsv4c::v4_indexer_topk_paged_fused", mutates_args=())
def v4_indexer_topk_paged_fused_op(q: torch.Tensor, weights: torch.Tensor, pool: torch.Tensor,
                                   block_table: torch.Tensor, slots: torch.Tensor, pos0: torch.Tensor, topk: int,
                                   m: int) -> torch.Tensor:
    """`dsv4c::v4_indexer_topk_paged` as the two launches on CUDA tensors; on CPU its reference, ascending."""
    if q.device.type == "cpu":
        _check(q, weights, pool, slots, pos0, topk, m)
        _check_table(block_table, pool)
        return v4_indexer_topk_paged_fused_ref(q, weights, pool, block_table, slots, pos0, topk, m)
    return v4_indexer_topk_fused(q, weights, pool, slots, pos0, topk, m, block_table)


@v4_indexer_topk_paged_fused_op.register_fake
def _v4_indexer_topk_paged_fused_fake(q, weights, pool, block_table, slots, pos0, topk, m):
    return q.new_empty((q.shape[0], q.shape[1], topk), dtype=torch.int64)
