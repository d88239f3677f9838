"""The V4 compressor update (`dsv4c::v4_compress_static`) as one Triton launch.

Public API::

    v4_compress_fused(kv, score, slots, pos0, n_real, ape, norm_weight, inv_freq,
                      state_kv, state_score, entries, m, eps) -> None   # Triton, 1 launch (2 if R is short)
    v4_compress_fused_ref(...same...)                                  # the static op, called (the spec)

Custom op (same schema as dsv4c::v4_compress_static; CPU = the static op)::

    dsv4c::v4_compress_fused(kv, score, slots, pos0, n_real, ape, norm_weight, inv_freq,
                             state_kv!, state_score!, entries!, int m, float eps) -> ()

Legend: B batch rows, T chunk tokens, m compress ratio, c overlap factor (2 for CSA m = 4, else 1),
w entry width, cw = c·w state/projection width, r rope dims (the last r channels of an entry,
interleaved pairs; r/2 = len(inv_freq)), n_slots cache slots (the last is scratch), R kept state
rows (position p at row p mod R), E entry capacity, G = (m - 1 + T) // m groups a chunk can close.

Semantics (those of the static op; dsv4c/model/v4_ops.py `v4_compress` is the readable form): group j
(positions j·m … j·m+m-1) closes in this call iff its last position < pos0 + n_real. Its entry is
    entries[slot, j] = rope( (norm_weight · rms(pooled)).to(entries.dtype) ) at angle (j·m)·inv_freq,
    pooled[ch] = Σ_rows softmax_rows(score)[row, ch] · kv[row, ch]         (fp32, per channel)
over m rows (c = 1) or 2m rows (c = 2: the previous group's first w channels, then this group's last
w channels). A row of position p < 0 is kv 0 / score -inf; p < pos0 reads the state row p mod R
(its score already holds ape); p >= pos0 reads chunk row p - pos0 with score + ape[p mod m]. Then
the chunk's last min(n_real, R) real rows are kept: state[slot, p mod R] = (kv, score + ape).

Kernel: grid (B, G); program (b, g) pools the g-th group that can close in row b's chunk and
returns at once when it does not close (at decode, T = 1, that is m - 1 calls in m), then writes the
chunk rows t = g, g + G, … to the state. Nothing goes to the scratch slot: non-closing groups and
padding rows are skipped (the static op writes them to scratch, whose contents are unspecified).
The rows of a group are read in blocks of BLOCK_R with an online (running-max) softmax per channel;
when one block holds them all (CSA, m = 4), the softmax is formed as the reference forms it
(exp(s - max) / Σ, then Σ p·kv). Channels are one contiguous axis (vector loads); RoPE's
interleaved pairs come from a [w/2, 2] reshape and split of the normed row. fp32 throughout; RMS as
x · (1 / sqrt(mean(x²) + eps)); cos/sin are libdevice's (full range reduction; positions below 2^24
convert to fp32 exactly, as in the reference). The entry is rounded to its dtype before RoPE and
after, as the static op does; under the interpreter bf16 is rounded to nearest-even on the bits
(its own cast truncates). A group whose entry index j >= E is skipped (the static op would index
out of range). Grid fixed by the shapes, no host sync: capture-safe.

Reads and writes of the state in one launch (the race argument): row b's programs read state rows
of positions pos0 - r - (c-1)·m … pos0 - 1 (r = pos0 mod m; only past rows come from the state) and
write positions pos0 … pos0 + T - 1. Two such positions differ by 1 … (T - 1) + r + (c-1)·m
<= T + c·m - 2, so with R >= T + c·m - 1 they never share a row (p mod R); different rows b use
different slots (the scratch slot aside, whose contents are unspecified). The benchmark's caches
keep R = c·m + k rows for T = 1 + k, exactly the bound. When R is shorter, the wrapper launches
twice: the entries first, then the state rows.
"""
from __future__ import annotations

from types import SimpleNamespace

import torch
import triton
import triton.language as tl
from dsv4c.kernels._tl import pdl_launch, pdl_wait

_FLOATS = (torch.float32, torch.bfloat16, torch.float16)
MAX_W = 4096  # one entry row (w channels) in registers per program


