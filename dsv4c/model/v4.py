"""DeepSeek-V4 eager reference model (deepseek_v4.md §3-§6): the spec in code.

Parameter names equal the official checkpoint names (`layers.L.attn.wq_a.weight`, `mtp.0.e_proj.weight`,
...), except the routed experts, which are stacked: `layers.L.ffn.experts.w1 [E, I, D]` stands for the
checkpoint's `layers.L.ffn.experts.{e}.w1.weight`. The checkpoint module maps between the two.

One code path serves prefill, decode, chunked extend and speculative verify: `forward` absorbs a
chunk of T tokens per sequence into a `V4Cache`, each sequence at its own position `cache.pos[b]`, and
attends over the window ring, the compressed entries and the chunk itself. Without a cache it prefills
from position 0. The stateful parts (compressor update, indexer top-k, attention with the ring) are the
custom ops of `dsv4c.model.v4_ops`; everything between them is plain ATen, which export and the
passes see.

Legend: B batch, T chunk tokens, S key positions, D hidden, H heads, d head dim (K = V), r rope dim,
Q q_lora rank, G output groups, R o_lora rank, N hc streams, m compress ratio, c overlap factor
(2 for CSA, 1 for HCA), n_e compressed entries, HI/dI indexer heads/head dim, E experts, K top-k.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from dsv4c.config import ModelConfig
from dsv4c.model.common import (PagedLayout, RMSNorm, RotaryTable, StaticCache, batch_meta, rms, rope_angles,
                                 rope_interleaved, swiglu)
from dsv4c.model import v4_ops  # noqa: F401  (registers torch.ops.dsv4c.v4_*)
from dsv4c.model.moe import moe_experts  # noqa: F401  (registers torch.ops.dsv4c.moe_experts)


# ------------------------------------------------------------------------------------------------
# caches
# ------------------------------------------------------------------------------------------------
@dataclass
class LayerCache:
    """Static per-layer decode state (deepseek_v4.md §5.1), updated in place by the v4 ops.

    ring [B, S, d]: window rows, position p at slot p mod S (S = W + extra slots for speculation).
    comp_kv/comp_score [B, c·m + k, c·d] fp32: the compressor rows of the latest positions, position p
    at row p mod (c·m + k), k the extra rows for speculation (`dsv4c::v4_compress`).
    entries [B, ⌈L/m⌉, d]: compressed entries, entry i pools positions i·m … i·m+m-1.
    idx_*: the same three for the CSA indexer's compressor (width dI).
    Paged (`PagedLayout`): entries / idx_entries are pools [N + 1, b/m, ·] (idx: b/4 rows) shared by all
    sequences, read and written through `block_table [n_slots, ⌈L/b⌉]` (one table for every layer)."""

    ring: torch.Tensor
    comp_kv: torch.Tensor | None = None
    comp_score: torch.Tensor | None = None
    entries: torch.Tensor | None = None
    idx_kv: torch.Tensor | None = None
    idx_score: torch.Tensor | None = None
    idx_entries: torch.Tensor | None = None
    block_table: torch.Tensor | None = None

    def tensors(self) -> dict[str, torch.Tensor]:
        """The layer's own buffers (the shared block table is not one: `dsv4c.export.flat_caches`)."""
        return {k: v for k, v in vars(self).items() if v is not None and k != "block_table"}


V4Cache = StaticCache  # layers: [LayerCache]


