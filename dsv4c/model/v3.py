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

Attention is MLA in its naive form (§4) for prefill, decode and chunked extend alike: one code path
absorbs a chunk of T tokens at positions p0..p0+T-1 (p0 = cache.length) into the latent cache and
expands K/V for all S = p0+T positions through `kv_b_proj`. The absorbed form (§5) is a compiler pass.

Numerics follow HF (the oracle): RMSNorm casts `rms(x)` to the input dtype before the weight; the
softmax, router and indexer scores are fp32; YaRN's mscale² is in the softmax scale whenever
rope_scaling is YaRN (§3).

Legend: B batch, T chunk tokens, S key positions (cached + chunk), D hidden, V vocab, H heads,
dn/dr/dv = qk_nope/qk_rope/v head dims, c kv_lora_rank, Q q_lora_rank, HI/dI indexer heads/head dim,
E routed experts, G expert groups, K experts per token, I expert width, N = B·T flattened tokens.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from dsv4c.config import ModelConfig, YarnScaling
from dsv4c.model.common import (RMSNorm, RotaryTable, rope_half_split, rope_interleaved, rope_inv_freq, swiglu,
                                yarn_mscale)
from dsv4c.model.moe import moe_experts  # noqa: F401  (registers torch.ops.dsv4c.moe_experts)