@triton.jit
def _to_entry(x, ty: tl.constexpr, RNE_BF16: tl.constexpr):
    """fp32 x cast to the entries' dtype. The interpreter's bf16 cast truncates, so under it (RNE_BF16)
    the value is first rounded to nearest-even on the bits; the cast is then exact, as on the GPU."""
    if RNE_BF16:
        bits = x.to(tl.uint32, bitcast=True)
        x = (((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16).to(tl.float32, bitcast=True)
    return x.to(ty)


@triton.jit
def _v4_compress_kernel(kv_ptr, sc_ptr, slots_ptr, pos0_ptr, nreal_ptr, ape_ptr, nw_ptr, invf_ptr,
                        skv_ptr, ssc_ptr, ent_ptr, T, R, E, G, n_pg, kv_sb, kv_st, sc_sb, sc_st, eps,
                        M: tl.constexpr, C: tl.constexpr, W: tl.constexpr, HALF: tl.constexpr,
                        BLOCK_R: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_CW: tl.constexpr,
                        STATE_ITERS: tl.constexpr, DO_ENTRIES: tl.constexpr, DO_STATE: tl.constexpr,
                        RNE_BF16: tl.constexpr, bt_ptr=None, NB=1, RB: tl.constexpr = 1, PAGED: tl.constexpr = False,
                        PDL: tl.constexpr = False):
    pdl_wait(PDL)
    # kv/score [B, T, C·W] (strides kv_sb, kv_st / sc_sb, sc_st; channels contiguous); ape [M, C·W];
    # state [n_slots, R, C·W] and entries [n_slots, E, W] contiguous; slots/pos0/n_real [B] int64;
    # n_pg = grid dim 1 (G with entries, T for the state-only launch). PAGED: entries is a pool
    # [N + 1, RB, W], entry j of the slot at row j mod RB of block bt[slot, j // RB] (table [n_slots, NB];
    # RB a constexpr)
    b = tl.program_id(0)
    pg = tl.program_id(1)
    CW: tl.constexpr = C * W
    slot = tl.load(slots_ptr + b)
    pos0 = tl.load(pos0_ptr + b)
    n_real = tl.load(nreal_ptr + b)
    kv_row = kv_ptr + b.to(tl.int64) * kv_sb
    sc_row = sc_ptr + b.to(tl.int64) * sc_sb
    st_kv = skv_ptr + slot * R * CW
    st_sc = ssc_ptr + slot * R * CW
    if DO_ENTRIES:
        r = pos0 % M
        j = (pos0 - r) // M + pg  # the entry of this program's group
        if ((pg + 1) * M <= r + n_real) & (pg < G) & (j < E):  # the group closes (and has a row)
            ch = tl.arange(0, BLOCK_W)[None, :]  # [1, BLOCK_W]
            chm = ch < W
            first = (j - (C - 1)) * M  # position of virtual row 0 (CSA: the previous group)
            run_max = tl.full([BLOCK_W], float("-inf"), tl.float32)
            den = tl.zeros([BLOCK_W], tl.float32)
            acc = tl.zeros([BLOCK_W], tl.float32)
            for r0 in range(0, C * M, BLOCK_R):
                v = r0 + tl.arange(0, BLOCK_R)[:, None]  # [BLOCK_R, 1] virtual rows of the group
                p = first + v
                chan = (v // M) * W + ch  # CSA: rows [0, M) take channels [0, W), rows [M, 2M) [W, 2W)
                ok = (v < C * M) & chm
                past = ok & (p < pos0) & (p >= 0)
                new = ok & (p >= pos0)
                srow = tl.where(p >= 0, p, 0) % R
                t = p - pos0
                x = tl.load(st_kv + srow * CW + chan, mask=past, other=0.0)
                x += tl.load(kv_row + t * kv_st + chan, mask=new, other=0.0)
                s_old = tl.load(st_sc + srow * CW + chan, mask=past, other=float("-inf"))
                s_new = (tl.load(sc_row + t * sc_st + chan, mask=new, other=0.0)
                         + tl.load(ape_ptr + (p % M) * CW + chan, mask=new, other=0.0).to(tl.float32))
                s = tl.where(new, s_new, s_old)  # [BLOCK_R, BLOCK_W]
                blk_max = tl.max(s, axis=0)
                if C * M <= BLOCK_R:  # one block: the reference's softmax, then Σ p·kv
                    base = tl.where(blk_max == float("-inf"), 0.0, blk_max)
                    e = tl.exp(s - base[None, :])
                    prob = e / tl.where(chm, tl.sum(e, axis=0)[None, :], 1.0)
                    acc = tl.sum(prob * x, axis=0)
                    den = tl.full([BLOCK_W], 1.0, tl.float32)
                else:
                    new_max = tl.maximum(run_max, blk_max)
                    base = tl.where(new_max == float("-inf"), 0.0, new_max)
                    scale = tl.exp(run_max - base)
                    e = tl.exp(s - base[None, :])
                    den = den * scale + tl.sum(e, axis=0)
                    acc = acc * scale + tl.sum(e * x, axis=0)
                    run_max = new_max
            c1 = tl.arange(0, BLOCK_W)
            cm1 = c1 < W
            pooled = tl.where(cm1, acc / tl.where(cm1, den, 1.0), 0.0)  # [BLOCK_W]
            inv_rms = 1.0 / tl.sqrt_rn(tl.sum(pooled * pooled, axis=0) / W + eps)
            nw = tl.load(nw_ptr + c1, mask=cm1, other=0.0).to(tl.float32)
            ty = ent_ptr.dtype.element_ty
            y = _to_entry(nw * (pooled * inv_rms), ty, RNE_BF16).to(tl.float32)  # cast before RoPE, as the static op
            # RoPE of pairs i >= W/2 - HALF, (y[2i], y[2i+1]), at angle (j·M)·inv_freq[i - (W/2 - HALF)]
            ya, yb = tl.split(tl.reshape(y, [BLOCK_W // 2, 2]))  # [BLOCK_W/2] each
            i = tl.arange(0, BLOCK_W // 2)
            f = i - (W // 2 - HALF)
            rot = (f >= 0) & (i < W // 2)
            ang = (j * M).to(tl.float32) * tl.load(invf_ptr + f, mask=rot, other=0.0).to(tl.float32)
            cs = tl.cos(ang)
            sn = tl.sin(ang)
            out = tl.reshape(tl.join(tl.where(rot, ya * cs - yb * sn, ya), tl.where(rot, ya * sn + yb * cs, yb)),
                             [BLOCK_W])
            if PAGED:
                blk = tl.load(bt_ptr + slot * NB + j // RB).to(tl.int64)
                dst = ent_ptr + (blk * RB + j % RB) * W
            else:
                dst = ent_ptr + (slot * E + j) * W
            tl.store(dst + c1, _to_entry(out, ty, RNE_BF16), mask=cm1)
    if DO_STATE:
        cc = tl.arange(0, BLOCK_CW)
        ccm = cc < CW
        for q in range(STATE_ITERS):  # rows t = pg, pg + n_pg, …: the chunk's last min(n_real, R) real rows
            t = pg + q * n_pg
            tv = t + 0 * cc  # the row index as a [BLOCK_CW] tensor: a scalar bool & a tensor mask is not
            #                  a bool mask under some Triton interpreters (3.9 rejects it)
            keep = (tv < T) & (tv < n_real) & (tv >= n_real - R)
            p = pos0 + t
            x = tl.load(kv_row + t * kv_st + cc, mask=ccm & keep, other=0.0)
            s = (tl.load(sc_row + t * sc_st + cc, mask=ccm & keep, other=0.0)
                 + tl.load(ape_ptr + (p % M) * CW + cc, mask=ccm & keep, other=0.0).to(tl.float32))
            tl.store(st_kv + (p % R) * CW + cc, x, mask=ccm & keep)
            tl.store(st_sc + (p % R) * CW + cc, s, mask=ccm & keep)


def one_launch(R: int, T: int, c: int, m: int) -> bool:
    """Whether reading past rows and writing the chunk's rows in one launch is race-free (module doc)."""
    return R >= T + c * m - 1


def _fail(msg: str) -> None:
    raise ValueError(f"v4_compress_fused: {msg}")


def _check(kv, score, slots, pos0, n_real, ape, norm_weight, inv_freq, state_kv, state_score, entries, m,
           eps) -> SimpleNamespace:
    """Contracts of the op; returns the dimensions. Raises ValueError naming the tensor."""
    for name, t in (("kv", kv), ("score", score), ("state_kv", state_kv), ("state_score", state_score)):
        if t.dtype != torch.float32:
            _fail(f"{name} must be float32, got {t.dtype}")
    for name, t in (("slots", slots), ("pos0", pos0), ("n_real", n_real)):
        if t.dtype != torch.int64:
            _fail(f"{name} must be int64, got {t.dtype}")
    for name, t in (("ape", ape), ("norm_weight", norm_weight), ("inv_freq", inv_freq), ("entries", entries)):
        if t.dtype not in _FLOATS:
            _fail(f"{name} must be float32/bfloat16/float16, got {t.dtype}")
    if kv.dim() != 3 or score.shape != kv.shape:
        _fail(f"kv and score must both be [B, T, c·w], got kv {list(kv.shape)}, score {list(score.shape)}")
    if entries.dim() != 3:
        _fail(f"entries must be [n_slots, E, w], got {list(entries.shape)}")
    B, T, cw = kv.shape
    n_slots, E, w = entries.shape
    if w < 2 or w % 2 or w > MAX_W:
        _fail(f"entries width w = {w} must be even and in [2, {MAX_W}]")
    c = cw // w
    if cw != c * w or c not in (1, 2):
        _fail(f"kv width {cw} must be w or 2·w (w = {w}, entries' last dim)")
    if state_kv.dim() != 3 or state_kv.shape[0] != n_slots or state_kv.shape[2] != cw \
            or state_score.shape != state_kv.shape:
        _fail(f"state_kv and state_score must both be [n_slots={n_slots}, R, {cw}], got state_kv "
              f"{list(state_kv.shape)}, state_score {list(state_score.shape)}")
    R = state_kv.shape[1]
    if R < 1:
        _fail("state_kv must keep at least one row (R >= 1)")
    if not isinstance(m, int) or m < 1:
        _fail(f"m must be a positive int, got {m!r}")
    if not eps >= 0.0:
        _fail(f"eps must be >= 0, got {eps}")
    for name, t in (("slots", slots), ("pos0", pos0), ("n_real", n_real)):
        if t.shape != (B,):
            _fail(f"{name} must be [B={B}], got {list(t.shape)}")
    if ape.shape != (m, cw):
        _fail(f"ape must be [m={m}, {cw}], got {list(ape.shape)}")
    if norm_weight.shape != (w,):
        _fail(f"norm_weight must be [w={w}], got {list(norm_weight.shape)}")
    if inv_freq.dim() != 1 or not 1 <= inv_freq.shape[0] <= w // 2:
        _fail(f"inv_freq must be [r/2] with 1 <= r/2 <= w/2 = {w // 2}, got {list(inv_freq.shape)}")
    if kv.stride(2) != 1 or score.stride(2) != 1:
        _fail(f"kv and score need contiguous channels (stride 1), got strides {kv.stride()}, {score.stride()}")
    for name, t in (("slots", slots), ("pos0", pos0), ("n_real", n_real), ("ape", ape),
                    ("norm_weight", norm_weight), ("inv_freq", inv_freq), ("state_kv", state_kv),
                    ("state_score", state_score), ("entries", entries)):
        if not t.is_contiguous():
            _fail(f"{name} must be contiguous, got strides {t.stride()}")
        if t.device != kv.device:
            _fail(f"{name} is on {t.device}, kv on {kv.device}")
    if score.device != kv.device:
        _fail(f"score is on {score.device}, kv on {kv.device}")
    return SimpleNamespace(B=B, T=T, cw=cw, c=c, w=w, n_slots=n_slots, R=R, E=E, half=inv_freq.shape[0])


def _block_rows(rows: int, block_w: int) -> int:
    """Rows per block: all of a group when [rows, w] fits 4096 elements (CSA), else 4096 / w (HCA m = 128,
    w = 512: 8 rows; 126 registers at 8 warps on sm_90, 16 rows would take 218)."""
    return min(triton.next_power_of_2(rows), max(1, 4096 // block_w))


def _num_warps(block_w: int) -> int:
    return 8 if block_w >= 512 else (4 if block_w >= 128 else 1)


def v4_compress_fused(kv: torch.Tensor, score: torch.Tensor, slots: torch.Tensor, pos0: torch.Tensor,
                      n_real: torch.Tensor, ape: torch.Tensor, norm_weight: torch.Tensor, inv_freq: torch.Tensor,
                      state_kv: torch.Tensor, state_score: torch.Tensor, entries: torch.Tensor, m: int,
                      eps: float, *, block_rows: int | None = None, block_table: torch.Tensor | None = None) -> None:
    """The static op's function in one Triton launch (two when R < T + c·m - 1: entries, then state).
    Updates state_kv, state_score and entries in place; skips the scratch writes. `block_rows`
    (a power of two) overrides the rows per softmax block (tests). CPU tensors run under the Triton
    interpreter. With `block_table` [n_slots, NB] int64 (paged, `dsv4c::v4_compress_paged_static`):
    entries is a pool [N + 1, RB, w] written through the table, E = NB·RB."""
    paged = {}
    if block_table is not None:
        pool = entries
        if block_table.dtype != torch.int64 or block_table.dim() != 2 or block_table.shape[0] != state_kv.shape[0] \
                or not block_table.is_contiguous() or pool.dim() != 3 or not pool.is_contiguous():
            _fail(f"block_table must be contiguous int64 [n_slots={state_kv.shape[0]}, NB] and the pool contiguous "
                  f"[N + 1, RB, w], got {block_table.dtype} {list(block_table.shape)}, pool {list(pool.shape)}")
        entries = torch.empty((state_kv.shape[0], 0, pool.shape[2]), dtype=pool.dtype, device=pool.device)
        paged = dict(bt_ptr=block_table, NB=block_table.shape[1], RB=pool.shape[1], PAGED=True)
    d = _check(kv, score, slots, pos0, n_real, ape, norm_weight, inv_freq, state_kv, state_score, entries, m, eps)
    if paged:
        entries, d.E = pool, block_table.shape[1] * pool.shape[1]
    if d.B == 0 or d.T == 0:
        return
    G = (m - 1 + d.T) // m
    block_w = triton.next_power_of_2(d.w)
    br = block_rows or _block_rows(d.c * m, block_w)
    if br & (br - 1):
        _fail(f"block_rows must be a power of two, got {br}")
    args = (kv, score, slots, pos0, n_real, ape, norm_weight, inv_freq, state_kv, state_score, entries,
            d.T, d.R, d.E, G)
    strides = (kv.stride(0), kv.stride(1), score.stride(0), score.stride(1), float(eps))
    meta = {"M": m, "C": d.c, "W": d.w, "HALF": d.half, "BLOCK_R": br, "BLOCK_W": block_w,
                "BLOCK_CW": triton.next_power_of_2(d.cw), "num_warps": _num_warps(block_w),
                "RNE_BF16": kv.device.type == "cpu" and entries.dtype == torch.bfloat16, **paged}
    if one_launch(d.R, d.T, d.c, m):
        _v4_compress_kernel[(d.B, G)](*args, G, *strides, STATE_ITERS=triton.cdiv(d.T, G), DO_ENTRIES=True,
                                      DO_STATE=True, **meta, **pdl_launch(kv))
    else:
        _v4_compress_kernel[(d.B, G)](*args, G, *strides, STATE_ITERS=0, DO_ENTRIES=True, DO_STATE=False, **meta,
                                      **pdl_launch(kv))
        _v4_compress_kernel[(d.B, d.T)](*args, d.T, *strides, STATE_ITERS=1, DO_ENTRIES=False, DO_STATE=True,
                                        **meta, **pdl_launch(kv))


def v4_compress_fused_ref(kv: torch.Tensor, score: torch.Tensor, slots: torch.Tensor, pos0: torch.Tensor,
                          n_real: torch.Tensor, ape: torch.Tensor, norm_weight: torch.Tensor, inv_freq: torch.Tensor,
                          state_kv: torch.Tensor, state_score: torch.Tensor, entries: torch.Tensor, m: int,
                          eps: float) -> None:
    """The static op (dsv4c/model/static_ops.py `v4_compress_static`), unchanged: the specification.
    It also writes the scratch slot, which the fused kernel leaves alone."""
    from dsv4c.model.static_ops import v4_compress_static

    v4_compress_static(kv, score, slots, pos0, n_real, ape, norm_weight, inv_freq, state_kv, state_score, entries,
                       m, eps)


@torch.library.custom_op("dsv4c::v4_compress_fused", mutates_args=("state_kv", "state_score", "entries"))
def v4_compress_fused_op(kv: torch.Tensor, score: torch.Tensor, slots: torch.Tensor, pos0: torch.Tensor,
                         n_real: torch.Tensor, ape: torch.Tensor, norm_weight: torch.Tensor, inv_freq: torch.Tensor,
                         state_kv: torch.Tensor, state_score: torch.Tensor, entries: torch.Tensor, m: int,
                         eps: float) -> None:
    """`dsv4c::v4_compress_static` as one Triton launch on CUDA tensors; on CPU the static op itself."""
    if kv.device.type == "cpu":
        _check(kv, score, slots, pos0, n_real, ape, norm_weight, inv_freq, state_kv, state_score, entries, m, eps)
        v4_compress_fused_ref(kv, score, slots, pos0, n_real, ape, norm_weight, inv_freq, state_kv, state_score,
                              entries, m, eps)
        return
    v4_compress_fused(kv, score, slots, pos0, n_real, ape, norm_weight, inv_freq, state_kv, state_score, entries,
                      m, eps)


@v4_compress_fused_op.register_fake
def _v4_compress_fused_fake(kv, score, slots, pos0, n_real, ape, norm_weight, inv_freq, state_kv, state_score,
                            entries, m, eps):
    return None


# ------------------------------------------------------------------------------------------------
# paged entries (dsv4c.model.common.PagedLayout): the same kernel, entries written through the block table
# ------------------------------------------------------------------------------------------------
def v4_compress_paged_fused_ref(kv: torch.Tensor, score: torch.Tensor, slots: torch.Tensor, pos0: torch.Tensor,
                                n_real: torch.Tensor, ape: torch.Tensor, norm_weight: torch.Tensor,
                                inv_freq: torch.Tensor, state_kv: torch.Tensor, state_score: torch.Tensor,
                                pool: torch.Tensor, block_table: torch.Tensor, m: int, eps: float) -> None:
    """The paged static op (`v4_compress_paged_static`): the specification (it also writes scratch)."""
    from dsv4c.model.static_ops import v4_compress_paged_static

    v4_compress_paged_static(kv, score, slots, pos0, n_real, ape, norm_weight, inv_freq, state_kv, state_score, pool,
                             block_table, m, eps)


@torch.library.custom_op("dsv4c::v4_compress_paged_fused", mutates_args=("state_kv", "state_score", "pool"))
def v4_compress_paged_fused_op(kv: torch.Tensor, score: torch.Tensor, slots: torch.Tensor, pos0: torch.Tensor,
                               n_real: torch.Tensor, ape: torch.Tensor, norm_weight: torch.Tensor,
                               inv_freq: torch.Tensor, state_kv: torch.Tensor, state_score: torch.Tensor,
                               pool: torch.Tensor, block_table: torch.Tensor, m: int, eps: float) -> None:
    """`dsv4c::v4_compress_paged_static` as the Triton launch on CUDA tensors; on CPU the static op."""
    if kv.device.type == "cpu":
        v4_compress_paged_fused_ref(kv, score, slots, pos0, n_real, ape, norm_weight, inv_freq, state_kv, state_score,
                                    pool, block_table, m, eps)
        return
    v4_compress_fused(kv, score, slots, pos0, n_real, ape, norm_weight, inv_freq, state_kv, state_score, pool, m, eps,
                      block_table=block_table)


@v4_compress_paged_fused_op.register_fake
def _v4_compress_paged_fused_fake(kv, score, slots, pos0, n_real, ape, norm_weight, inv_freq, state_kv, state_score,
                                  pool, block_table, m, eps):
    return None
