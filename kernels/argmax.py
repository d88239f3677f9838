"""Greedy decoding's argmax over the vocabulary, split across the GPU.

`torch.argmax(logits, -1)` reduces each row in one thread block: at batch 1 and the Flash vocabulary
(129280 fp32 logits, 517 KB) that one block is a 27 µs kernel on an H100, for bytes that the whole
GPU reads in under a microsecond (examples/profile_step.py, BENCHMARKS.md 2026-12-05). Here a row is
cut into chunks of BLOCK columns:

  launch 1, grid [B, S]: program (b, s) reduces chunk s of row b to (value, index) -> part [B, S]
  launch 2, grid [B]:    program b reduces row b's S partials, in chunk order -> out [B] int64

Semantics are torch.argmax's: the index of the first maximal value; NaN is larger than any number
(the first NaN wins); -0.0 equals +0.0. Per chunk the winner is the smallest index holding the
chunk's maximum (or its first NaN); chunks hold increasing indices, so the smallest index among the
partials that hold the row's maximum is the row's first. Comparisons only, no arithmetic: the
result is exact and does not depend on the launch's shape.

Public API::

    argmax_rows(x) -> Tensor       # x [B, V] fp32 / bf16 / fp16 -> [B] int64, two launches
    argmax_rows_ref(x) -> Tensor   # torch.argmax(x, -1) (the specification)

Legend: B rows, V columns (vocabulary), S = ceil(V / BLOCK) chunks per row, SP = next power of 2 of S.
No host sync; grids from shapes only (CUDA-graph safe). CPU tensors run under the Triton interpreter.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from dsv4c.kernels._tl import pdl_launch, pdl_wait

__all__ = ["argmax_rows", "argmax_rows_ref", "BLOCK", "MAX_CHUNKS", "SPLIT_MIN_COLUMNS"]

BLOCK = 2048        # columns per program of launch 1 (8 KB of fp32 logits; 64 programs a row at V = 129280)
MAX_CHUNKS = 8192   # partials a launch-2 program holds in registers: V up to 16.7M
# Rows shorter than this stay with torch.argmax (runtime/sampling.greedy_rows): one block reads them in a few
# microseconds (the bundled model's 4096 columns: 16 KB), and one ATen launch costs the host less than two Triton ones
SPLIT_MIN_COLUMNS = 16 * BLOCK
_NO_INDEX = 2 ** 31 - 1


@triton.jit
def _first_max(v, i, ok):
    """(value, index) of the first maximum of v over the lanes where ok (NaN above every number).
    v fp32 [L], i int32 [L] (increasing where ok), ok [L]; at least one lane ok."""
    big = tl.full(i.shape, 2 ** 31 - 1, tl.int32)
    nan = (v != v) & ok
    nan_i = tl.min(tl.where(nan, i, big), axis=0)
    mx = tl.max(tl.where(ok & (v == v), v, float("-inf")), axis=0)
    max_i = tl.min(tl.where(ok & (v == mx), i, big), axis=0)
    has_nan = nan_i < 2 ** 31 - 1
    return tl.where(has_nan, float("nan"), mx), tl.where(has_nan, nan_i, max_i)


@triton.jit
def _argmax_part_kernel(x_ptr, pv_ptr, pi_ptr, V, S, stride_x, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    pdl_wait(PDL)
    b, s = tl.program_id(0), tl.program_id(1)
    cols = s * BLOCK + tl.arange(0, BLOCK)                                         # [BLOCK]
    ok = cols < V
    v = tl.load(x_ptr + b.to(tl.int64) * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    val, idx = _first_max(v, cols, ok)
    tl.store(pv_ptr + b * S + s, val)
    tl.store(pi_ptr + b * S + s, idx)


@triton.jit
def _argmax_final_kernel(pv_ptr, pi_ptr, out_ptr, S, SP: tl.constexpr, PDL: tl.constexpr = False):
    pdl_wait(PDL)
    b = tl.program_id(0)
    s = tl.arange(0, SP)                                                          # [SP]
    ok = s < S
    v = tl.load(pv_ptr + b * S + s, mask=ok, other=0.0)
    i = tl.load(pi_ptr + b * S + s, mask=ok, other=0)
    _, idx = _first_max(v, i, ok)
    tl.store(out_ptr + b, idx.to(tl.int64))


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """out [B] int64: torch.argmax(x, -1) for x [B, V] fp32 / bf16 / fp16 with unit stride along V."""
    if x.dim() != 2 or x.dtype not in (torch.float32, torch.bfloat16, torch.float16) or x.stride(1) != 1:
        raise ValueError(f"argmax_rows: x must be fp32/bf16/fp16 [B, V] with unit stride along V, got {x.dtype} "
                         f"shape {tuple(x.shape)} strides {x.stride() if x.dim() else ()}")
    B, V = x.shape
    if V == 0:
        raise ValueError("argmax_rows: V = 0 (no column to choose)")
    if V >= _NO_INDEX:
        raise ValueError(f"argmax_rows: V = {V} columns, the int32 indices take fewer than {_NO_INDEX}")
    S = triton.cdiv(V, BLOCK)
    if S > MAX_CHUNKS:
        raise ValueError(f"argmax_rows: V = {V} needs {S} chunks of {BLOCK}, more than MAX_CHUNKS = {MAX_CHUNKS}")
    out = torch.empty(B, dtype=torch.int64, device=x.device)
    if B == 0:
        return out
    pv = torch.empty(B, S, dtype=torch.float32, device=x.device)
    pi = torch.empty(B, S, dtype=torch.int32, device=x.device)
    _argmax_part_kernel[(B, S)](x, pv, pi, V, S, x.stride(0), BLOCK=BLOCK, num_warps=4, **pdl_launch(x))
    _argmax_final_kernel[(B,)](pv, pi, out, S, SP=triton.next_power_of_2(S), num_warps=1 if S <= 256 else 4,
                               **pdl_launch(x))
    return out


def argmax_rows_ref(x: torch.Tensor) -> torch.Tensor:
    """The specification: torch.argmax over the last dim."""
    return x.argmax(-1)
