"""Model configuration: one frozen `ModelConfig` for DeepSeek-V4, V3/R1 and V3.2.

The fields keep the official hub names and meanings (deepseek_v4.md §1, deepseek_v3_mla.md §1).
V4 configs arrive in two forms, the official one (`compress_ratios`, `num_hash_layers`,
`rope_scaling`) and the HF `save_pretrained` one (`layer_types`, `compress_rates`,
`mlp_layer_types`, `rope_parameters`); both parse into the official form, which is what
dsv4c keys its semantics on (the per-layer compress *ratio*).
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

V4 = "deepseek_v4"
V3 = "deepseek_v3"
V32 = "deepseek_v32"
MODEL_TYPES = (V4, V3, V32)

V4_LAYER_TYPE_OF_RATIO = {0: "sliding_attention", 4: "compressed_sparse_attention"}
V4_HCA = "heavily_compressed_attention"


class ConfigError(ValueError):
    """A config value is missing, unknown or inconsistent. The message starts with the field."""

    def __init__(self, field_name: str, msg: str):
        super().__init__(f"{field_name}: {msg}")
        self.field = field_name


@dataclass(frozen=True)
class YarnScaling:
    """YaRN rope scaling (deepseek_v4.md §3.1; deepseek_v3_mla.md §3)."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0

    def to_dict(self) -> dict:
        return {"type": "yarn", **dataclasses.asdict(self)}


@dataclass(frozen=True)
class FP8Quantization:
    """`quantization_config` of the released checkpoints (quant_formats.md §2-3)."""

    quant_method: str = "fp8"
    fmt: str = "e4m3"
    activation_scheme: str = "dynamic"
    scale_fmt: str | None = None
    weight_block_size: tuple[int, int] = (128, 128)

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["weight_block_size"] = list(self.weight_block_size)
        return {k: v for k, v in d.items() if v is not None}


