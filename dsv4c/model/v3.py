"""DeepSeek-V3/R1 (deepseek_v3) and V3.2 (deepseek_v32) eager reference model: the spec in code
(deepseek_v3_mla.md §3-§8).

Parameter names equal HF's module names, so `state_dict()` keys are the hub names
(`model.layers.L.self_attn.q_a_proj.weight`, ...), with one exception: the routed experts are stacked,
`model.layers.L.mlp.experts.gate_proj [E, I, D]`, `.up_proj [E, I, D]` and `.down_proj [E, D, I]`
(no `.weight`), standing for the checkpoint's `mlp.experts.{e}.{gate,up,down}_proj.weight`.

The MTP module (§8), present when `num_nextn_predict_layers == 1`, is the last entry of `model.layers`
(index n = num_hidden_layers, the checkpoint's own prefix); `forward` runs only layers 0..n-1. It owns
`enorm`, `hnorm`, `eh_proj`, `shared_head.norm` and a full MoE decoder layer, and reuses the main model's
`model.embed_tokens` and `lm_head` (the checkpoint's duplicates `embed_tokens`/`shared_head.head` under
that prefix are the checkpoint loader's business).

Attention is MLA in its naive form (§4) for prefill, decode, chunked extend and speculative verify alike:
one code path absorbs a chunk of T tokens per sequence into a static `V3Cache`, each sequence at its own
position `cache.pos[b]` (rows p0..p0+T-1, of which the first `n_real[b]` are real), then reads the whole
cache and expands K/V for all L cache rows through `kv_b_proj`, masking keys after each query's
position. The cache writes and V3.2's top-k are the custom ops of `dsv4c.model.v3_ops`; the attention
itself is plain ATen, which export and the passes see (the absorbed form, §5, is a compiler pass).
`step` / `mtp_step` are the traceable bodies (caches as explicit inputs, no Python-side state);
`forward` / `forward_with_hidden` / `mtp_forward` check the chunk and advance `cache.pos`.

Numerics follow HF (the oracle): RMSNorm casts `rms(x)` to the input dtype before the weight; the
softmax, router and indexer scores are fp32; YaRN's mscale² is in the softmax scale whenever
rope_scaling is YaRN (§3).

Legend: B batch, T chunk tokens, L cache capacity (key positions), D hidden, V vocab, H heads,
dn/dr/dv = qk_nope/qk_rope/v head dims, c kv_lora_rank, Q q_lora_rank, HI/dI indexer heads/head dim,
E routed experts, G expert groups, K experts per token, I expert width, N = B·T flattened tokens.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from dsv4c.config import ModelConfig, YarnScaling
from dsv4c.model.common import (PagedLayout, RMSNorm, RotaryTable, StaticCache, batch_meta, paged_rows,
                                rope_half_split, rope_interleaved, selection_mask, swiglu, yarn_mscale)
from dsv4c.model import v3_ops  # noqa: F401  (registers torch.ops.dsv4c.mla_cache_update, dsa_*)
from dsv4c.model.moe import moe_experts  # noqa: F401  (registers torch.ops.dsv4c.moe_experts)


# ------------------------------------------------------------------------------------------------
# caches
# ------------------------------------------------------------------------------------------------
@dataclass
class LayerCache:
    """Static per-layer decode state, updated in place by the v3 ops; position p at row p.

    latent [B, L, c]      c_KV after kv_a_layernorm, not rotated (§5).
    kpe [B, L, dr]        rotated k_pe in the *interleaved* (official) layout: channels (2i, 2i+1) are the
                          pair rotated by p·f_i. HF caches the de-interleaved layout [rotated evens |
                          rotated odds]; the logits are identical (§3).
    index_keys [B, L, dI] V3.2 only: LayerNorm'd indexer key, rope part first, half-split rotated (§6).
    Paged (`PagedLayout`): each a pool [N + 1, b, ·] shared by all sequences, position p of slot s at
    row p mod b of block `block_table[s, p // b]` (one table for every layer)."""

    latent: torch.Tensor
    kpe: torch.Tensor
    index_keys: torch.Tensor | None = None
    block_table: torch.Tensor | None = None

    def tensors(self) -> dict[str, torch.Tensor]:
        """The layer's own buffers (the shared block table is not one: `dsv4c.export.flat_caches`)."""
        return {k: v for k, v in vars(self).items() if v is not None and k != "block_table"}


V3Cache = StaticCache  # layers: [LayerCache]


