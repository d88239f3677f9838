"""DeepSeek-V4 eager reference model (deepseek_v4.md §3-§6): the spec in code.

Parameter names equal the official checkpoint names (`layers.L.attn.wq_a.weight`, `mtp.0.e_proj.weight`,
...), except the routed experts, which are stacked: `layers.L.ffn.experts.w1 [E, I, D]` stands for the
checkpoint's `layers.L.ffn.experts.{e}.w1.weight`. The checkpoint module maps between the two.

One code path serves prefill, decode and chunked extend: `forward` absorbs a chunk of T tokens at
positions p0..p0+T-1 into a `V4Cache` (p0 = cache.length) and attends over the window ring, the
compressed entries and the chunk itself. Without a cache it prefills from position 0.

Legend: B batch, T chunk tokens, S key positions, D hidden, H heads, d head dim (K = V), r rope dim,
Q q_lora rank, G output groups, R o_lora rank, N hc streams, m compress ratio, c overlap factor
(2 for CSA, 1 for HCA), n_e compressed entries, HI/dI indexer heads/head dim, E experts, K top-k.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from dsv4c.config import ModelConfig
from dsv4c.model.common import RMSNorm, RotaryTable, rms, rope_interleaved, swiglu
from dsv4c.model.moe import moe_experts  # noqa: F401  (registers torch.ops.dsv4c.moe_experts)


# ------------------------------------------------------------------------------------------------
# caches
# ------------------------------------------------------------------------------------------------
@dataclass
class CompressorState:
    """Open-group state of one compressor (deepseek_v4.md §5.1) plus its emitted entries.

    kv/score [B, c·m, c·d] fp32: slots [0, m) hold the previous group's rows (CSA only), slots
    [(c-1)m, cm) the current, still open group. entries [B, n_e, d]: post-norm, post-RoPE, append-only."""

    kv: torch.Tensor
    score: torch.Tensor
    entries: torch.Tensor

    @classmethod
    def empty(cls, batch: int, m: int, c: int, width: int, dtype: torch.dtype, device) -> "CompressorState":
        kv = torch.zeros(batch, c * m, c * width, dtype=torch.float32, device=device)
        score = torch.full_like(kv, float("-inf"))
        return cls(kv, score, torch.zeros(batch, 0, width, dtype=dtype, device=device))


@dataclass
class LayerState:
    """Per-layer decode state: the window ring (position p at slot p mod cap) and compressors."""

    ring: torch.Tensor  # [B, cap, d]
    comp: CompressorState | None = None
    index_comp: CompressorState | None = None


@dataclass
class V4Cache:
    layers: list[LayerState]
    length: int = 0  # tokens absorbed so far; the next chunk starts at this position
    extra: dict = field(default_factory=dict)


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
    """Pools groups of m tokens into one entry (deepseek_v4.md §4.1(d), §5.2 step 2).

    CSA (m = 4) overlaps: an entry pools 2m slots, the first half of the previous group's channels
    and the second half of its own group's. HCA pools m slots of width d."""

    def __init__(self, cfg: ModelConfig, m: int, width: int, rope: RotaryTable):
        super().__init__()
        self.m, self.width = m, width
        self.c = 2 if m == 4 else 1
        self.ape = nn.Parameter(torch.zeros(m, self.c * width))
        self.wkv = nn.Linear(cfg.hidden_size, self.c * width, bias=False)
        self.wgate = nn.Linear(cfg.hidden_size, self.c * width, bias=False)
        self.norm = RMSNorm(width, cfg.rms_norm_eps)
        self.rope = rope

    def new_state(self, batch: int, dtype: torch.dtype, device) -> CompressorState:
        return CompressorState.empty(batch, self.m, self.c, self.width, dtype, device)

    def forward(self, x: torch.Tensor, p0: int, st: CompressorState) -> CompressorState:
        """Absorb x [B, T, D] at positions p0.. into st; append entries of groups that close."""
        B, T, _ = x.shape
        m, c, w = self.m, self.c, self.width
        pos = p0 + torch.arange(T, device=x.device)
        k = _linear_f32(x, self.wkv.weight)  # [B, T, c·w]
        g = _linear_f32(x, self.wgate.weight) + self.ape.float()[pos % m]
        r = p0 % m  # rows of the open group already in the state
        cur = (c - 1) * m
        rows_kv = torch.cat([st.kv[:, cur : cur + r], k], 1)  # [B, r+T, c·w], group-aligned
        rows_sc = torch.cat([st.score[:, cur : cur + r], g], 1)
        n_close = (r + T) // m
        kv, score = st.kv.clone(), st.score.clone()
        entries = st.entries
        if n_close:
            grp_kv = rows_kv[:, : n_close * m].unflatten(1, (n_close, m))  # [B, n, m, c·w]
            grp_sc = rows_sc[:, : n_close * m].unflatten(1, (n_close, m))
            if c == 2:
                prev_kv = torch.cat([st.kv[:, None, :m], grp_kv[:, :-1]], 1)
                prev_sc = torch.cat([st.score[:, None, :m], grp_sc[:, :-1]], 1)
                slot_kv = torch.cat([prev_kv[..., :w], grp_kv[..., w:]], 2)  # [B, n, 2m, w]
                slot_sc = torch.cat([prev_sc[..., :w], grp_sc[..., w:]], 2)
                kv[:, :m], score[:, :m] = grp_kv[:, -1], grp_sc[:, -1]
            else:
                slot_kv, slot_sc = grp_kv, grp_sc
            pooled = (slot_sc.softmax(2) * slot_kv).sum(2)  # [B, n, w] fp32
            e = self.norm(pooled).to(st.entries.dtype)
            start = p0 - r + m * torch.arange(n_close, device=x.device)  # first token of each group
            cos, sin = self.rope(start)
            entries = torch.cat([entries, rope_interleaved(e, cos, sin)], 1)
        rem = r + T - n_close * m
        kv[:, cur : cur + rem] = rows_kv[:, n_close * m :]
        score[:, cur : cur + rem] = rows_sc[:, n_close * m :]
        return CompressorState(kv, score, entries)


