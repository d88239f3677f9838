"""V4's MoE router scoring (`route_topk`, `route_hashed` of dsv4c/model/v4.py) as one Triton launch.

Public API::

    route_topk(logits, bias, k, scale) -> (idx, w)    # the Triton kernel, one launch
    route_topk_ref(logits, bias, k, scale)            # dsv4c.model.v4.route_topk, unchanged (the spec)
    route_hashed(logits, idx, scale) -> w             # hash layers: the expert ids are given
    route_hashed_ref(logits, idx, scale)              # dsv4c.model.v4.route_hashed
    route_hashed_ids(logits, ids, tid2eid, scale) -> (idx, w)   # the table lookup idx = tid2eid[ids] too
    route_hashed_ids_ref(logits, ids, tid2eid, scale)           # the lookup, then route_hashed_ref

Custom ops (targets of passes/fuse_router.py; CPU = the model's function)::

    dsv4c::route_topk(Tensor logits, Tensor bias, int k, float scale) -> (Tensor, Tensor)
    dsv4c::route_hashed(Tensor logits, Tensor idx, float scale) -> Tensor
    dsv4c::route_hashed_ids(Tensor logits, Tensor ids, Tensor tid2eid, float scale) -> (Tensor, Tensor)

Semantics, per token row (T tokens, E experts, K chosen; logits [T, E] fp32, bias [E] fp32):
    s   = sqrt(softplus(logits))            softplus as torch's (beta 1, threshold 20: x > 20 -> x)
    idx = top-K of s + bias, descending     (topk: the largest first; equal keys: the lowest index)
    w   = s[idx] / (sum_K s[idx] + 1e-20) * scale          idx int64 [T, K], w fp32 [T, K]
The hash variant takes idx [T, K] int64 and computes only w (it reads the K logits it needs); its `_ids`
form takes the token ids [T] and the table tid2eid [V, K] and writes idx = tid2eid[ids] as well (one
launch in the PDL chain instead of an ATen gather before it).
Eagerly that is ~9 ATen launches per layer; here one program holds one row of E <= MAX_E scores
in registers: K rounds of (max, lowest index of the max, mask it out). Grid = T, fixed by the
shape, no host sync: capture-safe.

Accuracy: softplus(x) is computed as max(x, 0) + log1p(exp(-|x|)) for x <= 20 (the same function;
this form never overflows), with exp and log1p written out below (Cody-Waite reduction + Taylor
polynomial; atanh series), each within a few ulp, because Triton's `tl.exp`/`tl.log` are the
approximate MUFU instructions on CUDA and libdevice's `exp`/`log1p` do not run under the Triton
interpreter (TRITON_INTERPRET=1). The square root and the division are IEEE round-to-nearest
(`tl.sqrt_rn`, `tl.div_rn`). So s agrees with the reference to a few ulp, and idx exactly unless two
keys of a row lie within a few ulp of each other (then the order of that near-tie may differ);
the sum of K weights is a tree sum (the reference's order may differ in the last bit).
NaN logits are not supported (torch.topk ranks NaN highest; here the index is clamped into
[0, E)). The hash kernel gives NaN weights for ids outside [0, E) instead of reading out of
bounds (the reference raises; a capture-safe op cannot check without a host sync); the `_ids` kernel
gives a token outside [0, V) expert 0 and NaN weights.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from dsv4c.kernels import _tl as U

MAX_E = 512  # one row of scores in registers (V4-Flash E = 256, Pro E = 384)
MAX_K = 32


@triton.jit
def _log1p_unit(t):
    """log(1 + t) for t in [0, 1], fp32, a few ulp: 2·atanh(z), z = t / (2 + t) <= 1/3."""
    z = tl.div_rn(t, 2.0 + t)
    z2 = z * z
    q = 1.0 / 15.0
    q = q * z2 + 1.0 / 13.0
    q = q * z2 + 1.0 / 11.0
    q = q * z2 + 1.0 / 9.0
    q = q * z2 + 1.0 / 7.0
    q = q * z2 + 1.0 / 5.0
    q = q * z2 + 1.0 / 3.0
    q = q * z2 + 1.0  # series to z^15: truncation < 2e-9 relative at z = 1/3
    return 2.0 * z * q


@triton.jit
def _sqrt_softplus(x):
    """sqrt(softplus(x)) with torch's softplus (beta 1, threshold 20)."""
    sp = tl.maximum(x, 0.0) + _log1p_unit(U.exp_f32(-tl.abs(x)))
    return tl.sqrt_rn(tl.where(x > 20.0, x, sp))