# ------------------------------------------------------------------------------------------------
# RoPE / YaRN constants (§3)
# ------------------------------------------------------------------------------------------------
def softmax_scale(cfg: ModelConfig) -> float:
    """(dn+dr)^-1/2 · m², m = yarn_mscale(factor, mscale_all_dim); m applies whenever rope_scaling is
    YaRN with a nonzero mscale_all_dim (HF; Official only when max_seq_len > original length)."""
    scale = cfg.qk_head_dim ** -0.5
    y = cfg.rope_scaling
    if y is not None and y.mscale_all_dim:
        m = yarn_mscale(y.factor, y.mscale_all_dim)
        scale = scale * m * m
    return scale


def rope_attention_factor(yarn: YarnScaling | None) -> float:
    """HF's YaRN `attention_factor` multiplying cos/sin: mscale(f, mscale)/mscale(f, mscale_all_dim) when
    both are set (= 1 for every released V3-family config), else mscale(f, 1). 1 without YaRN."""
    if yarn is None:
        return 1.0
    if yarn.mscale and yarn.mscale_all_dim:
        return yarn_mscale(yarn.factor, yarn.mscale) / yarn_mscale(yarn.factor, yarn.mscale_all_dim)
    return yarn_mscale(yarn.factor, 1.0)


def causal_visible(pos0: torch.Tensor, T: int, num_keys: int) -> torch.Tensor:
    """Key s is visible to chunk row t of sequence b iff s <= pos0[b] + t. pos0 [B] -> bool [B, T, L]."""
    pos = pos0[:, None] + torch.arange(T, device=pos0.device)                # [B,T]
    return torch.arange(num_keys, device=pos0.device) <= pos[..., None]


# ------------------------------------------------------------------------------------------------
# V3.2 lightning indexer (§6)
# ------------------------------------------------------------------------------------------------
class Indexer(nn.Module):
    """DSA lightning indexer: picks, per query, the top-min(index_topk, t+1) causal keys."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads = cfg.index_n_heads
        self.head_dim = cfg.index_head_dim
        self.rope_dim = cfg.qk_rope_head_dim
        self.topk = cfg.index_topk
        self.wq_b = nn.Linear(cfg.q_lora_rank, self.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(cfg.hidden_size, self.head_dim, bias=False)
        self.k_norm = nn.LayerNorm(self.head_dim, eps=1e-6)
        self.weights_proj = nn.Linear(cfg.hidden_size, self.n_heads, bias=False)

    def _rope_first(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Half-split RoPE on the first dr channels (rope part first, nope part after)."""
        r = self.rope_dim
        return torch.cat((rope_half_split(x[..., :r], cos, sin), x[..., r:]), dim=-1)

    def forward(self, x: torch.Tensor, c_q: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: tuple,
                index_keys: torch.Tensor, block_table: torch.Tensor | None = None) -> torch.Tensor:
        """x [B,T,D], c_q [B,T,Q], cos/sin [B,T,dr/2], meta = (slots, pos0, n_real); writes the chunk's
        keys into index_keys [n_slots,L,dI] -> selected key positions [B,T,index_topk] int64 (-1 = unused)."""
        slots, pos0, n_real = meta
        q = self.wq_b(c_q).unflatten(-1, (self.n_heads, self.head_dim))       # [B,T,HI,dI]
        q = self._rope_first(q, cos[:, :, None], sin[:, :, None])
        k = self._rope_first(self.k_norm(self.wk(x)), cos, sin)              # [B,T,dI]
        w = F.linear(x.float(), self.weights_proj.weight.float()) * self.n_heads ** -0.5  # [B,T,HI]
        if block_table is not None:
            torch.ops.dsv4c.dsa_cache_update_paged(k, slots, pos0, n_real, index_keys, block_table)
            return torch.ops.dsv4c.dsa_topk(q, w, paged_rows(index_keys, block_table, slots), pos0, self.topk)
        torch.ops.dsv4c.dsa_cache_update(k, slots, pos0, n_real, index_keys)
        return torch.ops.dsv4c.dsa_topk(q, w, index_keys[slots], pos0, self.topk)