@dataclass(frozen=True)
class ModelConfig:
    """Frozen model config. Shared fields first, then family-specific ones (0 when unused)."""

    model_type: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    q_lora_rank: int
    qk_rope_head_dim: int
    moe_intermediate_size: int
    n_routed_experts: int
    num_experts_per_tok: int
    n_shared_experts: int = 1
    num_key_value_heads: int = 1
    scoring_func: str = "sqrtsoftplus"
    topk_method: str = "noaux_tc"
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    rope_theta: float = 10000.0
    rope_scaling: YarnScaling | None = None
    max_position_embeddings: int = 4096
    rms_norm_eps: float = 1e-6
    hidden_act: str = "silu"
    tie_word_embeddings: bool = False
    bos_token_id: int | None = 0
    eos_token_id: int | None = 1
    num_nextn_predict_layers: int = 1
    quantization_config: FP8Quantization | None = None
    # --- DeepSeek-V4 ---
    head_dim: int = 0
    o_groups: int = 0
    o_lora_rank: int = 0
    sliding_window: int = 0
    compress_ratios: tuple[int, ...] = ()  # n+1 entries; the last is the MTP layer's
    compress_rope_theta: float = 0.0
    num_hash_layers: int = 0
    hc_mult: int = 0
    hc_sinkhorn_iters: int = 0
    hc_eps: float = 0.0
    swiglu_limit: float = 0.0
    expert_dtype: str | None = None
    # --- DeepSeek-V3 / V3.2 ---
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    v_head_dim: int = 0
    intermediate_size: int = 0
    first_k_dense_replace: int = 0
    moe_layer_freq: int = 1
    n_group: int = 1
    topk_group: int = 1
    # --- V4 CSA indexer and V3.2 DSA indexer ---
    index_n_heads: int = 0
    index_head_dim: int = 0
    index_topk: int = 0
    # --- dsv4c options (not hub fields) ---
    mtp_zero_embed_at_pos0: bool = False  # vLLM's V3 MTP convention (deepseek_v3_mla.md §8)

    def __post_init__(self) -> None:
        _validate(self)

    # ---- derived facts -------------------------------------------------------------
    @property
    def is_v4(self) -> bool:
        return self.model_type == V4

    @property
    def has_dsa_indexer(self) -> bool:
        return self.model_type == V32

    @property
    def qk_head_dim(self) -> int:
        """V3: d_n + d_r (192)."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def layer_ratio(self, layer: int) -> int:
        """V4 compress ratio m of a layer; layer == num_hidden_layers is the MTP block."""
        return self.compress_ratios[layer]

    def layer_kind(self, layer: int) -> str:
        """'swa', 'csa' or 'hca' (V4); 'mla' or 'dsa' (V3/V3.2)."""
        if not self.is_v4:
            return "dsa" if self.has_dsa_indexer else "mla"
        m = self.layer_ratio(layer)
        return "swa" if m == 0 else ("csa" if m == 4 else "hca")

    def is_hash_layer(self, layer: int) -> bool:
        return self.is_v4 and layer < self.num_hash_layers

    def is_moe_layer(self, layer: int) -> bool:
        if self.is_v4:
            return True
        return layer >= self.first_k_dense_replace and layer % self.moe_layer_freq == 0

    def replace(self, **changes: Any) -> "ModelConfig":
        return dataclasses.replace(self, **changes)

    # ---- construction --------------------------------------------------------------
    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "ModelConfig":
        """Parse a hub `config.json` dict (official or HF form)."""
        mt = d.get("model_type")
        if mt not in MODEL_TYPES:
            raise ConfigError("model_type", f"unsupported model type {mt!r}; expected one of {MODEL_TYPES}")
        return _parse_v4(d) if mt == V4 else _parse_v3(d)

    @classmethod
    def from_pretrained(cls, path_or_dir: str | Path) -> "ModelConfig":
        """Read `config.json` from a checkpoint folder or a file path."""
        p = Path(path_or_dir)
        if p.is_dir():
            p = p / "config.json"
        if not p.is_file():
            raise FileNotFoundError(f"{p}: no config.json here")
        try:
            d = json.loads(p.read_text())
        except json.JSONDecodeError as e:
            raise ConfigError(str(p), f"not valid JSON ({e})") from None
        return cls.from_dict(d)

    @classmethod
    def preset(cls, name: str) -> "ModelConfig":
        from dsv4c.presets import PRESETS

        if name not in PRESETS:
            raise KeyError(f"unknown preset {name!r}; known presets: {', '.join(sorted(PRESETS))}")
        return cls.from_dict(PRESETS[name])

    @classmethod
    def resolve(cls, name_or_path: str | Path) -> "ModelConfig":
        """A preset name, a config.json path, or a checkpoint folder."""
        from dsv4c.presets import PRESETS

        if str(name_or_path) in PRESETS:
            return cls.preset(str(name_or_path))
        if not Path(name_or_path).exists():
            raise FileNotFoundError(f"{name_or_path}: neither a known preset ({', '.join(sorted(PRESETS))}) "
                                    f"nor an existing config.json or checkpoint folder")
        return cls.from_pretrained(name_or_path)

    # ---- serialisation -------------------------------------------------------------
    def to_dict(self) -> dict:
        """The official hub form (what `save_checkpoint` writes as config.json)."""
        return _to_v4_official(self) if self.is_v4 else _to_v3_hf(self)

    def to_hf_dict(self) -> dict:
        """The HF transformers form (`DeepseekV4Config(**d)` etc. accept it)."""
        return _to_v4_hf(self) if self.is_v4 else _to_v3_hf(self)


# ------------------------------------------------------------------------------------
# parsing
# ------------------------------------------------------------------------------------
_ARCH = {V4: "DeepseekV4ForCausalLM", V3: "DeepseekV3ForCausalLM", V32: "DeepseekV32ForCausalLM"}


def _req(d: Mapping[str, Any], key: str) -> Any:
    if key not in d or d[key] is None:
        raise ConfigError(key, "required field is missing")
    return d[key]


def _yarn(rs: Mapping[str, Any] | None, key: str = "rope_scaling") -> YarnScaling | None:
    if not rs:
        return None
    kind = rs.get("type", rs.get("rope_type", "default"))
    if kind == "default":
        return None
    if kind != "yarn":
        raise ConfigError(key, f"only YaRN rope scaling is supported, got type {kind!r}")
    try:
        return YarnScaling(
            factor=float(rs["factor"]),
            original_max_position_embeddings=int(rs["original_max_position_embeddings"]),
            beta_fast=float(rs.get("beta_fast", 32)),
            beta_slow=float(rs.get("beta_slow", 1)),
            mscale=float(rs.get("mscale", 1.0) or 1.0),
            mscale_all_dim=float(rs.get("mscale_all_dim", 0.0) or 0.0),
        )
    except KeyError as e:
        raise ConfigError(f"{key}.{e.args[0]}", "required YaRN field is missing") from None


def _quant(q: Mapping[str, Any] | None) -> FP8Quantization | None:
    if not q:
        return None
    method = q.get("quant_method")
    if method != "fp8":
        raise ConfigError("quantization_config.quant_method", f"unsupported quant method {method!r} (expected 'fp8')")
    return FP8Quantization(
        quant_method="fp8",
        fmt=q.get("fmt", "e4m3"),
        activation_scheme=q.get("activation_scheme", "dynamic"),
        scale_fmt=q.get("scale_fmt"),
        weight_block_size=tuple(q.get("weight_block_size", (128, 128))),
    )


_SHARED_KEYS = (
    "vocab_size hidden_size num_hidden_layers num_attention_heads q_lora_rank moe_intermediate_size "
    "n_routed_experts num_experts_per_tok"
).split()
_OPTIONAL_KEYS = (
    "n_shared_experts num_key_value_heads scoring_func topk_method norm_topk_prob routed_scaling_factor "
    "rope_theta max_position_embeddings rms_norm_eps hidden_act tie_word_embeddings bos_token_id "
    "eos_token_id num_nextn_predict_layers index_n_heads index_head_dim index_topk"
).split()


def _common(d: Mapping[str, Any]) -> dict:
    out = {k: _req(d, k) for k in _SHARED_KEYS}
    for k in _OPTIONAL_KEYS:
        if d.get(k) is not None:
            out[k] = d[k]
    if isinstance(out.get("eos_token_id"), list):
        out["eos_token_id"] = out["eos_token_id"][0]
    out["quantization_config"] = _quant(d.get("quantization_config"))
    return out


def _parse_v4(d: Mapping[str, Any]) -> ModelConfig:
    kw = _common(d)
    n = int(kw["num_hidden_layers"])
    for k in ("head_dim", "o_groups", "o_lora_rank", "sliding_window"):
        kw[k] = _req(d, k)
    for k, default in (("hc_mult", 4), ("hc_sinkhorn_iters", 20), ("hc_eps", 1e-6), ("swiglu_limit", 10.0)):
        kw[k] = d.get(k, default)
    kw["expert_dtype"] = d.get("expert_dtype") or (d.get("quantization_config") or {}).get("expert_dtype")
    kw.setdefault("scoring_func", "sqrtsoftplus")

    # rope: official (rope_theta, compress_rope_theta, rope_scaling) or HF (rope_parameters).
    rp = d.get("rope_parameters")
    if isinstance(rp, dict) and isinstance(rp.get("main"), dict):
        main, comp = rp["main"], rp.get("compress") or {}
        kw["rope_theta"] = float(main.get("rope_theta", d.get("rope_theta", 10000.0)))
        kw["compress_rope_theta"] = float(comp.get("rope_theta", d.get("compress_rope_theta", 160000.0)))
        kw["rope_scaling"] = _yarn(comp, "rope_parameters.compress")
    else:
        kw["compress_rope_theta"] = float(d.get("compress_rope_theta", 160000.0))
        kw["rope_scaling"] = _yarn(d.get("rope_scaling"))
    if d.get("qk_rope_head_dim") is not None:
        kw["qk_rope_head_dim"] = int(d["qk_rope_head_dim"])
    elif d.get("partial_rotary_factor") is not None:
        kw["qk_rope_head_dim"] = int(round(kw["head_dim"] * float(d["partial_rotary_factor"])))
    else:
        kw["qk_rope_head_dim"] = 64

    kw["compress_ratios"] = _v4_ratios(d, n)
    kw["num_hash_layers"] = _v4_hash_layers(d, n)
    return ModelConfig(model_type=V4, **kw)


def _v4_ratios(d: Mapping[str, Any], n: int) -> tuple[int, ...]:
    legacy = d.get("compress_ratios")
    if legacy is not None and len(legacy) not in (n, n + 1):
        raise ConfigError("compress_ratios", f"needs {n} or {n + 1} entries (num_hidden_layers={n}), got {len(legacy)}")
    mtp_ratio = int(legacy[n]) if legacy is not None and len(legacy) == n + 1 else 0
    types = d.get("layer_types")
    if types is None:
        if legacy is None:
            raise ConfigError("compress_ratios", "V4 config has neither compress_ratios nor layer_types")
        return tuple(int(r) for r in legacy[:n]) + (mtp_ratio,)
    if len(types) != n:
        raise ConfigError("layer_types", f"needs num_hidden_layers={n} entries, got {len(types)}")
    rates = {"compressed_sparse_attention": 4, V4_HCA: 128, **(d.get("compress_rates") or {})}
    if int(rates["compressed_sparse_attention"]) != 4:
        raise ConfigError(
            "compress_rates.compressed_sparse_attention",
            f"CSA needs rate 4 (overlap and indexer are defined only for m=4), got {rates['compressed_sparse_attention']}",
        )
    ratios = []
    for i, t in enumerate(types):
        if t == "sliding_attention":
            ratios.append(0)
        elif t in rates:
            ratios.append(int(rates[t]))
        else:
            raise ConfigError(f"layer_types[{i}]", f"unknown layer type {t!r}")
    return tuple(ratios) + (mtp_ratio,)


def _v4_hash_layers(d: Mapping[str, Any], n: int) -> int:
    mlp_types = d.get("mlp_layer_types")
    if mlp_types is None:
        return int(d.get("num_hash_layers", 3))
    if len(mlp_types) != n:
        raise ConfigError("mlp_layer_types", f"needs num_hidden_layers={n} entries, got {len(mlp_types)}")
    k = sum(1 for t in mlp_types if t == "hash_moe")
    if list(mlp_types) != ["hash_moe"] * k + ["moe"] * (n - k):
        raise ConfigError("mlp_layer_types", "hash_moe layers must come first, followed only by moe layers")
    return k


def _parse_v3(d: Mapping[str, Any]) -> ModelConfig:
    kw = _common(d)
    for k in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "intermediate_size"):
        kw[k] = _req(d, k)
    for k, default in (("first_k_dense_replace", 0), ("moe_layer_freq", 1), ("n_group", 1), ("topk_group", 1)):
        kw[k] = d.get(k, default) if d.get(k) is not None else default
    kw.setdefault("scoring_func", "sigmoid")
    rs = d.get("rope_scaling")
    if rs is None and isinstance(d.get("rope_parameters"), dict):
        rs = d["rope_parameters"]
        if rs.get("rope_theta") is not None:
            kw["rope_theta"] = float(rs["rope_theta"])
    kw["rope_scaling"] = _yarn(rs)
    kw["mtp_zero_embed_at_pos0"] = bool(d.get("mtp_zero_embed_at_pos0", True))
    mt = d["model_type"]
    if mt == V32:
        for k in ("index_n_heads", "index_head_dim", "index_topk"):
            _req(d, k)
    if kw.get("q_lora_rank") is None:
        raise ConfigError("q_lora_rank", "q_lora_rank=None (V2-Lite style) is not supported")
    return ModelConfig(model_type=mt, **kw)


# ------------------------------------------------------------------------------------
# validation
# ------------------------------------------------------------------------------------
def _positive(c: ModelConfig, *names: str) -> None:
    for f in names:
        v = getattr(c, f)
        if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
            raise ConfigError(f, f"must be a positive integer, got {v!r}")


def _validate(c: ModelConfig) -> None:
    if c.model_type not in MODEL_TYPES:
        raise ConfigError("model_type", f"unsupported model type {c.model_type!r}")
    _positive(c, "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "q_lora_rank",
              "qk_rope_head_dim", "moe_intermediate_size", "n_routed_experts", "num_experts_per_tok")
    if c.qk_rope_head_dim % 2:
        raise ConfigError("qk_rope_head_dim", f"must be even (RoPE rotates pairs), got {c.qk_rope_head_dim}")
    if c.num_experts_per_tok > c.n_routed_experts:
        raise ConfigError("num_experts_per_tok", f"{c.num_experts_per_tok} > n_routed_experts={c.n_routed_experts}")
    if c.num_nextn_predict_layers not in (0, 1):
        raise ConfigError("num_nextn_predict_layers", f"only 0 or 1 MTP module is supported, got {c.num_nextn_predict_layers}")
    if c.hidden_act != "silu":
        raise ConfigError("hidden_act", f"only silu is supported, got {c.hidden_act!r}")
    if c.bos_token_id is not None and not 0 <= c.bos_token_id < c.vocab_size:
        raise ConfigError("bos_token_id", f"{c.bos_token_id} outside vocab_size={c.vocab_size}")
    (_validate_v4 if c.is_v4 else _validate_v3)(c)


def _validate_v4(c: ModelConfig) -> None:
    _positive(c, "head_dim", "o_groups", "o_lora_rank", "sliding_window", "hc_mult", "hc_sinkhorn_iters")
    if c.scoring_func != "sqrtsoftplus":
        raise ConfigError("scoring_func", f"V4 routes with sqrtsoftplus, got {c.scoring_func!r}")
    if c.qk_rope_head_dim > c.head_dim:
        raise ConfigError("qk_rope_head_dim", f"{c.qk_rope_head_dim} > head_dim={c.head_dim}")
    if c.num_key_value_heads != 1:
        raise ConfigError("num_key_value_heads", f"V4 has one shared K=V head, got {c.num_key_value_heads}")
    if c.num_attention_heads % c.o_groups:
        raise ConfigError("o_groups", f"{c.o_groups} does not divide num_attention_heads={c.num_attention_heads}")
    n = c.num_hidden_layers
    if len(c.compress_ratios) != n + 1:
        raise ConfigError("compress_ratios", f"needs {n + 1} entries (layers + MTP), got {len(c.compress_ratios)}")
    for i, m in enumerate(c.compress_ratios):
        if m < 0 or m == 1:
            raise ConfigError(f"compress_ratios[{i}]", f"ratio must be 0 (SWA), 4 (CSA) or >1 (HCA), got {m}")
    if not 0 <= c.num_hash_layers <= n:
        raise ConfigError("num_hash_layers", f"must be in [0, {n}], got {c.num_hash_layers}")
    if c.n_shared_experts != 1:
        raise ConfigError("n_shared_experts", f"V4 has exactly one shared expert, got {c.n_shared_experts}")
    if any(m == 4 for m in c.compress_ratios):
        _positive(c, "index_n_heads", "index_head_dim", "index_topk")
        if c.qk_rope_head_dim > c.index_head_dim:
            raise ConfigError("index_head_dim", f"{c.index_head_dim} < qk_rope_head_dim={c.qk_rope_head_dim}")
    if c.expert_dtype not in (None, "fp4", "fp8", "bf16"):
        raise ConfigError("expert_dtype", f"expected fp4, fp8 or bf16, got {c.expert_dtype!r}")


def _validate_v3(c: ModelConfig) -> None:
    _positive(c, "kv_lora_rank", "qk_nope_head_dim", "v_head_dim", "intermediate_size", "n_group", "topk_group",
              "moe_layer_freq")
    if c.scoring_func != "sigmoid":
        raise ConfigError("scoring_func", f"V3 routes with sigmoid, got {c.scoring_func!r}")
    if c.n_routed_experts % c.n_group:
        raise ConfigError("n_group", f"{c.n_group} does not divide n_routed_experts={c.n_routed_experts}")
    if c.topk_group > c.n_group:
        raise ConfigError("topk_group", f"{c.topk_group} > n_group={c.n_group}")
    per_group = c.n_routed_experts // c.n_group
    if per_group < 2:
        raise ConfigError("n_group", "each expert group needs at least 2 experts (group score = sum of top-2)")
    if c.num_experts_per_tok > c.topk_group * per_group:
        raise ConfigError("num_experts_per_tok", f"{c.num_experts_per_tok} > topk_group*experts_per_group")
    if not 0 <= c.first_k_dense_replace <= c.num_hidden_layers:
        raise ConfigError("first_k_dense_replace", f"must be in [0, {c.num_hidden_layers}]")
    if c.model_type == V32:
        _positive(c, "index_n_heads", "index_head_dim", "index_topk")
        if c.qk_rope_head_dim > c.index_head_dim:
            raise ConfigError("index_head_dim", f"{c.index_head_dim} < qk_rope_head_dim={c.qk_rope_head_dim}")


# ------------------------------------------------------------------------------------
# writing
# ------------------------------------------------------------------------------------
def _shared_out(c: ModelConfig) -> dict:
    d = {"architectures": [_ARCH[c.model_type]], "model_type": c.model_type}
    for k in _SHARED_KEYS + _OPTIONAL_KEYS:
        d[k] = getattr(c, k)
    if c.quantization_config is not None:
        d["quantization_config"] = c.quantization_config.to_dict()
    return d


def _v4_fields(c: ModelConfig) -> dict:
    keys = "head_dim o_groups o_lora_rank sliding_window hc_mult hc_sinkhorn_iters hc_eps swiglu_limit".split()
    d = {k: getattr(c, k) for k in keys}
    if c.expert_dtype is not None:
        d["expert_dtype"] = c.expert_dtype
    return d


def _to_v4_official(c: ModelConfig) -> dict:
    d = _shared_out(c)
    d.update(_v4_fields(c))
    d["qk_rope_head_dim"] = c.qk_rope_head_dim
    d["compress_ratios"] = list(c.compress_ratios)
    d["compress_rope_theta"] = c.compress_rope_theta
    d["num_hash_layers"] = c.num_hash_layers
    if c.rope_scaling is not None:
        rs = c.rope_scaling.to_dict()
        rs.pop("mscale"), rs.pop("mscale_all_dim")
        d["rope_scaling"] = rs
    return d


def _to_v4_hf(c: ModelConfig) -> dict:
    d = _to_v4_official(c)
    n = c.num_hidden_layers
    hca = sorted({m for m in c.compress_ratios[:n] if m not in (0, 4)})
    if len(hca) > 1:
        raise ConfigError("compress_ratios", f"HF form allows one HCA rate, this config has {hca}")
    d.pop("compress_ratios")
    d["layer_types"] = [V4_LAYER_TYPE_OF_RATIO.get(m, V4_HCA) for m in c.compress_ratios[:n]]
    d["compress_rates"] = {"compressed_sparse_attention": 4, V4_HCA: hca[0] if hca else 128}
    d["mlp_layer_types"] = ["hash_moe"] * c.num_hash_layers + ["moe"] * (n - c.num_hash_layers)
    d.pop("num_hash_layers")
    return d


def _to_v3_hf(c: ModelConfig) -> dict:
    d = _shared_out(c)
    for k in ("kv_lora_rank qk_nope_head_dim qk_rope_head_dim v_head_dim intermediate_size first_k_dense_replace "
              "moe_layer_freq n_group topk_group").split():
        d[k] = getattr(c, k)
    d["num_key_value_heads"] = c.num_attention_heads if c.num_key_value_heads == 1 else c.num_key_value_heads
    d["mtp_zero_embed_at_pos0"] = c.mtp_zero_embed_at_pos0  # a dsv4c option, kept so that configs round-trip
    if c.rope_scaling is not None:
        d["rope_scaling"] = c.rope_scaling.to_dict()
    if c.model_type != V32:
        for k in ("index_n_heads", "index_head_dim", "index_topk"):
            d.pop(k, None)
    return d