@triton.jit
def _route_topk_kernel(logits_ptr, bias_ptr, idx_ptr, w_ptr, E, scale,
                       K: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr = False):
    U.pdl_wait(PDL)
    # logits [T, E], bias [E], idx [T, K] int64, w [T, K] fp32; all contiguous; one row per program
    row = tl.program_id(0).to(tl.int64)
    lane = tl.arange(0, BLOCK_E)
    real = lane < E
    x = tl.load(logits_ptr + row * E + lane, mask=real, other=0.0)
    s = _sqrt_softplus(x)  # [BLOCK_E]
    key = tl.where(real, s + tl.load(bias_ptr + lane, mask=real, other=0.0), float("-inf"))
    kl = tl.arange(0, BLOCK_K)
    idx = tl.zeros([BLOCK_K], dtype=tl.int32)
    w = tl.zeros([BLOCK_K], dtype=tl.float32)
    for j in tl.static_range(K):
        top = tl.max(key, axis=0)
        i = tl.minimum(tl.min(tl.where(key == top, lane, BLOCK_E), axis=0), E - 1)  # lowest index of the max
        pick = lane == i
        idx = tl.where(kl == j, i, idx)
        w = tl.where(kl == j, tl.sum(tl.where(pick, s, 0.0), axis=0), w)
        key = tl.where(pick, float("-inf"), key)
    w = tl.div_rn(w, tl.sum(w, axis=0) + 1e-20) * scale
    out = kl < K
    tl.store(idx_ptr + row * K + kl, idx.to(tl.int64), mask=out)
    tl.store(w_ptr + row * K + kl, w, mask=out)


@triton.jit
def _hashed_weights(logits_ptr, w_ptr, row, i, E, scale, K: tl.constexpr, BLOCK_K: tl.constexpr):
    """Row `row`'s weights from its expert ids i [BLOCK_K] (an id outside [0, E) gives NaN weights)."""
    kl = tl.arange(0, BLOCK_K)
    out = kl < K
    ok = (i >= 0) & (i < E)
    x = tl.load(logits_ptr + row * E + i, mask=out & ok, other=0.0)
    s = tl.where(out, tl.where(ok, _sqrt_softplus(x), float("nan")), 0.0)
    w = tl.div_rn(s, tl.sum(s, axis=0) + 1e-20) * scale
    tl.store(w_ptr + row * K + kl, w, mask=out)


@triton.jit
def _route_hashed_kernel(logits_ptr, idx_ptr, w_ptr, E, scale, K: tl.constexpr, BLOCK_K: tl.constexpr,
                         PDL: tl.constexpr = False):
    U.pdl_wait(PDL)
    # logits [T, E], idx [T, K] int64 (given), w [T, K] fp32; one row per program
    row = tl.program_id(0).to(tl.int64)
    kl = tl.arange(0, BLOCK_K)
    i = tl.load(idx_ptr + row * K + kl, mask=kl < K, other=0)
    _hashed_weights(logits_ptr, w_ptr, row, i, E, scale, K, BLOCK_K)


@triton.jit
def _route_hashed_ids_kernel(logits_ptr, ids_ptr, ids_stride, table_ptr, idx_ptr, w_ptr, E, V, scale, K: tl.constexpr,
                             BLOCK_K: tl.constexpr, PDL: tl.constexpr = False):
    U.pdl_wait(PDL)  # ids may come from an earlier kernel of the step (a draft token)
    # logits [T, E], ids [T] int64 (any stride), table (tid2eid) [V, K] int64, idx [T, K] int64 out, w [T, K] fp32
    row = tl.program_id(0).to(tl.int64)
    kl = tl.arange(0, BLOCK_K)
    out = kl < K
    tok = tl.load(ids_ptr + row * ids_stride) + tl.zeros([BLOCK_K], dtype=tl.int64)  # [BLOCK_K], one value
    known = (tok >= 0) & (tok < V)
    i = tl.load(table_ptr + tok * K + kl, mask=out & known, other=-1)
    tl.store(idx_ptr + row * K + kl, tl.where(known, i, 0), mask=out)
    _hashed_weights(logits_ptr, w_ptr, row, i, E, scale, K, BLOCK_K)  # an unknown token: expert 0, NaN weights