# ------------------------------------------------------------------------------------------------
# MLA (§4, naive form)
# ------------------------------------------------------------------------------------------------
class MLAttention(nn.Module):
    """Multi-head latent attention; HF name `self_attn`."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads = cfg.num_attention_heads
        self.dn, self.dr, self.dv = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.kv_lora_rank = cfg.kv_lora_rank
        H, D, eps = self.n_heads, cfg.hidden_size, cfg.rms_norm_eps
        self.q_a_proj = nn.Linear(D, cfg.q_lora_rank, bias=False)
        self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, eps, cast_first=True)
        self.q_b_proj = nn.Linear(cfg.q_lora_rank, H * (self.dn + self.dr), bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(D, self.kv_lora_rank + self.dr, bias=False)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, eps, cast_first=True)
        self.kv_b_proj = nn.Linear(self.kv_lora_rank, H * (self.dn + self.dv), bias=False)
        self.o_proj = nn.Linear(H * self.dv, D, bias=False)
        self.indexer = Indexer(cfg) if cfg.has_dsa_indexer else None
        self.scale = softmax_scale(cfg)

    def new_cache(self, batch: int, max_len: int, dtype: torch.dtype, device, paged: PagedLayout | None = None,
                  block_table: torch.Tensor | None = None) -> LayerCache:
        def zeros(width: int) -> torch.Tensor:
            if paged is not None:
                return paged.pool(1, width, dtype, device)
            return torch.zeros(batch, max_len, width, dtype=dtype, device=device)

        index_keys = zeros(self.indexer.head_dim) if self.indexer is not None else None
        return LayerCache(zeros(self.kv_lora_rank), zeros(self.dr), index_keys, block_table)

    def forward(self, x: torch.Tensor, meta: tuple, cos: torch.Tensor, sin: torch.Tensor,
                lc: LayerCache) -> torch.Tensor:
        """x [B,T,D] (after input_layernorm); meta = (slots, pos0, n_real): batch row b is cache row
        slots[b] and its chunk row t sits at position pos0[b]+t; cos/sin [B,T,dr/2] -> [B,T,D].
        Writes the chunk's real rows into lc."""
        B, T, _ = x.shape
        slots, pos0, n_real = meta
        H, dn, dr = self.n_heads, self.dn, self.dr

        # §4.1-2: queries
        c_q = self.q_a_layernorm(self.q_a_proj(x))                           # [B,T,Q]
        q = self.q_b_proj(c_q).view(B, T, H, dn + dr)                         # [B,T,H,dn+dr]
        q_nope, q_pe = q.split([dn, dr], dim=-1)
        q_pe = rope_interleaved(q_pe, cos[:, :, None], sin[:, :, None])      # [B,T,H,dr]

        # §4.3-4: the latent and the shared rope key, written into the static cache
        c_kv, k_pe = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, dr], dim=-1)
        c_kv = self.kv_a_layernorm(c_kv)                                      # [B,T,c]
        k_pe = rope_interleaved(k_pe, cos, sin)                               # [B,T,dr]
        bt = lc.block_table  # paged: latent, kpe (and index_keys) in blocks of a shared pool
        if bt is None:
            torch.ops.dsv4c.mla_cache_update(c_kv, k_pe, slots, pos0, n_real, lc.latent, lc.kpe)
            latent, kpe = lc.latent[slots], lc.kpe[slots]                    # [B,L,c], [B,L,dr]
        else:
            torch.ops.dsv4c.mla_cache_update_paged(c_kv, k_pe, slots, pos0, n_real, lc.latent, lc.kpe, bt)
            latent, kpe = paged_rows(lc.latent, bt, slots), paged_rows(lc.kpe, bt, slots)  # L = nb·b

        # which keys each query sees: causal, and on V3.2 the indexer's selection (§6.7)
        L = latent.shape[1]
        allowed = causal_visible(pos0, T, L)                                  # [B,T,L]
        if self.indexer is not None:
            selected = self.indexer(x, c_q, cos, sin, meta, lc.index_keys, bt)  # [B,T,topk]
            allowed = allowed & selection_mask(selected, L)
        o = self._attend(torch.cat((q_nope, q_pe), dim=-1), latent, kpe, allowed)
        return self.o_proj(o)                                                  # §4.7

    def _attend(self, q: torch.Tensor, latent: torch.Tensor, kpe: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
        """§4.5-6 over the whole static cache: q [B,T,H,dn+dr], latent [B,L,c], kpe [B,L,dr],
        allowed bool [B,T,L] -> o [B,T,H·dv]."""
        B, T, H, _ = q.shape
        L = latent.shape[1]
        kv = self.kv_b_proj(latent).view(B, L, H, self.dn + self.dv)          # [B,L,H,dn+dv]
        k_nope, v = kv.split([self.dn, self.dv], dim=-1)
        k = torch.cat((k_nope, kpe[:, :, None, :].expand(B, L, H, self.dr)), dim=-1)  # [B,L,H,dn+dr]
        logits = torch.einsum("bthd,bshd->bhts", q, k) * self.scale           # [B,H,T,L]
        logits = logits.masked_fill(~allowed[:, None], float("-inf"))
        p = torch.softmax(logits.float(), dim=-1).to(q.dtype)
        return torch.einsum("bhts,bshd->bthd", p, v).reshape(B, T, H * self.dv)


# ------------------------------------------------------------------------------------------------
# FFN and MoE (§7)
# ------------------------------------------------------------------------------------------------
class MLP(nn.Module):
    """down(silu(gate(x)) ⊙ up(x)); dense layers and the shared experts."""

    def __init__(self, hidden: int, width: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, width, bias=False)
        self.up_proj = nn.Linear(hidden, width, bias=False)
        self.down_proj = nn.Linear(width, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return swiglu(x, self.gate_proj.weight, self.up_proj.weight, self.down_proj.weight)


class Gate(nn.Module):
    """noaux_tc router: sigmoid scores, bias for selection only, group-limited top-k (§7.1-6)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.top_k = cfg.num_experts_per_tok
        self.n_group, self.topk_group = cfg.n_group, cfg.topk_group
        self.norm_topk_prob = cfg.norm_topk_prob
        self.routed_scaling_factor = cfg.routed_scaling_factor
        self.weight = nn.Parameter(torch.zeros(cfg.n_routed_experts, cfg.hidden_size))
        self.register_buffer("e_score_correction_bias", torch.zeros(cfg.n_routed_experts, dtype=torch.float32))

    def _apply(self, fn, recurse: bool = True):
        # The bias stays fp32 whatever the model dtype (HF: `_keep_in_fp32_modules_strict`): keep the
        # fp32 values and only follow the device, so a `.to(bfloat16)` does not round them.
        keep = self.e_score_correction_bias
        super()._apply(fn, recurse)
        new = self.e_score_correction_bias
        self.e_score_correction_bias = (new if keep.is_meta else keep.to(new.device)).to(torch.float32)
        return self

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N,D] -> idx [N,K] int64, weight [N,K] fp32."""
        N, E, G = x.shape[0], self.weight.shape[0], self.n_group
        s = torch.sigmoid(F.linear(x.float(), self.weight.float()))         # [N,E]
        s_sel = s + self.e_score_correction_bias.float()                     # selection only
        group_score = s_sel.view(N, G, E // G).topk(2, dim=-1).values.sum(-1)  # [N,G]
        best_groups = group_score.topk(self.topk_group, dim=-1).indices      # [N,topk_group]
        keep = torch.zeros_like(group_score, dtype=torch.bool).scatter(1, best_groups, True)
        keep = keep[:, :, None].expand(N, G, E // G).reshape(N, E)            # [N,E]
        idx = s_sel.masked_fill(~keep, float("-inf")).topk(self.top_k, dim=-1).indices  # [N,K]
        w = s.gather(1, idx)                                                  # unbiased scores
        if self.norm_topk_prob:
            w = w / (w.sum(-1, keepdim=True) + 1e-20)
        return idx, w * self.routed_scaling_factor


class RoutedExperts(nn.Module):
    """Stacked routed-expert weights; `mlp.experts.{gate,up,down}_proj` (no `.weight`)."""

    def __init__(self, n_experts: int, hidden: int, width: int):
        super().__init__()
        self.gate_proj = nn.Parameter(torch.zeros(n_experts, width, hidden))  # [E,I,D]
        self.up_proj = nn.Parameter(torch.zeros(n_experts, width, hidden))    # [E,I,D]
        self.down_proj = nn.Parameter(torch.zeros(n_experts, hidden, width))  # [E,D,I]

    def forward(self, x: torch.Tensor, idx: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """x [N,D], idx/weight [N,K] -> Σ_j weight_j · expert_{idx_j}(x) [N,D]; no clamp (limit 0)."""
        return torch.ops.dsv4c.moe_experts(x, idx, weight, self.gate_proj, self.up_proj, self.down_proj, 0.0)


class MoE(nn.Module):
    """Routed experts (weighted after down_proj) + shared experts (weight 1)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate = Gate(cfg)
        self.experts = RoutedExperts(cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size)
        self.shared_experts = MLP(cfg.hidden_size, cfg.moe_intermediate_size * cfg.n_shared_experts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [B,T,D] -> [B,T,D]."""
        flat = x.reshape(-1, x.shape[-1])                                     # [N,D]
        idx, w = self.gate(flat)
        routed = self.experts(flat, idx, w).view_as(x)
        return routed + self.shared_experts(x)


# ------------------------------------------------------------------------------------------------
# decoder layers
# ------------------------------------------------------------------------------------------------
class DecoderLayer(nn.Module):
    """Pre-norm block: h = x + attn(norm(x)); out = h + mlp(norm(h))."""

    def __init__(self, cfg: ModelConfig, moe: bool):
        super().__init__()
        self.self_attn = MLAttention(cfg)
        self.mlp = MoE(cfg) if moe else MLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cast_first=True)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cast_first=True)

    def forward(self, x: torch.Tensor, meta: tuple, cos: torch.Tensor, sin: torch.Tensor,
                lc: LayerCache) -> torch.Tensor:
        h = x + self.self_attn(self.input_layernorm(x), meta, cos, sin, lc)
        return h + self.mlp(self.post_attention_layernorm(h))


class SharedHead(nn.Module):
    """The MTP head's norm; its `head` is the main `lm_head` (not owned here)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cast_first=True)


class MTPLayer(DecoderLayer):
    """The MTP module `model.layers.{n}` (§8): enorm, hnorm, eh_proj, shared_head.norm and a MoE layer."""

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg, moe=True)
        D = cfg.hidden_size
        self.enorm = RMSNorm(D, cfg.rms_norm_eps, cast_first=True)
        self.hnorm = RMSNorm(D, cfg.rms_norm_eps, cast_first=True)
        self.eh_proj = nn.Linear(2 * D, D, bias=False)  # [D, 2D]: embedding half first
        self.shared_head = SharedHead(cfg)

    def draft(self, emb: torch.Tensor, h: torch.Tensor, meta: tuple, cos: torch.Tensor, sin: torch.Tensor,
              lc: LayerCache) -> torch.Tensor:
        """emb = embed(next ids) [B,T,D] (already zeroed where required), h [B,T,D] -> z [B,T,D] (pre-norm)."""
        y = self.eh_proj(torch.cat((self.enorm(emb), self.hnorm(h)), dim=-1))  # §8.1-3
        return self.forward(y, meta, cos, sin, lc)                             # §8.4


class Backbone(nn.Module):
    """HF's `model.`: embed_tokens, layers (n main + the MTP module last), norm."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        layers: list[nn.Module] = [DecoderLayer(cfg, cfg.is_moe_layer(i)) for i in range(cfg.num_hidden_layers)]
        if cfg.num_nextn_predict_layers == 1:
            layers.append(MTPLayer(cfg))
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cast_first=True)


# ------------------------------------------------------------------------------------------------
# the model
# ------------------------------------------------------------------------------------------------
class DeepseekV3Model(nn.Module):
    """DeepSeek-V3/R1/V3.2 causal LM (HF's `DeepseekV3ForCausalLM` layout) with an optional MTP module."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        if config.is_v4:
            raise ValueError("DeepseekV3Model is for deepseek_v3 / deepseek_v32 configs, got deepseek_v4")
        self.config = config
        self.model = Backbone(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.rotary = RotaryTable(config.qk_rope_head_dim, config.rope_theta, config.rope_scaling)
        self.rope_factor = rope_attention_factor(config.rope_scaling)

    # ---- helpers ---------------------------------------------------------------------------------
    @property
    def mtp(self) -> MTPLayer | None:
        n = self.config.num_hidden_layers
        return self.model.layers[n] if len(self.model.layers) > n else None

    @property
    def act_dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    def _rope(self, pos0: torch.Tensor, T: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Positions pos [B,T] = pos0[b] + t and their cos/sin [B,T,dr/2] (fp32, × HF's YaRN attention factor)."""
        pos = pos0[:, None] + torch.arange(T, device=pos0.device)
        cos, sin = self.rotary(pos)
        return pos, cos * self.rope_factor, sin * self.rope_factor

    # ---- caches ----------------------------------------------------------------------------------
    def new_cache(self, batch_size: int, max_len: int = 4096, paged: PagedLayout | None = None) -> V3Cache:
        """Zeroed decode state for `batch_size` sequences of up to `max_len` positions; `paged`: the
        caches in blocks of a shared pool (`PagedLayout`)."""
        return self._cache(self.model.layers[: self.config.num_hidden_layers], batch_size, max_len, paged)

    def new_mtp_cache(self, batch_size: int, max_len: int = 4096, paged: PagedLayout | None = None) -> V3Cache:
        if self.mtp is None:
            raise ValueError("this config has no MTP module (num_nextn_predict_layers == 0)")
        return self._cache([self.mtp], batch_size, max_len, paged)

    def _cache(self, layers, batch_size: int, max_len: int, paged: PagedLayout | None = None) -> V3Cache:
        dev = self.model.embed_tokens.weight.device
        bt = paged.table(batch_size, max_len, dev) if paged is not None else None
        lcs = [layer.self_attn.new_cache(batch_size, max_len, self.act_dtype, dev, paged, bt) for layer in layers]
        return V3Cache(lcs, torch.zeros(batch_size, dtype=torch.int64, device=dev), max_len)

    # ---- main model ------------------------------------------------------------------------------
    def forward(self, input_ids: torch.Tensor, cache: V3Cache | None = None, n_real: torch.Tensor | None = None,
                slots: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids [B,T] -> logits [B,T,V]. Without a cache: prefill from position 0."""
        return self.forward_with_hidden(input_ids, cache, n_real, slots)[0]

    def forward_with_hidden(self, input_ids: torch.Tensor, cache: V3Cache | None = None,
                            n_real: torch.Tensor | None = None,
                            slots: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """input_ids [B,T], row t of sequence b at position cache.pos[b]+t (0+t without a cache) -> logits
        [B,T,V] and the final hidden state h [B,T,D] after model.norm (the MTP input, vLLM convention).
        `n_real [B]`: real rows per sequence (default T); padded rows write no cache state. `slots [B]`:
        the cache rows of the batch (default: all, in order). Updates the cache, advances cache.pos."""
        B, T = input_ids.shape
        cache = cache if cache is not None else self.new_cache(B, max_len=T)
        meta = batch_meta(cache, B, T, n_real, slots)
        logits, h = self.step(input_ids, *meta, cache.layers)
        cache.pos[meta[0]] += meta[2]
        return logits, h

    def step(self, input_ids: torch.Tensor, slots: torch.Tensor, pos0: torch.Tensor, n_real: torch.Tensor,
             layers: list[LayerCache]) -> tuple[torch.Tensor, torch.Tensor]:
        """The traceable body: no Python-side state, caches updated in place by the v3 ops.
        input_ids [B,T], slots/pos0/n_real [B] -> logits [B,T,V], h [B,T,D]."""
        _, cos, sin = self._rope(pos0, input_ids.shape[1])
        meta = (slots, pos0, n_real)
        x = self.model.embed_tokens(input_ids)                                # [B,T,D]
        for layer, lc in zip(self.model.layers[: self.config.num_hidden_layers], layers):
            x = layer(x, meta, cos, sin, lc)
        h = self.model.norm(x)
        return self.lm_head(h), h

    # ---- MTP (§8) --------------------------------------------------------------------------------
    def mtp_forward(self, h: torch.Tensor, next_ids: torch.Tensor, mtp_cache: V3Cache,
                    n_real: torch.Tensor | None = None,
                    slots: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """h [B,T,D] at positions mtp_cache.pos.. (the main model's post-norm hidden, or the previous
        draft step's z), next_ids [B,T] the tokens one ahead -> logits [B,T,V] for the token two ahead and
        z [B,T,D] (before shared_head.norm, the h of the next recursion step). Advances mtp_cache.pos."""
        if self.mtp is None:
            raise ValueError("this config has no MTP module (num_nextn_predict_layers == 0)")
        B, T = next_ids.shape
        meta = batch_meta(mtp_cache, B, T, n_real, slots)
        out = self.mtp_step(h, next_ids, *meta, mtp_cache.layers[0])
        mtp_cache.pos[meta[0]] += meta[2]
        return out

    def mtp_step(self, h: torch.Tensor, next_ids: torch.Tensor, slots: torch.Tensor, pos0: torch.Tensor,
                 n_real: torch.Tensor, lc: LayerCache) -> tuple[torch.Tensor, torch.Tensor]:
        """The traceable MTP body (see `mtp_forward`)."""
        pos, cos, sin = self._rope(pos0, next_ids.shape[1])
        emb = self.model.embed_tokens(next_ids)                               # [B,T,D]
        if self.config.mtp_zero_embed_at_pos0:                                # vLLM: zero at absolute position 0
            emb = emb.masked_fill((pos == 0)[:, :, None], 0.0)
        z = self.mtp.draft(emb, h, (slots, pos0, n_real), cos, sin, lc)
        return self.lm_head(self.mtp.shared_head.norm(z)), z
