"""Differentiable full-sequence forward of `DeepseekV4Model`, for teacher-forced training.

`DeepseekV4Model.forward` runs through custom ops (`dsv4c::v4_compress`, `dsv4c::v4_attention`,
`dsv4c::moe_experts`) that update static caches in place and have no autograd. This module computes
the same function for a whole sequence starting at position 0, with no cache, in plain differentiable
ATen, on the model's own parameters (nothing is copied and nothing new is registered):

* compressor: every closed group of m tokens is pooled at once (CSA: 2m slots, the first half of the
  previous group's channels and the second half of its own; HCA: m slots), normed, RoPE at the group
  start w·m; entry w is visible to query t iff (w+1)·m <= t+1 (deepseek_v4.md §4.1(d));
* attention: one masked softmax over [window keys ; compressed entries] with exp(sink_h) in the
  denominator only, then inverse RoPE and the grouped low-rank output (§4.1(f), (g));
* CSA indexer: its compressor plus the top-k over visible entries (§4.1(e)), through `Indexer.forward`
  (its `dsv4c::v4_indexer_topk` is a pure, batched op, so the selection is the reference's own). The
  selection is a set of integer indices, so nothing differentiable flows through it: the indexer runs
  under `no_grad` and its parameters (`attn.indexer.*`) get no gradient from the LM loss. (DeepSeek
  trains the indexer with a separate objective, a KL term against the main attention; not done here.);
* MoE: routing by `Gate` (hash layers through the `tid2eid` buffer, the others by top-K(s + bias)),
  routed experts as a grouped loop (gather the rows of each expert, run its clamped SwiGLU, `index_add`
  the weighted result), plus the shared expert. `gate.bias` only influences which experts are chosen,
  so it gets no gradient either (DeepSeek adjusts it with the auxiliary-loss-free balancing rule);
* mHC and the head reuse `HyperConnection.pre/post` and `DeepseekV4Model._logits` (hc_head_collapse).

`train_forward(model, ids)` equals `model.forward_with_streams(ids)` and `train_mtp_forward(model,
streams, next_ids)` equals `model.mtp_forward(streams, next_ids, model.new_mtp_cache(B, max_len=T))`,
up to fp32 rounding (tests/test_v4_train.py).

Parameters without a gradient from `lm_losses` (None after backward): per CSA layer `attn.indexer.wq_b`,
`attn.indexer.weights_proj`, `attn.indexer.compressor.{ape, wkv, wgate, norm}`, and every non-hash
router's `ffn.gate.bias` (MTP block included). `tid2eid` is a buffer. Everything else gets one.

Usage (teacher forcing, ids [B, T]; the MTP block predicts token t+2 from the streams at t and the
token t+1):

    logits, streams = train_forward(model, ids)
    main = F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
    mtp_logits, _ = train_mtp_forward(model, streams[:, :-1], ids[:, 1:])
    mtp = F.cross_entropy(mtp_logits[:, :-1].flatten(0, 1), ids[:, 2:].flatten())  # last row has no target
    loss = main + mtp_weight * mtp

`lm_losses(model, ids)` returns (main, mtp) exactly like this. The MTP loss is not detached from the
streams, so it also trains the main model, as in DeepSeek's MTP training.

Mixed precision: keep the parameters in fp32 and run under `torch.autocast("cuda", torch.bfloat16)`.
Autocast's policy then runs every matmul/einsum in bf16 (the head too, so the logits come back bf16;
`F.cross_entropy` upcasts) and the softmaxes, norms and Sinkhorn in fp32; the streams stay fp32.
The attention materialises its [B, T, H, S] probabilities (S = T + n_e), which is fine for training
lengths of a few thousand tokens. The routed-expert loop syncs with the host once per layer (the
per-expert row counts): fine in eager mode; `torch.compile` sees a graph break there.

Legend: B batch, T tokens, S keys (T window positions + n_e entries), D hidden, H heads, d head dim,
r rope dim, N hc streams, V vocab, m compress ratio, c overlap factor (2 for CSA, 1 for HCA),
w compressor width, n_e compressed entries (⌊T/m⌋), M = B·T routed rows, K experts per token,
E routed experts, I expert width.
"""
from __future__ import annotations