# ---- host side -------------------------------------------------------------------------------
def _check_logits(fn: str, logits: torch.Tensor) -> tuple[int, int]:
    if logits.dtype != torch.float32:
        raise ValueError(f"{fn}: logits must be float32, got {logits.dtype}")
    if logits.dim() != 2:
        raise ValueError(f"{fn}: logits must be [T, E], got shape {list(logits.shape)}")
    if not logits.is_contiguous():
        raise ValueError(f"{fn}: logits must be contiguous, got strides {logits.stride()}")
    T, E = logits.shape
    if not 1 <= E <= MAX_E:
        raise ValueError(f"{fn}: logits has E = {E} experts; need 1 <= E <= MAX_E = {MAX_E}")
    return T, E


def _check_topk(logits: torch.Tensor, bias: torch.Tensor, k: int) -> tuple[int, int]:
    T, E = _check_logits("route_topk", logits)
    if bias.dtype != torch.float32 or bias.shape != (E,) or not bias.is_contiguous():
        raise ValueError(f"route_topk: bias must be a contiguous float32 [{E}] (logits' E), got "
                         f"{bias.dtype} {list(bias.shape)} strides {bias.stride()}")
    if bias.device != logits.device:
        raise ValueError(f"route_topk: bias is on {bias.device}, logits on {logits.device}")
    if not 1 <= k <= min(E, MAX_K):
        raise ValueError(f"route_topk: k = {k}; need 1 <= k <= min(E = {E}, MAX_K = {MAX_K})")
    return T, E


def _check_k(fn: str, what: str, K: int) -> int:
    if not 1 <= K <= MAX_K:
        raise ValueError(f"{fn}: {what} has K = {K} columns; need 1 <= K <= MAX_K = {MAX_K}")
    return K


def _check_hashed(logits: torch.Tensor, idx: torch.Tensor) -> tuple[int, int, int]:
    T, E = _check_logits("route_hashed", logits)
    if idx.dtype != torch.int64 or idx.dim() != 2 or idx.shape[0] != T or not idx.is_contiguous():
        raise ValueError(f"route_hashed: idx must be a contiguous int64 [{T}, K] (logits' T), got "
                         f"{idx.dtype} {list(idx.shape)} strides {idx.stride()}")
    if idx.device != logits.device:
        raise ValueError(f"route_hashed: idx is on {idx.device}, logits on {logits.device}")
    return T, E, _check_k("route_hashed", "idx", idx.shape[1])


def _check_hashed_ids(logits: torch.Tensor, ids: torch.Tensor, tid2eid: torch.Tensor) -> tuple[int, int, int]:
    T, E = _check_logits("route_hashed_ids", logits)
    if ids.dtype != torch.int64 or tuple(ids.shape) != (T,):
        raise ValueError(f"route_hashed_ids: ids must be an int64 [{T}] (logits' T), got {ids.dtype} {list(ids.shape)}")
    if tid2eid.dtype != torch.int64 or tid2eid.dim() != 2 or not tid2eid.is_contiguous():
        raise ValueError(f"route_hashed_ids: tid2eid must be a contiguous int64 [V, K], got "
                         f"{tid2eid.dtype} {list(tid2eid.shape)} strides {tid2eid.stride()}")
    for name, t in (("ids", ids), ("tid2eid", tid2eid)):
        if t.device != logits.device:
            raise ValueError(f"route_hashed_ids: {name} is on {t.device}, logits on {logits.device}")
    return T, E, _check_k("route_hashed_ids", "tid2eid", tid2eid.shape[1])


def route_topk(logits: torch.Tensor, bias: torch.Tensor, k: int, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] fp32, bias [E] fp32 -> (idx [T, k] int64, w [T, k] fp32), one launch. CPU tensors run
    under the Triton interpreter."""
    T, E = _check_topk(logits, bias, k)
    idx = torch.empty((T, k), dtype=torch.int64, device=logits.device)
    w = torch.empty((T, k), dtype=torch.float32, device=logits.device)
    if T:
        block = triton.next_power_of_2(E)
        _route_topk_kernel[(T,)](logits, bias, idx, w, E, float(scale), K=k, BLOCK_E=block,
                                 BLOCK_K=triton.next_power_of_2(k), num_warps=max(1, min(4, block // 128)),
                                 **U.pdl_launch(logits))
    return idx, w


def route_hashed(logits: torch.Tensor, idx: torch.Tensor, scale: float) -> torch.Tensor:
    """logits [T, E] fp32, expert ids idx [T, K] int64 -> w [T, K] fp32, one launch."""
    T, E, K = _check_hashed(logits, idx)
    w = torch.empty((T, K), dtype=torch.float32, device=logits.device)
    if T:
        _route_hashed_kernel[(T,)](logits, idx, w, E, float(scale), K=K, BLOCK_K=triton.next_power_of_2(K),
                                   num_warps=1, **U.pdl_launch(logits))
    return w


def route_hashed_ids(logits: torch.Tensor, ids: torch.Tensor, tid2eid: torch.Tensor,
                     scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] fp32, token ids [T] int64, the hash table tid2eid [V, K] int64 -> (idx = tid2eid[ids]
    [T, K] int64, w [T, K] fp32), one launch (the table lookup too)."""
    T, E, K = _check_hashed_ids(logits, ids, tid2eid)
    idx = torch.empty((T, K), dtype=torch.int64, device=logits.device)
    w = torch.empty((T, K), dtype=torch.float32, device=logits.device)
    if T:
        _route_hashed_ids_kernel[(T,)](logits, ids, ids.stride(0), tid2eid, idx, w, E, tid2eid.shape[0], float(scale),
                                       K=K, BLOCK_K=triton.next_power_of_2(K), num_warps=1, **U.pdl_launch(logits))
    return idx, w