def _compressor_rows(batch: int, m: int, width: int, device, extra: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Compressor rows [batch, c·m + extra, c·width] (kv zeros, scores -inf): the open group, the
    previous group for CSA, and `extra` rows that a speculative verify may write past them."""
    c = 2 if m == 4 else 1
    kv = torch.zeros(batch, c * m + extra, c * width, dtype=torch.float32, device=device)
    return kv, torch.full_like(kv, float("-inf"))


# ------------------------------------------------------------------------------------------------
# mHC
# ------------------------------------------------------------------------------------------------
def sinkhorn(c0: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """Softmax over j, +eps, normalise columns, then (rows, columns) × (iters-1). c0 [..., N, N] fp32."""
    c = c0.softmax(-1) + eps
    c = c / (c.sum(-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        c = c / (c.sum(-1, keepdim=True) + eps)
        c = c / (c.sum(-2, keepdim=True) + eps)
    return c


def hc_project(X: torch.Tensor, fn: torch.Tensor, eps: float) -> torch.Tensor:
    """z = (F·vec(X)) · rsqrt(mean(vec(X)²) + eps), fp32. X [..., N, D] -> z [..., fn.shape[0]]."""
    x = X.flatten(-2).float()
    return F.linear(x, fn.float()) * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


class HyperConnection(nn.Module):
    """One mHC site. Parameters are owned by the enclosing block (official names `hc_attn_fn` ...)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n = cfg.hc_mult
        self.eps = cfg.rms_norm_eps
        self.hc_eps = cfg.hc_eps
        self.iters = cfg.hc_sinkhorn_iters

    def pre(self, X: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor):
        """X [B, T, N, D] -> block input u [B, T, D], post [B, T, N], comb [B, T, N, N]."""
        N = self.n
        z = hc_project(X, fn, self.eps)
        b, s = base.float(), scale.float()
        pre = torch.sigmoid(s[0] * z[..., :N] + b[:N]) + self.hc_eps
        post = 2 * torch.sigmoid(s[1] * z[..., N : 2 * N] + b[N : 2 * N])
        c0 = s[2] * z[..., 2 * N :] + b[2 * N :]
        comb = sinkhorn(c0.unflatten(-1, (N, N)), self.iters, self.hc_eps)
        u = (pre[..., None] * X.float()).sum(-2)
        return u.to(X.dtype), post, comb

    @staticmethod
    def post(y: torch.Tensor, X: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
        """X'[k] = post_k·y + Σ_j comb[j,k]·X[j]. y [B,T,D], X [B,T,N,D]."""
        mixed = torch.einsum("btjk,btjd->btkd", comb, X.float())
        return (post[..., None] * y.float()[..., None, :] + mixed).to(X.dtype)


def hc_head_collapse(X: torch.Tensor, fn, base, scale, eps: float, hc_eps: float) -> torch.Tensor:
    """hc_head: u = Σ_k (σ(s·z_k + b_k) + hc_eps)·X[k]. X [B,T,N,D] -> [B,T,D]."""
    z = hc_project(X, fn, eps)
    w = torch.sigmoid(scale.float() * z + base.float()) + hc_eps
    return (w[..., None] * X.float()).sum(-2).to(X.dtype)


# ------------------------------------------------------------------------------------------------
# attention
# ------------------------------------------------------------------------------------------------
def _linear_f32(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return F.linear(x.float(), w.float())


class Compressor(nn.Module):
    """Pools each group of m tokens into one entry (deepseek_v4.md §4.1(d)); CSA (m = 4) overlaps
    with the previous group. The projections are plain fp32 linears here; the grouping, pooling, norm
    and RoPE of closing groups is `torch.ops.dsv4c.v4_compress`."""

    def __init__(self, cfg: ModelConfig, m: int, width: int):
        super().__init__()
        self.m, self.width, self.eps = m, width, cfg.rms_norm_eps
        self.c = 2 if m == 4 else 1
        self.ape = nn.Parameter(torch.zeros(m, self.c * width))
        self.wkv = nn.Linear(cfg.hidden_size, self.c * width, bias=False)
        self.wgate = nn.Linear(cfg.hidden_size, self.c * width, bias=False)
        self.norm = RMSNorm(width, cfg.rms_norm_eps)

    def forward(self, x, meta, inv_freq, state_kv, state_score, entries, block_table=None) -> None:
        """Absorb x [B, T, D] into the open-group state; write the entries of closing groups (through
        `block_table` into a pool when paged)."""
        kv, score = _linear_f32(x, self.wkv.weight), _linear_f32(x, self.wgate.weight)
        if block_table is None:
            torch.ops.dsv4c.v4_compress(kv, score, *meta, self.ape, self.norm.weight, inv_freq, state_kv, state_score,
                                        entries, self.m, self.eps)
        else:
            torch.ops.dsv4c.v4_compress_paged(kv, score, *meta, self.ape, self.norm.weight, inv_freq, state_kv,
                                              state_score, entries, block_table, self.m, self.eps)


class Indexer(nn.Module):
    """Lightning indexer of CSA layers (§4.1(e)): its own compressor (width dI) and a top-k scorer."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads, self.head_dim, self.topk = cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk
        self.wq_b = nn.Linear(cfg.q_lora_rank, self.n_heads * self.head_dim, bias=False)
        self.weights_proj = nn.Linear(cfg.hidden_size, self.n_heads, bias=False)
        self.compressor = Compressor(cfg, 4, self.head_dim)

    def forward(self, x, qr, cos, sin, meta, keys, block_table=None) -> torch.Tensor:
        """x [B,T,D], qr [B,T,Q] (the q residual), keys [B,E,dI] -> entry ids [B, T, topk] (-1 = none)."""
        q = self.wq_b(qr).unflatten(-1, (self.n_heads, self.head_dim))  # [B, T, HI, dI]
        q = rope_interleaved(q, cos[:, :, None], sin[:, :, None])
        wts = _linear_f32(x, self.weights_proj.weight) * self.n_heads**-0.5  # [B, T, HI]
        slots, pos0, _ = meta
        if block_table is not None:
            return torch.ops.dsv4c.v4_indexer_topk_paged(q, wts, keys, block_table, slots, pos0, self.topk, 4)
        return torch.ops.dsv4c.v4_indexer_topk(q, wts, keys, slots, pos0, self.topk, 4)


class Attention(nn.Module):
    """Shared-KV attention with window ring, sinks, optional compressor/indexer (§4.1)."""

    def __init__(self, cfg: ModelConfig, m: int):
        super().__init__()
        D, H, d, Q = cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim, cfg.q_lora_rank
        G, R = cfg.o_groups, cfg.o_lora_rank
        self.m, self.n_heads, self.head_dim, self.groups = m, H, d, G
        self.window, self.eps = cfg.sliding_window, cfg.rms_norm_eps
        self.wq_a = nn.Linear(D, Q, bias=False)
        self.q_norm = RMSNorm(Q, cfg.rms_norm_eps)
        self.wq_b = nn.Linear(Q, H * d, bias=False)
        self.wkv = nn.Linear(D, d, bias=False)
        self.kv_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.wo_a = nn.Linear(H * d // G, G * R, bias=False)
        self.wo_b = nn.Linear(G * R, D, bias=False)
        self.attn_sink = nn.Parameter(torch.zeros(H))
        if m == 0:
            self.rope = RotaryTable(cfg.qk_rope_head_dim, cfg.rope_theta, None)
        else:
            self.rope = RotaryTable(cfg.qk_rope_head_dim, cfg.compress_rope_theta, cfg.rope_scaling)
            self.compressor = Compressor(cfg, m, d)
        if m == 4:
            self.indexer = Indexer(cfg)

    def new_cache(self, batch: int, ring_slots: int, max_len: int, dtype: torch.dtype, device,
                  extra: int = 0, paged: PagedLayout | None = None, block_table: torch.Tensor | None = None
                  ) -> LayerCache:
        lc = LayerCache(torch.zeros(batch, ring_slots, self.head_dim, dtype=dtype, device=device))

        def grows(div: int, width: int) -> torch.Tensor:
            if paged is not None:
                return paged.pool(div, width, dtype, device)
            return torch.zeros(batch, -(-max_len // div), width, dtype=dtype, device=device)

        if self.m:
            lc.comp_kv, lc.comp_score = _compressor_rows(batch, self.m, self.head_dim, device, extra)
            lc.entries = grows(self.m, self.head_dim)
            lc.block_table = block_table
        if self.m == 4:
            dI = self.indexer.head_dim
            lc.idx_kv, lc.idx_score = _compressor_rows(batch, 4, dI, device, extra)
            lc.idx_entries = grows(4, dI)
        return lc

    def forward(self, x: torch.Tensor, meta: tuple, lc: LayerCache) -> torch.Tensor:
        """x [B, T, D] (normed block input), meta = (slots, pos0, n_real) -> [B, T, D]; updates lc."""
        B, T, _ = x.shape
        H, d = self.n_heads, self.head_dim
        cos, sin = rope_angles(meta[1], T, self.rope.inv_freq)  # [B, T, r/2] at positions pos0[b] + t
        qr = self.q_norm(self.wq_a(x))  # [B, T, Q]
        q = rms(self.wq_b(qr).unflatten(-1, (H, d)), self.eps).to(x.dtype)  # [B, T, H, d]
        q = rope_interleaved(q, cos[:, :, None], sin[:, :, None])
        kv = rope_interleaved(self.kv_norm(self.wkv(x)), cos, sin)  # [B, T, d]
        selected = None
        bt = lc.block_table if self.m else None  # paged: entries and indexer keys in blocks
        if self.m:
            self.compressor(x, meta, self.rope.inv_freq, lc.comp_kv, lc.comp_score, lc.entries, bt)
        if self.m == 4:
            self.indexer.compressor(x, meta, self.rope.inv_freq, lc.idx_kv, lc.idx_score, lc.idx_entries, bt)
            selected = self.indexer(x, qr, cos, sin, meta, lc.idx_entries, bt)
        if bt is None:
            o = torch.ops.dsv4c.v4_attention(q, kv, *meta, lc.ring, self.attn_sink, lc.entries, selected,
                                             self.window, self.m)  # [B, T, H, d] fp32
        else:
            o = torch.ops.dsv4c.v4_attention_paged(q, kv, *meta, lc.ring, self.attn_sink, lc.entries, bt, selected,
                                                   self.window, self.m)
        o = rope_interleaved(o, cos[:, :, None], sin[:, :, None], inverse=True).to(x.dtype)
        return self._output(o)

    def _output(self, o: torch.Tensor) -> torch.Tensor:
        """Grouped low-rank output: per group g, z_g = W_oa[g] · concat(heads of g); then W_ob."""
        B, T, H, d = o.shape
        G = self.groups
        wa = self.wo_a.weight.unflatten(0, (G, -1))  # [G, R, H·d/G]
        z = torch.einsum("btgi,gri->btgr", o.reshape(B, T, G, H * d // G), wa)
        return self.wo_b(z.flatten(-2))


# ------------------------------------------------------------------------------------------------
# MoE
# ------------------------------------------------------------------------------------------------
class Gate(nn.Module):
    """Router: sqrtsoftplus scores; hash layers select by tid2eid[token], others by top-K(s + bias)."""

    def __init__(self, cfg: ModelConfig, hashed: bool):
        super().__init__()
        self.k, self.scale, self.hashed = cfg.num_experts_per_tok, cfg.routed_scaling_factor, hashed
        self.weight = nn.Parameter(torch.zeros(cfg.n_routed_experts, cfg.hidden_size))
        if hashed:
            self.register_buffer("tid2eid", torch.zeros(cfg.vocab_size, self.k, dtype=torch.int64))
        else:
            self.bias = nn.Parameter(torch.zeros(cfg.n_routed_experts))

    def forward(self, u: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """u [T, D], ids [T] -> expert ids [T, K], weights [T, K] fp32."""
        logits = _linear_f32(u, self.weight)  # [T, E]
        if self.hashed:
            idx = self.tid2eid[ids]
            return idx, route_hashed(logits, idx, self.scale)
        return route_topk(logits, self.bias, self.k, self.scale)


# The router's scoring after the logits GEMM (T tokens, E experts, K chosen), the target of
# passes/fuse_router.py: s = sqrt(softplus(logits)); weights = s[idx] renormalised, then scaled.
def route_topk(logits: torch.Tensor, bias: torch.Tensor, k: int, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] fp32, bias [E] -> expert ids [T, K] (top-K of s + bias, descending), weights [T, K]."""
    s = F.softplus(logits).sqrt()
    idx = (s + bias.float()).topk(k, dim=-1).indices
    w = s.gather(-1, idx)
    return idx, w / (w.sum(-1, keepdim=True) + 1e-20) * scale


def route_hashed(logits: torch.Tensor, idx: torch.Tensor, scale: float) -> torch.Tensor:
    """logits [T, E] fp32, given expert ids idx [T, K] -> weights [T, K]."""
    s = F.softplus(logits).sqrt()
    w = s.gather(-1, idx)
    return w / (w.sum(-1, keepdim=True) + 1e-20) * scale


class Experts(nn.Module):
    """Stacked routed experts: w1, w3 [E, I, D], w2 [E, D, I]."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        E, I, D = cfg.n_routed_experts, cfg.moe_intermediate_size, cfg.hidden_size
        self.w1 = nn.Parameter(torch.zeros(E, I, D))
        self.w3 = nn.Parameter(torch.zeros(E, I, D))
        self.w2 = nn.Parameter(torch.zeros(E, D, I))


class SharedExpert(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        D, I = cfg.hidden_size, cfg.moe_intermediate_size
        self.w1 = nn.Linear(D, I, bias=False)
        self.w3 = nn.Linear(D, I, bias=False)
        self.w2 = nn.Linear(I, D, bias=False)


class MoE(nn.Module):
    """Σ_j w_j·expert_{idx_j}(u) + shared(u), SwiGLU clamped at swiglu_limit (§4.2)."""

    def __init__(self, cfg: ModelConfig, hashed: bool):
        super().__init__()
        self.limit = cfg.swiglu_limit
        self.gate = Gate(cfg, hashed)
        self.experts = Experts(cfg)
        self.shared_experts = SharedExpert(cfg)

    def forward(self, u: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        shape = u.shape
        u = u.reshape(-1, shape[-1])  # [B·T, D]
        idx, w = self.gate(u, ids.reshape(-1))
        ex = self.experts
        y = torch.ops.dsv4c.moe_experts(u, idx, w, ex.w1, ex.w3, ex.w2, self.limit)
        se = self.shared_experts
        y = y + swiglu(u, se.w1.weight, se.w3.weight, se.w2.weight, self.limit)
        return y.reshape(shape)


# ------------------------------------------------------------------------------------------------
# blocks and model
# ------------------------------------------------------------------------------------------------
def _hc_params(module: nn.Module, site: str, N: int, D: int) -> None:
    mix = (2 + N) * N
    module.register_parameter(f"hc_{site}_fn", nn.Parameter(torch.zeros(mix, N * D)))
    module.register_parameter(f"hc_{site}_base", nn.Parameter(torch.zeros(mix)))
    module.register_parameter(f"hc_{site}_scale", nn.Parameter(torch.ones(3)))


class Block(nn.Module):
    """hc_attn(attention) then hc_ffn(moe) over N residual streams."""

    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        D = cfg.hidden_size
        self.attn_norm = RMSNorm(D, cfg.rms_norm_eps)
        self.ffn_norm = RMSNorm(D, cfg.rms_norm_eps)
        self.attn = Attention(cfg, cfg.layer_ratio(layer))
        self.ffn = MoE(cfg, cfg.is_hash_layer(layer))
        self.hc = HyperConnection(cfg)
        _hc_params(self, "attn", cfg.hc_mult, D)
        _hc_params(self, "ffn", cfg.hc_mult, D)

    def forward(self, X: torch.Tensor, ids: torch.Tensor, meta: tuple, lc: LayerCache) -> torch.Tensor:
        u, post, comb = self.hc.pre(X, self.hc_attn_fn, self.hc_attn_base, self.hc_attn_scale)
        X = self.hc.post(self.attn(self.attn_norm(u), meta, lc), X, post, comb)
        u, post, comb = self.hc.pre(X, self.hc_ffn_fn, self.hc_ffn_base, self.hc_ffn_scale)
        return self.hc.post(self.ffn(self.ffn_norm(u), ids), X, post, comb)


class MTPBlock(Block):
    """The MTP block `mtp.0` (§6): a ratio-0, non-hash block with its own input projections and hc head."""

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg, cfg.num_hidden_layers)
        D, N = cfg.hidden_size, cfg.hc_mult
        self.e_proj = nn.Linear(D, D, bias=False)
        self.h_proj = nn.Linear(D, D, bias=False)
        self.enorm = RMSNorm(D, cfg.rms_norm_eps)
        self.hnorm = RMSNorm(D, cfg.rms_norm_eps)
        self.norm = RMSNorm(D, cfg.rms_norm_eps)
        self.hc_head_fn = nn.Parameter(torch.zeros(N, N * D))
        self.hc_head_base = nn.Parameter(torch.zeros(N))
        self.hc_head_scale = nn.Parameter(torch.ones(1))


class DeepseekV4Model(nn.Module):
    """embed -> N streams -> blocks -> hc_head -> norm -> head; plus the MTP block."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        if not cfg.is_v4:
            raise ValueError(f"DeepseekV4Model needs a deepseek_v4 config, got {cfg.model_type}")
        self.config = cfg
        D, N, V = cfg.hidden_size, cfg.hc_mult, cfg.vocab_size
        self.embed = nn.Embedding(V, D)
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(D, cfg.rms_norm_eps)
        self.head = nn.Linear(D, V, bias=False)
        self.hc_head_fn = nn.Parameter(torch.zeros(N, N * D))
        self.hc_head_base = nn.Parameter(torch.zeros(N))
        self.hc_head_scale = nn.Parameter(torch.ones(1))
        self.mtp = nn.ModuleList(MTPBlock(cfg) for _ in range(cfg.num_nextn_predict_layers))

    # ---- caches -------------------------------------------------------------------------------
    @property
    def act_dtype(self) -> torch.dtype:
        return self.embed.weight.dtype

    def new_cache(self, batch_size: int, max_len: int = 4096, extra_ring_slots: int = 0,
                  paged: PagedLayout | None = None) -> V4Cache:
        """Zeroed decode state for `batch_size` sequences of up to `max_len` positions.
        `extra_ring_slots` (k_max) keeps speculative rows from evicting live window and compressor rows.
        `paged`: the compressed entries and indexer keys in blocks of a shared pool (`PagedLayout`)."""
        return self._cache(self.layers, batch_size, max_len, extra_ring_slots, paged)

    def new_mtp_cache(self, batch_size: int, max_len: int = 4096, extra_ring_slots: int = 0,
                      paged: PagedLayout | None = None) -> V4Cache:
        return self._cache(self.mtp, batch_size, max_len, extra_ring_slots, paged)  # ratio 0: nothing paged

    def _cache(self, blocks, batch_size: int, max_len: int, extra: int, paged: PagedLayout | None = None) -> V4Cache:
        dev = self.embed.weight.device
        slots = self.config.sliding_window + extra
        bt = paged.table(batch_size, max_len, dev) if paged is not None else None
        layers = [b.attn.new_cache(batch_size, slots, max_len, self.act_dtype, dev, extra, paged, bt) for b in blocks]
        return V4Cache(layers, torch.zeros(batch_size, dtype=torch.int64, device=dev), max_len)

    # ---- forward ------------------------------------------------------------------------------
    def forward(self, input_ids: torch.Tensor, cache: V4Cache | None = None, n_real: torch.Tensor | None = None,
                slots: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids [B, T] -> logits [B, T, V] fp32. Without a cache: prefill from position 0."""
        return self.forward_with_streams(input_ids, cache, n_real, slots)[0]

    def forward_with_streams(self, input_ids: torch.Tensor, cache: V4Cache | None = None,
                             n_real: torch.Tensor | None = None, slots: torch.Tensor | None = None):
        """-> (logits [B, T, V] fp32, last-layer streams [B, T, N, D]); the streams feed the MTP block.
        `slots [B]`: the cache rows of the batch (default: all, in order); `n_real [B]`: real rows per
        sequence (default T); padded rows write no cache state."""
        B, T = input_ids.shape
        cache = cache if cache is not None else self.new_cache(B, max_len=T)
        meta = batch_meta(cache, B, T, n_real, slots)
        out = self.step(input_ids, *meta, cache.layers)
        cache.pos[meta[0]] += meta[2]
        return out

    def step(self, input_ids: torch.Tensor, slots: torch.Tensor, pos0: torch.Tensor, n_real: torch.Tensor,
             layers: list[LayerCache]) -> tuple[torch.Tensor, torch.Tensor]:
        """The traceable body: no Python-side state; the v4 ops update the caches in place.
        input_ids [B, T]; slots, pos0, n_real [B] int64 -> (logits [B, T, V] fp32, streams [B, T, N, D])."""
        B, T = input_ids.shape
        meta = (slots, pos0, n_real)
        X = self.embed(input_ids)[:, :, None, :].expand(B, T, self.config.hc_mult, -1).contiguous()
        for block, lc in zip(self.layers, layers):
            X = block(X, input_ids, meta, lc)
        return self._logits(X, self.hc_head_fn, self.hc_head_base, self.hc_head_scale, self.norm), X

    def _logits(self, X, fn, base, scale, norm: RMSNorm) -> torch.Tensor:
        c = self.config
        u = hc_head_collapse(X, fn, base, scale, c.rms_norm_eps, c.hc_eps)
        return F.linear(norm(u).float(), self.head.weight.float())

    def mtp_forward(self, streams: torch.Tensor, next_ids: torch.Tensor, cache: V4Cache,
                    n_real: torch.Tensor | None = None, slots: torch.Tensor | None = None):
        """Draft logits for position t+2 from the main streams at t and the token at t+1 (§6).

        streams [B, T, N, D] at positions cache.pos.., next_ids [B, T] ->
        (logits [B, T, V] fp32, the MTP's output streams [B, T, N, D] for recursive drafting)."""
        B, T = next_ids.shape
        meta = batch_meta(cache, B, T, n_real, slots)
        out = self.mtp_step(streams, next_ids, *meta, cache.layers[0])
        cache.pos[meta[0]] += meta[2]
        return out

    def mtp_step(self, streams, next_ids, slots, pos0, n_real, lc: LayerCache):
        """Traceable MTP body (see `step`)."""
        blk = self.mtp[0]
        e = blk.enorm(self.embed(next_ids))  # [B, T, D]
        Y = blk.e_proj(e)[:, :, None, :] + blk.h_proj(blk.hnorm(streams))
        Z = blk(Y.to(streams.dtype), next_ids, (slots, pos0, n_real), lc)
        return self._logits(Z, blk.hc_head_fn, blk.hc_head_base, blk.hc_head_scale, blk.norm), Z