def visible_entries(n_e: int, m: int, pos: torch.Tensor) -> torch.Tensor:
    """[T, n_e] bool: entry w is visible to query t iff (w+1)·m <= t+1."""
    w = torch.arange(n_e, device=pos.device)
    return (w[None, :] + 1) * m <= pos[:, None] + 1


class Indexer(nn.Module):
    """Lightning indexer of CSA layers (deepseek_v4.md §4.1(e)): picks top-k visible entries per query."""

    def __init__(self, cfg: ModelConfig, rope: RotaryTable):
        super().__init__()
        self.n_heads, self.head_dim, self.topk = cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk
        self.wq_b = nn.Linear(cfg.q_lora_rank, self.n_heads * self.head_dim, bias=False)
        self.weights_proj = nn.Linear(cfg.hidden_size, self.n_heads, bias=False)
        self.compressor = Compressor(cfg, 4, self.head_dim, rope)
        self.rope = rope

    def select(self, x: torch.Tensor, qr: torch.Tensor, pos: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        """x [B,T,D], qr [B,T,Q], keys [B,n_e,dI] -> selection mask [B, T, n_e]."""
        B, T, _ = x.shape
        n_e = keys.shape[1]
        q = F.linear(qr, self.wq_b.weight).unflatten(-1, (self.n_heads, self.head_dim))  # [B,T,HI,dI]
        cos, sin = self.rope(pos)
        q = rope_interleaved(q, cos[:, None], sin[:, None])
        wts = _linear_f32(x, self.weights_proj.weight) * self.n_heads**-0.5  # [B,T,HI]
        dots = torch.einsum("bthi,bsi->bths", q.float(), keys.float())
        score = torch.einsum("bth,bths->bts", wts * self.head_dim**-0.5, dots.relu())
        visible = visible_entries(n_e, 4, pos)[None].expand(B, T, n_e)
        k = min(self.topk, n_e)
        if k == 0:
            return visible
        top = score.masked_fill(~visible, float("-inf")).topk(k, dim=-1).indices
        chosen = torch.zeros_like(visible).scatter(-1, top, True)
        return chosen & visible


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
            self.compressor = Compressor(cfg, m, d, self.rope)
        if m == 4:
            self.indexer = Indexer(cfg, self.rope)

    def new_state(self, batch: int, ring_slots: int, dtype: torch.dtype, device) -> LayerState:
        ring = torch.zeros(batch, ring_slots, self.head_dim, dtype=dtype, device=device)
        st = LayerState(ring)
        if self.m:
            st.comp = self.compressor.new_state(batch, dtype, device)
        if self.m == 4:
            st.index_comp = self.indexer.compressor.new_state(batch, dtype, device)
        return st

    def _window(self, kv: torch.Tensor, p0: int, st: LayerState):
        """Cached rows of positions [p0-W+1, p0) followed by the chunk's rows; then write the
        chunk into the ring. Returns keys [B, S, d] and their positions [S]."""
        B, T, _ = kv.shape
        cap = st.ring.shape[1]
        old = torch.arange(max(0, p0 - self.window + 1), p0, device=kv.device)
        keys = torch.cat([st.ring[:, old % cap], kv], 1)
        pos = torch.cat([old, p0 + torch.arange(T, device=kv.device)])
        keep = min(T, cap)
        st.ring[:, pos[-keep:] % cap] = kv[:, -keep:].to(st.ring.dtype)
        return keys, pos

    def forward(self, x: torch.Tensor, p0: int, st: LayerState) -> torch.Tensor:
        """x [B, T, D] (normed block input) -> [B, T, D]; updates st in place."""
        B, T, _ = x.shape
        H, d = self.n_heads, self.head_dim
        pos = p0 + torch.arange(T, device=x.device)
        cos, sin = self.rope(pos)  # [T, r/2]
        qr = self.q_norm(self.wq_a(x))  # [B, T, Q]
        q = rms(self.wq_b(qr).unflatten(-1, (H, d)), self.eps).to(x.dtype)  # [B, T, H, d]
        q = rope_interleaved(q, cos[:, None], sin[:, None])
        kv = rope_interleaved(self.kv_norm(self.wkv(x)), cos, sin)  # [B, T, d]

        win_keys, win_pos = self._window(kv, p0, st)
        rel = pos[:, None] - win_pos[None, :]
        win_mask = (rel >= 0) & (rel < self.window)  # [T, S]
        keys, masks = [win_keys], [win_mask[None].expand(B, T, -1)]
        if self.m:
            st.comp = self.compressor(x, p0, st.comp)
            entries = st.comp.entries  # [B, n_e, d]
            vis = visible_entries(entries.shape[1], self.m, pos)[None].expand(B, T, -1)
            if self.m == 4:
                st.index_comp = self.indexer.compressor(x, p0, st.index_comp)
                vis = self.indexer.select(x, qr, pos, st.index_comp.entries)
            keys.append(entries)
            masks.append(vis)
        keys_all = torch.cat(keys, 1).float()  # [B, S, d]
        mask = torch.cat(masks, -1)  # [B, T, S]
        o = self._core(q.float(), keys_all, mask)  # [B, T, H, d] fp32
        o = rope_interleaved(o, cos[:, None], sin[:, None], inverse=True).to(x.dtype)
        return self._output(o)

    def _core(self, q: torch.Tensor, keys: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """softmax(q·k/√d) with the sink in the denominator only; K = V. -> [B, T, H, d]."""
        B, T, H, _ = q.shape
        logits = torch.einsum("bthd,bsd->bths", q, keys) / math.sqrt(self.head_dim)
        logits = logits.masked_fill(~mask[:, :, None, :], float("-inf"))
        sink = self.attn_sink.float().view(1, 1, H, 1).expand(B, T, H, 1)
        p = torch.cat([logits, sink], -1).softmax(-1)[..., :-1]
        return torch.einsum("bths,bsd->bthd", p, keys)

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
        s = F.softplus(_linear_f32(u, self.weight)).sqrt()  # [T, E]
        if self.hashed:
            idx = self.tid2eid[ids]
        else:
            idx = (s + self.bias.float()).topk(self.k, dim=-1).indices
        w = s.gather(-1, idx)
        return idx, w / (w.sum(-1, keepdim=True) + 1e-20) * self.scale


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

    def forward(self, X: torch.Tensor, ids: torch.Tensor, p0: int, st: LayerState) -> torch.Tensor:
        u, post, comb = self.hc.pre(X, self.hc_attn_fn, self.hc_attn_base, self.hc_attn_scale)
        X = self.hc.post(self.attn(self.attn_norm(u), p0, st), X, post, comb)
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

    def new_cache(self, batch_size: int, extra_ring_slots: int = 0) -> V4Cache:
        """Fresh decode state. `extra_ring_slots` (k_max) keeps speculative rows from evicting live ones."""
        dev = self.embed.weight.device
        slots = self.config.sliding_window + extra_ring_slots
        return V4Cache([b.attn.new_state(batch_size, slots, self.act_dtype, dev) for b in self.layers])

    def new_mtp_cache(self, batch_size: int, extra_ring_slots: int = 0) -> V4Cache:
        dev = self.embed.weight.device
        slots = self.config.sliding_window + extra_ring_slots
        return V4Cache([self.mtp[0].attn.new_state(batch_size, slots, self.act_dtype, dev)])

    # ---- forward ------------------------------------------------------------------------------
    def forward(self, input_ids: torch.Tensor, cache: V4Cache | None = None) -> torch.Tensor:
        """input_ids [B, T] -> logits [B, T, V] fp32. Without a cache: prefill from position 0."""
        return self.forward_with_streams(input_ids, cache)[0]

    def forward_with_streams(self, input_ids: torch.Tensor, cache: V4Cache | None = None):
        """-> (logits [B, T, V] fp32, last-layer streams [B, T, N, D]): the streams feed the MTP block."""
        B, T = input_ids.shape
        cache = cache if cache is not None else self.new_cache(B)
        p0 = cache.length
        X = self.embed(input_ids)[:, :, None, :].expand(B, T, self.config.hc_mult, -1).contiguous()
        for block, st in zip(self.layers, cache.layers):
            X = block(X, input_ids, p0, st)
        cache.length = p0 + T
        return self._logits(X, self.hc_head_fn, self.hc_head_base, self.hc_head_scale, self.norm), X

    def _logits(self, X, fn, base, scale, norm: RMSNorm) -> torch.Tensor:
        c = self.config
        u = hc_head_collapse(X, fn, base, scale, c.rms_norm_eps, c.hc_eps)
        return F.linear(norm(u).float(), self.head.weight.float())

    def mtp_forward(self, streams: torch.Tensor, next_ids: torch.Tensor, cache: V4Cache):
        """Draft logits for position t+2 from the main streams at t and the token at t+1 (§6).

        streams [B, T, N, D] at positions cache.length.., next_ids [B, T] ->
        (logits [B, T, V] fp32, the MTP's output streams [B, T, N, D] for recursive drafting)."""
        blk = self.mtp[0]
        p0 = cache.length
        e = blk.enorm(self.embed(next_ids))  # [B, T, D]
        Y = blk.e_proj(e)[:, :, None, :] + blk.h_proj(blk.hnorm(streams))
        Z = blk(Y.to(streams.dtype), next_ids, p0, cache.layers[0])
        cache.length = p0 + next_ids.shape[1]
        return self._logits(Z, blk.hc_head_fn, blk.hc_head_base, blk.hc_head_scale, blk.norm), Z