def route_topk_ref(logits: torch.Tensor, bias: torch.Tensor, k: int, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """`dsv4c.model.v4.route_topk`, unchanged (the specification)."""
    from dsv4c.model.v4 import route_topk as model_route_topk

    return model_route_topk(logits, bias, k, scale)


def route_hashed_ref(logits: torch.Tensor, idx: torch.Tensor, scale: float) -> torch.Tensor:
    """`dsv4c.model.v4.route_hashed`, unchanged (the specification)."""
    from dsv4c.model.v4 import route_hashed as model_route_hashed

    return model_route_hashed(logits, idx, scale)


def route_hashed_ids_ref(logits: torch.Tensor, ids: torch.Tensor, tid2eid: torch.Tensor,
                         scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The hash layers' `Gate.forward` after the logits (dsv4c/model/v4.py): idx = tid2eid[ids], then
    `route_hashed`."""
    idx = tid2eid[ids]
    return idx, route_hashed_ref(logits, idx, scale)


@torch.library.custom_op("dsv4c::route_topk", mutates_args=(),
                         schema="(Tensor logits, Tensor bias, int k, float scale) -> (Tensor, Tensor)")
def route_topk_op(logits: torch.Tensor, bias: torch.Tensor, k: int, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """`route_topk` on CUDA tensors; on CPU the model's own function (bit-exact with the unfused graph)."""
    if logits.device.type == "cpu":
        _check_topk(logits, bias, k)
        return route_topk_ref(logits, bias, k, scale)
    return route_topk(logits, bias, k, scale)


@route_topk_op.register_fake
def _route_topk_fake(logits, bias, k, scale):
    T = logits.shape[0]
    return logits.new_empty((T, k), dtype=torch.int64), logits.new_empty((T, k), dtype=torch.float32)


@torch.library.custom_op("dsv4c::route_hashed", mutates_args=(),
                         schema="(Tensor logits, Tensor idx, float scale) -> Tensor")
def route_hashed_op(logits: torch.Tensor, idx: torch.Tensor, scale: float) -> torch.Tensor:
    """`route_hashed` on CUDA tensors; on CPU the model's own function."""
    if logits.device.type == "cpu":
        _check_hashed(logits, idx)
        return route_hashed_ref(logits, idx, scale)
    return route_hashed(logits, idx, scale)


@route_hashed_op.register_fake
def _route_hashed_fake(logits, idx, scale):
    return logits.new_empty(idx.shape, dtype=torch.float32)


@torch.library.custom_op("dsv4c::route_hashed_ids", mutates_args=(),
                         schema="(Tensor logits, Tensor ids, Tensor tid2eid, float scale) -> (Tensor, Tensor)")
def route_hashed_ids_op(logits: torch.Tensor, ids: torch.Tensor, tid2eid: torch.Tensor,
                        scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """`route_hashed_ids` on CUDA tensors; on CPU the model's own lookup and function."""
    if logits.device.type == "cpu":
        _check_hashed_ids(logits, ids, tid2eid)
        return route_hashed_ids_ref(logits, ids, tid2eid, scale)
    return route_hashed_ids(logits, ids, tid2eid, scale)


@route_hashed_ids_op.register_fake
def _route_hashed_ids_fake(logits, ids, tid2eid, scale):
    T, K = ids.shape[0], tid2eid.shape[1]
    return ids.new_empty((T, K)), logits.new_empty((T, K), dtype=torch.float32)
