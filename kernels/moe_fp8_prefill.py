"""FP8-block (W8A8) grouped routed-expert MoE for PREFILL (many rows per expert), as Triton kernels.

Public API::

    moe_fp8_prefill(x, idx, weight, experts, swiglu_limit, config=None) -> Tensor   # [T, D], bf16
    moe_fp8_prefill_ref(x, idx, weight, experts, swiglu_limit) -> Tensor            # [T, D], fp32
    Fp8PrefillConfig(block_m, num_warps, num_stages, group_m, gemm2_halves, tma, persistent)

Same function as `moe_grouped(x, idx, weight, Fp8BlockExperts, swiglu_limit)` (kernels/moe_grouped.py):
x and h quantised per token per 128 channels (e4m3, ue8m0 scales), weights e4m3 with fp32 scales
per 128x128 block, SwiGLU (+clamp) and the routing weight before w2. It reuses that module's
routing prep (`route_prep`: assignments sorted by expert, each expert padded to BLOCK_M) and the
activation quantiser; what differs is the GEMM kernel:

* every output tile is 128 columns wide per half (GEMM 1: the w1 half and the w3 half; GEMM 2:
  one or two 128-column halves), so a K step's weight block scale is ONE scalar per half and the
  per-step rescale is a single fp32 FMA per accumulator element: acc += dot * (a_s * w_s)[row];
* weights (and GEMM 2's contiguous A, the sorted h) are read through TMA tensor descriptors;
  GEMM 1's A rows are gathered (x[ids // K]) by pointer loads;
* tiles are ordered in groups of GROUP_M M-blocks (N tiles outer within a group), so an A
  block and an expert's weight tile are both re-read from L2, not HBM (optional persistent grid);
* GEMM 2 stores each row at its assignment's position (row ids[r] of y [N_A, D]), so the combine
  is one sum over the K slots with no gather copy.

Shapes: T tokens, D hidden, E experts, K experts per token, I expert width, N_A = T*K
assignments, R padded rows, NB M-blocks, NT N tiles.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from dsv4c.kernels import _tl as U
from dsv4c.kernels.act_quant import act_quant_fp8
from dsv4c.kernels.moe_grouped import Fp8BlockExperts, _check_inputs, moe_grouped_ref, route_prep

__all__ = ["Fp8PrefillConfig", "moe_fp8_prefill", "moe_fp8_prefill_ref"]

_BN = 128   # columns per half tile = the weight scale block


@triton.jit
def _tile_of(tile, NB, NT, GROUP_M: tl.constexpr):
    """Grouped ordering: GROUP_M consecutive M-blocks share each N tile before the next N tile."""
    per_group = GROUP_M * NT
    first_m = (tile // per_group) * GROUP_M
    size = tl.minimum(NB - first_m, GROUP_M)
    local = tile % per_group
    return first_m + local % size, local // size


@triton.jit
def _half_step(a, sa, w_desc, w_ptr, ws_base, wrow, erow, k0, stride_wn, stride_wsn, acc,
               TMA: tl.constexpr, ORDERED_FMA: tl.constexpr, INTERPRET: tl.constexpr, BLOCK_M: tl.constexpr, BN: tl.constexpr,
               BLOCK_K: tl.constexpr):
    """acc + (A_tile @ W[wrow:wrow+BN, k0:k0+BK]^T) * a_s * w_s, w_s the scalar scale of that block.
    wrow: row in the flattened [E*N_W, K] weight; erow: the same row within the expert."""
    if TMA:
        w = w_desc.load([wrow, k0])
    else:
        r = (wrow + tl.arange(0, BN)).to(tl.int64)
        kk = k0 + tl.arange(0, BLOCK_K)
        w = tl.load(w_ptr + r[:, None] * stride_wn + kk[None, :])
    ws = tl.load(ws_base + (erow // 128) * stride_wsn + k0 // 128)
    part = U.mma(a, w, tl.zeros((BLOCK_M, BN), dtype=tl.float32), INTERPRET)
    scale = tl.broadcast_to((sa * ws)[:, None], (BLOCK_M, BN))
    if INTERPRET or not ORDERED_FMA:
        return acc + part * scale
    else:
        # volatile asm keeps this FMA before the next half's wgmma: LLVM otherwise sinks it past that
        # dot, and two live dot results plus two accumulators spill at BLOCK_M 128
        return tl.inline_asm_elementwise("fma.rn.f32 $0, $1, $2, $3;", "=r,r,r,r", [part, scale, acc],
                                         dtype=tl.float32, is_pure=False, pack=1)


@triton.jit
def _tile(pid_m, pid_n, a_ptr, as_ptr, a_desc, w_desc, w_ptr, ws_ptr, ids_ptr, bexp_ptr, rw_ptr, out_ptr, outs_ptr,
          N, K: tl.constexpr, TOPK, N_ASSIGN, limit, N_W, stride_am, stride_asm, stride_wn, stride_wse, stride_wsn,
          stride_om, stride_osm, GATHER: tl.constexpr, SWIGLU: tl.constexpr, HAS_LIMIT: tl.constexpr,
          HALVES: tl.constexpr, TMA: tl.constexpr, ORDERED_FMA: tl.constexpr, INTERPRET: tl.constexpr,
          BLOCK_M: tl.constexpr, BN: tl.constexpr, BLOCK_K: tl.constexpr):
    """One [BLOCK_M, HALVES*BN] output tile (GEMM 1: HALVES = 2 are the w1 and w3 halves)."""
    e = tl.load(bexp_ptr + pid_m)
    if e >= 0:
        rows, ids, valid = U.block_rows(pid_m, ids_ptr, N_ASSIGN, BLOCK_M)
        arow = U.a_rows(ids, rows, valid, TOPK, GATHER)
        if SWIGLU:
            n0 = pid_n * BN
            n1 = N + n0
        else:
            n0 = pid_n * (HALVES * BN)
            n1 = n0 + BN
        ebase = e * N_W   # int32: the host checks E*N_W < 2^31 (TMA coordinates are 32-bit)
        ws_base = ws_ptr + e.to(tl.int64) * stride_wse
        acc0 = tl.zeros((BLOCK_M, BN), dtype=tl.float32)
        acc1 = tl.zeros((BLOCK_M, BN), dtype=tl.float32)
        kk = tl.arange(0, BLOCK_K)
        for k0 in range(0, K, BLOCK_K):
            if TMA and not GATHER:
                a = a_desc.load([pid_m * BLOCK_M, k0])
            else:
                a = tl.load(a_ptr + arow[:, None] * stride_am + (k0 + kk)[None, :], mask=valid[:, None], other=0.0)
            sa = tl.load(as_ptr + arow * stride_asm + k0 // BLOCK_K, mask=valid, other=0.0)
            acc0 = _half_step(a, sa, w_desc, w_ptr, ws_base, ebase + n0, n0, k0, stride_wn, stride_wsn, acc0,
                              TMA, ORDERED_FMA, INTERPRET, BLOCK_M, BN, BLOCK_K)
            if HALVES == 2:
                acc1 = _half_step(a, sa, w_desc, w_ptr, ws_base, ebase + n1, n1, k0, stride_wn, stride_wsn, acc1,
                                  TMA, ORDERED_FMA, INTERPRET, BLOCK_M, BN, BLOCK_K)
        cols = tl.arange(0, BN)
        if SWIGLU:
            rw = tl.load(rw_ptr + ids, mask=valid, other=0.0)
            h = U.swiglu(acc0, acc1, limit, HAS_LIMIT) * rw[:, None]
            q, s = U.quant_rows_e4m3(h)
            orow = rows.to(tl.int64)
            tl.store(out_ptr + orow[:, None] * stride_om + (n0 + cols)[None, :], q.to(tl.uint8), mask=valid[:, None])
            tl.store(outs_ptr + orow * stride_osm + pid_n, s, mask=valid)
        else:   # y row of the assignment (the combine then needs no gather)
            orow = tl.where(valid, ids, 0).to(tl.int64)
            optr = out_ptr + orow[:, None] * stride_om + (n0 + cols)[None, :]
            tl.store(optr, acc0.to(out_ptr.dtype.element_ty), mask=valid[:, None])
            if HALVES == 2:
                tl.store(optr + BN, acc1.to(out_ptr.dtype.element_ty), mask=valid[:, None])


@triton.jit(do_not_specialize=["TOPK", "N_ASSIGN"])
def _fp8_prefill_kernel(
        a_ptr, as_ptr, a_desc, w_desc, w_ptr, ws_ptr, ids_ptr, bexp_ptr, rw_ptr, out_ptr, outs_ptr,
        N, K: tl.constexpr, TOPK, N_ASSIGN, limit, NB, NT, N_W,
        stride_am, stride_asm, stride_wn, stride_wse, stride_wsn, stride_om, stride_osm,
        GATHER: tl.constexpr, SWIGLU: tl.constexpr, HAS_LIMIT: tl.constexpr, HALVES: tl.constexpr,
        TMA: tl.constexpr, ORDERED_FMA: tl.constexpr, PERSISTENT: tl.constexpr, INTERPRET: tl.constexpr, GROUP_M: tl.constexpr,
        BLOCK_M: tl.constexpr, BN: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr = False):
    """Tiles of one GEMM over the sorted, padded rows. GEMM 1 (GATHER, SWIGLU): A = x rows
    ids // TOPK, halves w1 rows n and w3 rows N + n, epilogue SwiGLU (+clamp) * routing weight ->
    e4m3 h + ue8m0 scale per row (one 128-column block per tile). GEMM 2: A = h's own rows, out
    = bf16 y row ids[r]. N_W: weight rows per expert (2I or D)."""
    U.pdl_wait(PDL)
    if PERSISTENT:
        tile = tl.program_id(0)
        while tile < NB * NT:
            pid_m, pid_n = _tile_of(tile, NB, NT, GROUP_M)
            _tile(pid_m, pid_n, a_ptr, as_ptr, a_desc, w_desc, w_ptr, ws_ptr, ids_ptr, bexp_ptr, rw_ptr, out_ptr,
                  outs_ptr, N, K, TOPK, N_ASSIGN, limit, N_W, stride_am, stride_asm, stride_wn, stride_wse,
                  stride_wsn, stride_om, stride_osm, GATHER, SWIGLU, HAS_LIMIT, HALVES, TMA, ORDERED_FMA, INTERPRET,
                  BLOCK_M, BN, BLOCK_K)
            tile += tl.num_programs(0)
    else:
        pid_m, pid_n = _tile_of(tl.program_id(0), NB, NT, GROUP_M)
        _tile(pid_m, pid_n, a_ptr, as_ptr, a_desc, w_desc, w_ptr, ws_ptr, ids_ptr, bexp_ptr, rw_ptr, out_ptr,
              outs_ptr, N, K, TOPK, N_ASSIGN, limit, N_W, stride_am, stride_asm, stride_wn, stride_wse, stride_wsn,
              stride_om, stride_osm, GATHER, SWIGLU, HAS_LIMIT, HALVES, TMA, ORDERED_FMA, INTERPRET, BLOCK_M, BN, BLOCK_K)


# ---------------------------------------------------------------------------------------------
# host side


@dataclass(frozen=True)
class Fp8PrefillConfig:
    """Launch parameters. block_m: M-block rows (also the routing's padding); group_m: M-blocks
    per tile group; gemm2_halves: GEMM 2 tile width 128 * halves (1 when D is not a multiple of
    256; GEMM 1 is always a w1 and a w3 half of 128); tma: weights and GEMM 2's A through TMA descriptors (pointer loads otherwise);
    persistent: num_sms programs (0 = the device's SM count) looping over the tiles;
    ordered_fma: each half's rescale FMA as volatile asm, pinned before the next half's dot."""

    block_m: int = 128
    num_warps: int = 8
    num_stages: int = 3
    group_m: int = 4
    gemm2_halves: int = 2
    tma: bool = True
    persistent: bool = True
    num_sms: int = 0
    ordered_fma: bool = True


def _check_config(cfg: Fp8PrefillConfig) -> None:
    if not (cfg.block_m >= 16 and cfg.block_m & (cfg.block_m - 1) == 0):
        raise ValueError(f"config.block_m: power of two >= 16, got {cfg.block_m}")
    if cfg.num_warps not in (4, 8):
        raise ValueError(f"config.num_warps: 4 or 8, got {cfg.num_warps}")
    if cfg.num_stages < 1:
        raise ValueError(f"config.num_stages: >= 1, got {cfg.num_stages}")
    if cfg.group_m < 1:
        raise ValueError(f"config.group_m: >= 1, got {cfg.group_m}")
    if cfg.gemm2_halves not in (1, 2):
        raise ValueError(f"config.gemm2_halves: 1 or 2, got {cfg.gemm2_halves}")


def _gemm(a, a_s, w, w_s, routing, rw, out, out_s, n: int, k: int, topk: int, limit: float, gemm1: bool,
          gather: bool, cfg: Fp8PrefillConfig, interpret: bool) -> None:
    """Launch one GEMM. w e4m3 [E, N_W, K] with scale fp32 [E, N_W/128, K/128]; n output columns."""
    e, n_w, _ = w.shape
    if e * n_w >= 2 ** 31:
        raise ValueError(f"{'w13' if gemm1 else 'w2'}: E*N = {e * n_w} weight rows, must be < 2^31 (32-bit TMA rows)")
    halves = 2 if gemm1 or (cfg.gemm2_halves == 2 and n % (2 * _BN) == 0) else 1   # D = 128 * odd: one half
    nt = n // _BN if gemm1 else n // (_BN * halves)
    nb = routing.block_expert.numel()
    w2d = w.view(e * n_w, k)
    w_desc = a_desc = None
    if cfg.tma:
        w_desc = TensorDescriptor.from_tensor(w2d, [_BN, 128])
        if not gather:
            a_desc = TensorDescriptor.from_tensor(a, [cfg.block_m, 128])
    n_tiles = nb * nt
    if cfg.persistent:
        sms = cfg.num_sms or (torch.cuda.get_device_properties(a.device).multi_processor_count
                              if a.device.type == "cuda" else 4)
        grid = (min(n_tiles, sms),)
    else:
        grid = (n_tiles,)
    _fp8_prefill_kernel[grid](
        a, a_s, a_desc, w_desc, w2d, w_s, routing.ids, routing.block_expert, rw, out, out_s,
        n, k, topk, routing.n_assign, float(limit), nb, nt, n_w,
        a.stride(0), a_s.stride(0), w2d.stride(0), w_s.stride(0), w_s.stride(1), out.stride(0), out_s.stride(0),
        GATHER=gather, SWIGLU=gemm1, HAS_LIMIT=gemm1 and limit > 0, HALVES=halves, TMA=cfg.tma, ORDERED_FMA=cfg.ordered_fma,
        PERSISTENT=cfg.persistent, INTERPRET=interpret, GROUP_M=cfg.group_m, BLOCK_M=cfg.block_m, BN=_BN,
        BLOCK_K=128, num_warps=cfg.num_warps, num_stages=cfg.num_stages, **U.pdl_launch(a))


def moe_fp8_prefill(x: torch.Tensor, idx: torch.Tensor, weight: torch.Tensor, experts: Fp8BlockExperts,
                    swiglu_limit: float, config: Fp8PrefillConfig | None = None) -> torch.Tensor:
    """FP8-block routed experts for prefill: x bf16 [T, D]; idx int32/int64 [T, K] in [0, E);
    weight fp32 [T, K]; experts Fp8BlockExperts (D, I multiples of 128); swiglu_limit L (<= 0:
    no clamp) -> bf16 [T, D]. Same function as moe_grouped with Fp8BlockExperts.

    CUDA-graph capture safe (device routing prep, grids from shapes only, descriptors built on
    the host from shapes and pointers); compile once eagerly before capture. On CPU tensors the
    kernels run under the Triton interpreter (TRITON_INTERPRET=1 before they first launch)."""
    _check_inputs(x, idx, weight, experts, swiglu_limit)
    if not isinstance(experts, Fp8BlockExperts):
        raise ValueError(f"experts: expected Fp8BlockExperts, got {type(experts).__name__}")
    cfg = config or Fp8PrefillConfig()
    _check_config(cfg)
    e, i, d = experts.dims
    t, topk = idx.shape
    out = torch.empty_like(x)
    if t == 0:
        return out
    interpret = U.interpret_flag(x)
    routing = route_prep(idx, e, cfg.block_m)
    rows = routing.rows
    dev = x.device
    wflat = weight.reshape(-1).contiguous()                                          # [N_A]
    xq, xs = act_quant_fp8(x)                                                        # [T, D], [T, D/128]
    h = torch.empty(rows, i, dtype=torch.uint8, device=dev)                          # e4m3 bytes
    hs = torch.empty(rows, i // 128, dtype=torch.float32, device=dev)
    _gemm(xq, xs, experts.w13, experts.w13_scale, routing, wflat, h, hs, i, d, topk, swiglu_limit, True, True,
          cfg, interpret)
    y = torch.empty(routing.n_assign, d, dtype=torch.bfloat16, device=dev)           # [N_A, D], assignment order
    _gemm(h.view(torch.float8_e4m3fn), hs, experts.w2, experts.w2_scale, routing, wflat, y, hs, d, i, topk, 0.0,
          False, False, cfg, interpret)
    torch.sum(y.view(t, topk, d), 1, out=out)   # accumulates in fp32, one rounding to bf16
    return out


def moe_fp8_prefill_ref(x: torch.Tensor, idx: torch.Tensor, weight: torch.Tensor, experts: Fp8BlockExperts,
                        swiglu_limit: float) -> torch.Tensor:
    """fp32 reference [T, D]: dequantised weights, x and h quantised per 128 (ue8m0), routing
    weight before w2 (the same function as moe_grouped_ref for Fp8BlockExperts)."""
    if not isinstance(experts, Fp8BlockExperts):
        raise ValueError(f"experts: expected Fp8BlockExperts, got {type(experts).__name__}")
    return moe_grouped_ref(x, idx, weight, experts, swiglu_limit)