import torch
import torch.nn.functional as F

from dsv4c.model.common import RotaryTable, rms, rope_interleaved, selection_mask, swiglu
from dsv4c.model.v4 import Attention, Block, Compressor, DeepseekV4Model, Experts, MoE, _linear_f32
from dsv4c.model.v4_ops import sink_attention, visible_count

__all__ = ["train_forward", "train_mtp_forward", "lm_losses", "NO_GRAD_REASONS", "params_without_grad"]


# ------------------------------------------------------------------------------------------------
# model
# ------------------------------------------------------------------------------------------------
def train_forward(model: DeepseekV4Model, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """input_ids [B, T] at positions 0..T-1 -> (logits [B, T, V] fp32 (bf16 under autocast), last-layer
    streams [B, T, N, D]). Differentiable; equals `model.forward_with_streams(input_ids)` with a fresh cache."""
    B, T = input_ids.shape
    X = model.embed(input_ids)[:, :, None, :].expand(B, T, model.config.hc_mult, -1).contiguous()  # [B,T,N,D]
    for block in model.layers:
        X = block_forward(block, X, input_ids)
    return model._logits(X, model.hc_head_fn, model.hc_head_base, model.hc_head_scale, model.norm), X


def train_mtp_forward(model: DeepseekV4Model, streams: torch.Tensor,
                      next_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """MTP block (§6) over a whole sequence: streams [B, T, N, D] (main streams at positions 0..T-1),
    next_ids [B, T] (the token at t+1) -> (logits [B, T, V] fp32 predicting t+2, MTP streams Z [B, T, N, D]).
    Equals `model.mtp_forward(streams, next_ids, model.new_mtp_cache(B, max_len=T))`."""
    blk = model.mtp[0]
    e = blk.enorm(model.embed(next_ids))  # [B, T, D]
    Y = blk.e_proj(e)[:, :, None, :] + blk.h_proj(blk.hnorm(streams))  # [B, T, N, D]
    Z = block_forward(blk, Y.to(streams.dtype), next_ids)
    return model._logits(Z, blk.hc_head_fn, blk.hc_head_base, blk.hc_head_scale, blk.norm), Z


def lm_losses(model: DeepseekV4Model, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(next-token CE, MTP CE) of a teacher-forced batch input_ids [B, T] (T >= 3), means over targets."""
    logits, streams = train_forward(model, input_ids)
    V = logits.shape[-1]
    main = F.cross_entropy(logits[:, :-1].reshape(-1, V), input_ids[:, 1:].reshape(-1))
    mtp_logits, _ = train_mtp_forward(model, streams[:, :-1], input_ids[:, 1:])
    mtp = F.cross_entropy(mtp_logits[:, :-1].reshape(-1, V), input_ids[:, 2:].reshape(-1))
    return main, mtp


def block_forward(block: Block, X: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """`Block.forward` without a cache: hc_attn(attention), then hc_ffn(moe). X [B, T, N, D], ids [B, T]."""
    hc = block.hc
    u, post, comb = hc.pre(X, block.hc_attn_fn, block.hc_attn_base, block.hc_attn_scale)
    X = hc.post(attention_forward(block.attn, block.attn_norm(u)), X, post, comb)
    u, post, comb = hc.pre(X, block.hc_ffn_fn, block.hc_ffn_base, block.hc_ffn_scale)
    return hc.post(moe_forward(block.ffn, block.ffn_norm(u), ids), X, post, comb)


# ------------------------------------------------------------------------------------------------
# attention
# ------------------------------------------------------------------------------------------------
def attention_forward(attn: Attention, x: torch.Tensor) -> torch.Tensor:
    """`Attention.forward` over a whole sequence from position 0. x [B, T, D] (normed) -> [B, T, D]."""
    B, T, _ = x.shape
    H, d = attn.n_heads, attn.head_dim
    cos, sin = attn.rope(torch.arange(T, device=x.device)[None])  # [1, T, r/2]
    qr = attn.q_norm(attn.wq_a(x))  # [B, T, Q], also the indexer's input
    q = rms(attn.wq_b(qr).unflatten(-1, (H, d)), attn.eps).to(x.dtype)  # [B, T, H, d]
    q = rope_interleaved(q, cos[:, :, None], sin[:, :, None])
    kv = rope_interleaved(attn.kv_norm(attn.wkv(x)), cos, sin)  # [B, T, d], key = value

    keys, mask = kv, window_mask(T, attn.window, x.device)[None]  # [B, T, d], [1, T, T]
    if attn.m:
        entries = compress(attn.compressor, x, attn.rope)  # [B, n_e, d]
        if attn.m == 4:
            vis = indexer_select(attn, x, qr, cos, sin)  # [B, T, n_e]
        else:
            vis = entry_visibility(T, entries.shape[1], attn.m, x.device)[None]  # [1, T, n_e]
        keys = torch.cat([kv, entries], 1)  # [B, S, d]
        mask = torch.cat([mask.expand(vis.shape[0], -1, -1), vis], -1)  # [B|1, T, S]
    o = sink_attention(q.float(), keys.float(), mask, attn.attn_sink)  # [B, T, H, d] fp32
    o = rope_interleaved(o, cos[:, :, None], sin[:, :, None], inverse=True).to(x.dtype)
    return attn._output(o)


def window_mask(T: int, window: int, device) -> torch.Tensor:
    """[T, T] bool: key s is in the window of query t iff t-W < s <= t."""
    rel = torch.arange(T, device=device)[:, None] - torch.arange(T, device=device)[None, :]
    return (rel >= 0) & (rel < window)


def entry_visibility(T: int, n_e: int, m: int, device) -> torch.Tensor:
    """[T, n_e] bool: entry w is visible to query t iff (w+1)·m <= t+1."""
    n_vis = visible_count(torch.arange(T, device=device), m)  # [T]
    return torch.arange(n_e, device=device)[None, :] < n_vis[:, None]


# ------------------------------------------------------------------------------------------------
# compressor and indexer
# ------------------------------------------------------------------------------------------------
def compress(comp: Compressor, x: torch.Tensor, rope: RotaryTable) -> torch.Tensor:
    """Entries of every closed group of x [B, T, D] -> [B, n_e, w] (x.dtype): pooled per channel with a
    softmax over the group's slots (scores + ape), then RMSNorm, then RoPE at the group start w·m.
    The rows of a trailing, still open group produce nothing."""
    B, T, _ = x.shape
    m, c, w = comp.m, comp.c, comp.width
    n = T // m
    if n == 0:
        return x.new_zeros(B, 0, w)
    xs = x[:, : n * m]
    kv = _linear_f32(xs, comp.wkv.weight).unflatten(1, (n, m))  # [B, n, m, c·w]
    score = _linear_f32(xs, comp.wgate.weight).unflatten(1, (n, m)) + comp.ape.float()  # ape[s mod m]
    if c == 2:  # CSA: slots [prev group's first half ; own group's second half]; group -1 is (0, -inf)
        prev_kv = F.pad(kv[:, :-1, :, :w], (0, 0, 0, 0, 1, 0))
        prev_sc = F.pad(score[:, :-1, :, :w], (0, 0, 0, 0, 1, 0), value=float("-inf"))
        kv = torch.cat([prev_kv, kv[..., w:]], 2)  # [B, n, 2m, w]
        score = torch.cat([prev_sc, score[..., w:]], 2)
    pooled = (score.softmax(2) * kv).sum(2)  # [B, n, w] fp32
    e = comp.norm(pooled).to(x.dtype)
    cos, sin = rope(torch.arange(n, device=x.device) * m)  # [n, r/2]
    return rope_interleaved(e, cos, sin)


@torch.no_grad()
def indexer_select(attn: Attention, x: torch.Tensor, qr: torch.Tensor, cos: torch.Tensor,
                   sin: torch.Tensor) -> torch.Tensor:
    """CSA selection (§4.1(e)) as a mask [B, T, n_e] bool: the top-min(k, visible) visible entries.
    x [B, T, D], qr [B, T, Q], cos/sin [1, T, r/2]. No gradient: the result is an index set."""
    B, T, _ = x.shape
    idx = attn.indexer
    keys = compress(idx.compressor, x, attn.rope)  # [B, n_e, dI]
    n_e = keys.shape[1]
    meta = (torch.arange(B, device=x.device), torch.zeros(B, dtype=torch.int64, device=x.device),
            torch.full((B,), T, dtype=torch.int64, device=x.device))
    chosen = idx(x, qr, cos, sin, meta, keys)  # [B, T, k] entry ids, -1 = none (a pure op)
    return selection_mask(chosen, n_e)


# ------------------------------------------------------------------------------------------------
# MoE
# ------------------------------------------------------------------------------------------------
def moe_forward(moe: MoE, u: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """`MoE.forward` with differentiable expert dispatch. u [B, T, D], ids [B, T] -> [B, T, D]."""
    shape = u.shape
    u = u.reshape(-1, shape[-1])  # [M, D]
    idx, w = moe.gate(u, ids.reshape(-1))  # [M, K] expert ids (hash or top-K), [M, K] fp32 weights
    y = routed_experts(u, idx, w, moe.experts, moe.limit)
    se = moe.shared_experts
    y = y + swiglu(u, se.w1.weight, se.w3.weight, se.w2.weight, moe.limit)
    return y.reshape(shape)


def routed_experts(u: torch.Tensor, idx: torch.Tensor, w: torch.Tensor, experts: Experts,
                   limit: float) -> torch.Tensor:
    """Σ_j w[t,j]·expert_{idx[t,j]}(u[t]), one batched clamped SwiGLU per expert; a repeated id adds.
    u [M, D], idx [M, K], w [M, K] fp32 -> [M, D] (u.dtype)."""
    M, K = idx.shape
    E = experts.w1.shape[0]
    flat = idx.reshape(-1)  # [M·K]
    order = flat.argsort(stable=True)  # (token, slot) pairs grouped by expert
    rows, wts = order // K, w.reshape(-1)[order]
    counts = torch.bincount(flat, minlength=E).tolist()  # the one host sync
    out = torch.zeros_like(u)
    for e, (r, wt) in enumerate(zip(rows.split(counts), wts.split(counts))):
        if r.numel() == 0:
            continue
        y = swiglu(u[r], experts.w1[e], experts.w3[e], experts.w2[e], limit)  # [n_e rows, D]
        out.index_add_(0, r, (y.float() * wt[:, None]).to(out.dtype))
    return out


# ------------------------------------------------------------------------------------------------
# which parameters train
# ------------------------------------------------------------------------------------------------
NO_GRAD_REASONS = {
    "attn.indexer.": "reached only through the integer top-k selection of CSA entries",
    "ffn.gate.bias": "router bias: used only to choose the experts (top-K(s + bias)), not in the weights",
}


def params_without_grad(model: DeepseekV4Model, with_mtp: bool = True) -> set[str]:
    """Names of the parameters that `train_forward` (+ `train_mtp_forward` when `with_mtp`) leaves
    without a gradient: the CSA indexers and the non-hash routers' biases (see NO_GRAD_REASONS);
    without the MTP loss, the whole `mtp.` block."""
    return {name for name, _ in model.named_parameters()
            if any(key in name for key in NO_GRAD_REASONS) or (not with_mtp and name.startswith("mtp."))}