# ------------------------------------------------------------------------------------------------
# cache
# ------------------------------------------------------------------------------------------------
class V3Cache:
    """Per-layer latent cache (§5) plus V3.2's indexer keys (§6). Grows by `torch.cat`.

    For layer l (the MTP cache has a single layer, l = 0):
      latent[l]  [B, S, c]   c_KV after kv_a_layernorm (not rotated)
      k_pe[l]    [B, S, dr]  rotated k_pe in the *interleaved* (official) layout: channels (2i, 2i+1)
                             are the pair rotated by p·f_i. HF caches the de-interleaved layout
                             [rotated evens | rotated odds]; the logits are identical (§3).
      index_k[l] [B, S, dI]  V3.2 only (else None): LayerNorm'd indexer key, rope part first, half-split
                             rotated.
    `length` = positions absorbed so far (= S after a forward); the next chunk starts there."""

    def __init__(self, num_layers: int, batch_size: int, kv_lora_rank: int, rope_dim: int, index_dim: int,
                 dtype: torch.dtype, device: torch.device | str):
        def empty(width: int) -> torch.Tensor:
            return torch.zeros(batch_size, 0, width, dtype=dtype, device=device)

        self.batch_size = batch_size
        self.latent: list[torch.Tensor] = [empty(kv_lora_rank) for _ in range(num_layers)]
        self.k_pe: list[torch.Tensor] = [empty(rope_dim) for _ in range(num_layers)]
        self.index_k: list[torch.Tensor | None] = [empty(index_dim) if index_dim else None for _ in range(num_layers)]
        self.length = 0

    def append_latent(self, layer: int, c_kv: torch.Tensor, k_pe: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append the chunk's [B, T, c] / [B, T, dr]; return all [B, S, c] / [B, S, dr]."""
        self.latent[layer] = torch.cat((self.latent[layer], c_kv), dim=1)
        self.k_pe[layer] = torch.cat((self.k_pe[layer], k_pe), dim=1)
        return self.latent[layer], self.k_pe[layer]

    def append_index(self, layer: int, k: torch.Tensor) -> torch.Tensor:
        """Append the chunk's indexer keys [B, T, dI]; return all [B, S, dI]."""
        prev = self.index_k[layer]
        assert prev is not None, "this cache has no indexer keys (model_type is not deepseek_v32)"
        self.index_k[layer] = torch.cat((prev, k), dim=1)
        return self.index_k[layer]


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


def causal_visible(pos: torch.Tensor, num_keys: int) -> torch.Tensor:
    """Key s is visible to the query at absolute position pos[t] iff s <= pos[t]. pos [T] -> bool [T, S]."""
    keys = torch.arange(num_keys, device=pos.device)
    return keys[None, :] <= pos[:, None]


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

    def forward(self, x: torch.Tensor, c_q: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                visible: torch.Tensor, cache: V3Cache, layer: int) -> torch.Tensor:
        """x [B,T,D], c_q [B,T,Q], cos/sin [T, dr/2], visible bool [T,S] -> selected bool [B,T,S]."""
        B, T, _ = x.shape
        q = self.wq_b(c_q).view(B, T, self.n_heads, self.head_dim)           # [B,T,HI,dI]
        q = self._rope_first(q, cos[:, None, :], sin[:, None, :])
        k = self._rope_first(self.k_norm(self.wk(x)), cos, sin)              # [B,T,dI]
        keys = cache.append_index(layer, k)                                   # [B,S,dI]

        w = F.linear(x.float(), self.weights_proj.weight.float()) * self.n_heads ** -0.5  # [B,T,HI]
        dots = torch.einsum("bthd,bsd->bths", q.float(), keys.float()) * self.head_dim ** -0.5
        score = torch.einsum("bth,bths->bts", w, F.relu(dots))              # [B,T,S] fp32
        score = score.masked_fill(~visible, float("-inf"))

        # top-k over the whole row: rows with fewer than k causal keys pick some masked (future) keys
        # as well, which `& visible` removes again, leaving exactly the top-min(k, t+1) causal keys.
        k_sel = min(self.topk, score.shape[-1])
        top = score.topk(k_sel, dim=-1).indices                               # [B,T,k]
        selected = torch.zeros_like(score, dtype=torch.bool).scatter(-1, top, True)
        return selected & visible


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

    def forward(self, x: torch.Tensor, pos: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                cache: V3Cache, layer: int) -> torch.Tensor:
        """x [B,T,D] (after input_layernorm), pos [T], cos/sin [T, dr/2] -> [B,T,D]."""
        B, T, _ = x.shape
        H, dn, dr, dv = self.n_heads, self.dn, self.dr, self.dv

        # §4.1-2: queries
        c_q = self.q_a_layernorm(self.q_a_proj(x))                           # [B,T,Q]
        q = self.q_b_proj(c_q).view(B, T, H, dn + dr)                         # [B,T,H,dn+dr]
        q_nope, q_pe = q.split([dn, dr], dim=-1)
        q_pe = rope_interleaved(q_pe, cos[:, None, :], sin[:, None, :])      # [B,T,H,dr]

        # §4.3-4: the latent and the shared rope key, appended to the cache
        c_kv, k_pe = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, dr], dim=-1)
        c_kv = self.kv_a_layernorm(c_kv)                                      # [B,T,c]
        k_pe = rope_interleaved(k_pe, cos, sin)                               # [B,T,dr]
        C, K_pe = cache.append_latent(layer, c_kv, k_pe)                      # [B,S,c], [B,S,dr]
        S = C.shape[1]

        # §4.5-6: expand K/V for every key position from the latent
        kv = self.kv_b_proj(C).view(B, S, H, dn + dv)                         # [B,S,H,dn+dv]
        k_nope, v = kv.split([dn, dv], dim=-1)
        k = torch.cat((k_nope, K_pe[:, :, None, :].expand(B, S, H, dr)), dim=-1)  # [B,S,H,dn+dr]
        q = torch.cat((q_nope, q_pe), dim=-1)                                 # [B,T,H,dn+dr]

        allowed = causal_visible(pos, S)[None]                                # [1,T,S]
        if self.indexer is not None:
            allowed = self.indexer(x, c_q, cos, sin, allowed[0], cache, layer)  # [B,T,S]

        logits = torch.einsum("bthd,bshd->bhts", q, k) * self.scale          # [B,H,T,S]
        logits = logits.masked_fill(~allowed[:, None], float("-inf"))
        p = torch.softmax(logits.float(), dim=-1).to(q.dtype)
        o = torch.einsum("bhts,bshd->bthd", p, v).reshape(B, T, H * dv)       # [B,T,H·dv]
        return self.o_proj(o)                                                  # §4.7


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
        # The bias stays fp32 whatever the model dtype (HF: `_keep_in_fp32_modules_strict`).
        super()._apply(fn, recurse)
        self.e_score_correction_bias = self.e_score_correction_bias.float()
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

    def forward(self, x: torch.Tensor, pos: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                cache: V3Cache, layer: int) -> torch.Tensor:
        h = x + self.self_attn(self.input_layernorm(x), pos, cos, sin, cache, layer)
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

    def draft(self, emb: torch.Tensor, h: torch.Tensor, pos: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
              cache: V3Cache) -> torch.Tensor:
        """emb = embed(next ids) [B,T,D] (already zeroed where required), h [B,T,D] -> z [B,T,D] (pre-norm)."""
        y = self.eh_proj(torch.cat((self.enorm(emb), self.hnorm(h)), dim=-1))  # §8.1-3
        return self.forward(y, pos, cos, sin, cache, 0)                        # §8.4


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

    def _apply(self, fn, recurse: bool = True):
        # The rotary table is derived, not a checkpoint tensor: keep it exact fp32 whatever the model dtype
        # (a `.to(bfloat16)` would otherwise round the frequencies).
        super()._apply(fn, recurse)
        c = self.config
        self.rotary.inv_freq = rope_inv_freq(c.qk_rope_head_dim, c.rope_theta, c.rope_scaling).to(
            self.rotary.inv_freq.device)
        return self

    # ---- helpers ---------------------------------------------------------------------------------
    @property
    def mtp(self) -> MTPLayer | None:
        n = self.config.num_hidden_layers
        return self.model.layers[n] if len(self.model.layers) > n else None

    def _new_cache(self, num_layers: int, batch_size: int) -> V3Cache:
        c, w = self.config, self.model.embed_tokens.weight
        index_dim = c.index_head_dim if c.has_dsa_indexer else 0
        return V3Cache(num_layers, batch_size, c.kv_lora_rank, c.qk_rope_head_dim, index_dim, w.dtype, w.device)

    def new_cache(self, batch_size: int) -> V3Cache:
        return self._new_cache(self.config.num_hidden_layers, batch_size)

    def new_mtp_cache(self, batch_size: int) -> V3Cache:
        return self._new_cache(1, batch_size)

    def _rope(self, start: int, T: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Positions start..start+T-1 [T] and their cos/sin [T, dr/2] (fp32, × HF's YaRN attention factor)."""
        pos = torch.arange(start, start + T, device=self.model.embed_tokens.weight.device)
        cos, sin = self.rotary(pos)
        return pos, cos * self.rope_factor, sin * self.rope_factor

    # ---- main model ------------------------------------------------------------------------------
    def forward_with_hidden(self, input_ids: torch.Tensor, cache: V3Cache | None = None
                            ) -> tuple[torch.Tensor, torch.Tensor]:
        """input_ids [B,T] at positions cache.length.. (0 without a cache) -> logits [B,T,V] and the final
        hidden state h [B,T,D] after model.norm (the MTP input, vLLM convention). Updates cache in place."""
        B, T = input_ids.shape
        if cache is None:
            cache = self.new_cache(B)
        pos, cos, sin = self._rope(cache.length, T)
        x = self.model.embed_tokens(input_ids)                                # [B,T,D]
        for i in range(self.config.num_hidden_layers):
            x = self.model.layers[i](x, pos, cos, sin, cache, i)
        cache.length += T
        h = self.model.norm(x)
        return self.lm_head(h), h

    def forward(self, input_ids: torch.Tensor, cache: V3Cache | None = None) -> torch.Tensor:
        """input_ids [B,T] -> logits [B,T,V]."""
        return self.forward_with_hidden(input_ids, cache)[0]

    # ---- MTP (§8) --------------------------------------------------------------------------------
    def mtp_forward(self, h: torch.Tensor, next_ids: torch.Tensor, mtp_cache: V3Cache
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """h [B,T,D] at positions mtp_cache.length.. (the main model's post-norm hidden, or the previous
        draft step's z), next_ids [B,T] the tokens one ahead -> logits [B,T,V] for the token two ahead and
        z [B,T,D] (before shared_head.norm, the h of the next recursion step)."""
        mtp = self.mtp
        if mtp is None:
            raise ValueError("this config has no MTP module (num_nextn_predict_layers == 0)")
        T = next_ids.shape[1]
        pos, cos, sin = self._rope(mtp_cache.length, T)
        emb = self.model.embed_tokens(next_ids)                               # [B,T,D]
        if self.config.mtp_zero_embed_at_pos0:                                # vLLM: zero at absolute position 0
            emb = emb.masked_fill((pos == 0)[None, :, None], 0.0)
        z = mtp.draft(emb, h, pos, cos, sin, mtp_cache)
        mtp_cache.length += T
        return self.lm_head(mtp.shared_head.norm(z)), z
