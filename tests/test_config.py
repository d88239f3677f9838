"""ModelConfig: presets, the official and HF config forms (deepseek_v4.md §1), YaRN (§3.1), validation
errors, and parameter counts of the released models (checked against a count written from §2.2)."""
from __future__ import annotations

import copy
import json
import math

import pytest
import torch

from dsv4c import ConfigError, ModelConfig, build_model
from dsv4c.model import count_parameters
from dsv4c.model.common import rope_inv_freq
from dsv4c.presets import PRESETS

V4_PRESETS = [p for p in PRESETS if PRESETS[p]["model_type"] == "deepseek_v4"]
HF_KEYS = ("layer_types", "compress_rates", "mlp_layer_types")  # the HF-only keys of the tiny presets


def official_form(preset: str) -> dict:
    """A preset as the hub writes it: legacy keys only (compress_ratios n+1, num_hash_layers, rope_scaling)."""
    d = copy.deepcopy(PRESETS[preset])
    for k in HF_KEYS:
        d.pop(k, None)
    return d


def hf_config_dict_via_save_pretrained(hf_cfg, tmp_path) -> dict:
    hf_cfg.save_pretrained(tmp_path)
    return json.loads((tmp_path / "config.json").read_text())


# ------------------------------------------------------------------------------------------------
# presets and round trips
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_preset_round_trips_through_both_forms(preset):
    cfg = ModelConfig.preset(preset)
    assert cfg.model_type == PRESETS[preset]["model_type"]
    assert cfg.hidden_size == PRESETS[preset]["hidden_size"]
    for d in (cfg.to_dict(), cfg.to_hf_dict()):
        d = json.loads(json.dumps(d))  # what config.json holds
        assert ModelConfig.from_dict(d) == cfg
    if cfg.is_v4:
        assert "compress_ratios" in cfg.to_dict() and "layer_types" not in cfg.to_dict()
        assert "layer_types" in cfg.to_hf_dict() and "compress_ratios" not in cfg.to_hf_dict()


@pytest.mark.parametrize("preset", V4_PRESETS)
def test_official_form_equals_preset(preset):
    """The tiny presets carry both forms; the legacy keys alone must give the same config."""
    assert ModelConfig.from_dict(official_form(preset)) == ModelConfig.preset(preset)


def test_preset_facts_of_flash_and_pro():
    flash, pro = ModelConfig.preset("v4-flash"), ModelConfig.preset("v4-pro")
    assert len(flash.compress_ratios) == 44 and len(pro.compress_ratios) == 62
    assert [flash.layer_kind(i) for i in range(4)] == ["swa", "swa", "csa", "hca"]
    assert [pro.layer_kind(i) for i in range(4)] == ["hca", "hca", "csa", "hca"]
    assert flash.layer_kind(43) == "swa" and pro.layer_kind(61) == "swa"  # MTP
    assert [flash.is_hash_layer(i) for i in range(4)] == [True, True, True, False]
    assert flash.expert_dtype == "fp4" and pro.expert_dtype is None
    assert flash.rope_scaling.factor == 16 and flash.rope_scaling.original_max_position_embeddings == 65536


@pytest.mark.parametrize("preset", V4_PRESETS)
def test_hf_accepts_our_hf_form_and_derives_the_same_layers(preset):
    from transformers import DeepseekV4Config

    cfg = ModelConfig.preset(preset)
    hc = DeepseekV4Config(**cfg.to_hf_dict())
    n = cfg.num_hidden_layers
    kind_to_hf = {"swa": "sliding_attention", "csa": "compressed_sparse_attention",
                  "hca": "heavily_compressed_attention"}
    assert list(hc.layer_types) == [kind_to_hf[cfg.layer_kind(i)] for i in range(n)]
    assert list(hc.mlp_layer_types) == ["hash_moe" if cfg.is_hash_layer(i) else "moe" for i in range(n)]
    for i, t in enumerate(hc.layer_types):  # HF's rate of each layer is our ratio
        assert (0 if t == "sliding_attention" else hc.compress_rates[t]) == cfg.layer_ratio(i)
    assert hc.compress_rope_theta == cfg.compress_rope_theta
    assert hc.qk_rope_head_dim == cfg.qk_rope_head_dim


@pytest.mark.parametrize("preset", ["v4-flash", "v4-pro", "v4-tiny-c"])
def test_hf_to_dict_of_official_config_parses_to_the_same_config(preset):
    """HF converts the legacy keys itself (release ratios 0/4/128 only) and saves only the new form."""
    from transformers import DeepseekV4Config

    off = official_form(preset)
    hf = json.loads(json.dumps(DeepseekV4Config(**off).to_dict()))
    assert "layer_types" in hf and "rope_parameters" in hf
    assert "compress_ratios" not in hf and "num_hash_layers" not in hf and "rope_scaling" not in hf
    assert ModelConfig.from_dict(hf) == ModelConfig.from_dict(off) == ModelConfig.preset(preset)


@pytest.mark.parametrize("preset", ["v4-tiny-a", "v4-tiny-b"])
def test_hf_save_pretrained_config_parses_to_the_same_config(preset, tmp_path):
    """HCA rates 8 and 16 exist only in the HF form; go through save_pretrained's config.json."""
    from transformers import DeepseekV4Config

    cfg = ModelConfig.preset(preset)
    d = hf_config_dict_via_save_pretrained(DeepseekV4Config(**cfg.to_hf_dict()), tmp_path)
    assert d["compress_rates"]["heavily_compressed_attention"] == max(cfg.compress_ratios)
    assert isinstance(d["rope_parameters"].get("compress"), dict)
    assert ModelConfig.from_pretrained(tmp_path) == cfg
    assert ModelConfig.from_pretrained(tmp_path / "config.json") == cfg


def test_layer_types_win_and_mtp_ratio_comes_from_the_legacy_list():
    d = official_form("v4-tiny-c")  # compress_ratios [0, 4, 128, 4, 0]
    d["compress_ratios"] = [0, 4, 128, 4, 16]  # an official MTP ratio (n+1-th entry)
    d["layer_types"] = ["heavily_compressed_attention", "sliding_attention", "compressed_sparse_attention",
                        "heavily_compressed_attention"]
    d["compress_rates"] = {"compressed_sparse_attention": 4, "heavily_compressed_attention": 16}
    cfg = ModelConfig.from_dict(d)
    assert cfg.compress_ratios == (16, 0, 4, 16, 16)
    d.pop("compress_ratios")
    assert ModelConfig.from_dict(d).compress_ratios == (16, 0, 4, 16, 0)  # MTP defaults to SWA
    d.pop("compress_rates")
    assert ModelConfig.from_dict(d).compress_ratios == (128, 0, 4, 128, 0)  # HF's default HCA rate


def test_mlp_layer_types_give_num_hash_layers():
    d = official_form("v4-tiny-c")
    d["num_hash_layers"] = 3
    d["mlp_layer_types"] = ["hash_moe", "hash_moe", "moe", "moe"]  # wins over num_hash_layers
    assert ModelConfig.from_dict(d).num_hash_layers == 2
    d["mlp_layer_types"] = ["moe"] * 4
    assert ModelConfig.from_dict(d).num_hash_layers == 0


def test_rope_parameters_form_is_read():
    d = ModelConfig.preset("v4-tiny-c").to_hf_dict()
    d.pop("rope_scaling")
    d["compress_rope_theta"] = 1.0  # must be ignored: rope_parameters win
    d["rope_parameters"] = {
        "main": {"rope_type": "default", "rope_theta": 5000.0, "partial_rotary_factor": 0.25},
        "compress": {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 4096,
                     "beta_fast": 16.0, "beta_slow": 2.0, "rope_theta": 20000.0, "attention_factor": 1.0},
    }
    cfg = ModelConfig.from_dict(d)
    assert cfg.rope_theta == 5000.0 and cfg.compress_rope_theta == 20000.0
    y = cfg.rope_scaling
    assert (y.factor, y.original_max_position_embeddings, y.beta_fast, y.beta_slow) == (8.0, 4096, 16.0, 2.0)


# ------------------------------------------------------------------------------------------------
# YaRN (§3.1)
# ------------------------------------------------------------------------------------------------
def _spec_lo_hi(rho: int, theta: float, L0: int, beta_fast: float, beta_slow: float) -> tuple[int, int]:
    def corr(b):
        return rho * math.log(L0 / (2 * math.pi * b)) / (2 * math.log(theta))

    return max(math.floor(corr(beta_fast)), 0), min(math.ceil(corr(beta_slow)), rho - 1)


@pytest.mark.parametrize("preset,lo,hi", [("v4-flash", 15, 25), ("v4-pro", 15, 25), ("v4-tiny-a", 3, 7)])
def test_yarn_ramp_boundaries(preset, lo, hi):
    cfg = ModelConfig.preset(preset)
    rho, theta, y = cfg.qk_rope_head_dim, cfg.compress_rope_theta, cfg.rope_scaling
    assert _spec_lo_hi(rho, theta, y.original_max_position_embeddings, y.beta_fast, y.beta_slow) == (lo, hi)
    f = rope_inv_freq(rho, theta, y).double()
    i = torch.arange(rho // 2, dtype=torch.float64)
    base = theta ** (-2 * i / rho)  # unscaled frequencies, computed independently in fp64
    ratio = f / base
    ramp = ((i - lo) / (hi - lo)).clamp(0, 1)
    expected = 1 - ramp * (1 - 1 / y.factor)
    torch.testing.assert_close(ratio, expected, rtol=2e-6, atol=0)
    assert torch.allclose(ratio[: lo + 1], torch.ones(lo + 1, dtype=torch.float64), rtol=1e-6, atol=0)
    assert torch.allclose(ratio[hi:], torch.full((rho // 2 - hi,), 1 / y.factor, dtype=torch.float64), rtol=1e-6)
    between = ratio[lo + 1 : hi]
    assert ((between < 1 - 1e-3) & (between > 1 / y.factor + 1e-3)).all()


def test_rope_without_yarn_is_plain_and_model_uses_the_right_tables():
    cfg = ModelConfig.preset("v4-tiny-a")  # layers SWA, CSA, HCA, CSA; MTP SWA
    rho = cfg.qk_rope_head_dim
    plain = 10000.0 ** (-torch.arange(0, rho, 2, dtype=torch.float64) / rho)
    torch.testing.assert_close(rope_inv_freq(rho, cfg.rope_theta, None).double(), plain, rtol=1e-6, atol=0)
    model = build_model(cfg)
    main = rope_inv_freq(rho, cfg.rope_theta, None)
    comp = rope_inv_freq(rho, cfg.compress_rope_theta, cfg.rope_scaling)
    assert not torch.allclose(main, comp)
    for i, block in enumerate(model.layers):
        want = main if cfg.layer_ratio(i) == 0 else comp
        assert torch.equal(block.attn.rope.inv_freq.cpu(), want), i
    assert torch.equal(model.mtp[0].attn.rope.inv_freq, main)


# ------------------------------------------------------------------------------------------------
# errors
# ------------------------------------------------------------------------------------------------
_DROP = object()
ERROR_CASES = [
    # (id, preset, changes, field the error must name)
    ("unknown_model_type", "v4-tiny-c", {"model_type": "llama"}, "model_type"),
    ("missing_model_type", "v4-tiny-c", {"model_type": _DROP}, "model_type"),
    ("missing_hidden_size", "v4-tiny-c", {"hidden_size": _DROP}, "hidden_size"),
    ("missing_head_dim", "v4-tiny-c", {"head_dim": _DROP}, "head_dim"),
    ("v3_missing_kv_lora_rank", "v3-tiny", {"kv_lora_rank": _DROP}, "kv_lora_rank"),
    ("compress_ratios_short", "v4-tiny-c", {"compress_ratios": [0, 4, 128]}, "compress_ratios"),
    ("compress_ratios_long", "v4-tiny-c", {"compress_ratios": [0, 4, 128, 4, 0, 0]}, "compress_ratios"),
    ("compress_ratio_one", "v4-tiny-c", {"compress_ratios": [0, 1, 128, 4, 0]}, "compress_ratios[1]"),
    ("no_layer_pattern", "v4-tiny-c", {"compress_ratios": _DROP}, "compress_ratios"),
    ("csa_rate_not_4", "v4-tiny-a",
     {"compress_rates": {"compressed_sparse_attention": 8, "heavily_compressed_attention": 8}},
     "compress_rates.compressed_sparse_attention"),
    ("unknown_layer_type", "v4-tiny-a",
     {"layer_types": ["sliding_attention", "full_attention", "heavily_compressed_attention",
                      "compressed_sparse_attention"]}, "layer_types[1]"),
    ("layer_types_length", "v4-tiny-a", {"layer_types": ["sliding_attention"] * 3}, "layer_types"),
    ("hash_moe_after_moe", "v4-tiny-a", {"mlp_layer_types": ["hash_moe", "moe", "hash_moe", "moe"]},
     "mlp_layer_types"),
    ("mlp_layer_types_length", "v4-tiny-a", {"mlp_layer_types": ["hash_moe", "moe", "moe"]}, "mlp_layer_types"),
    ("o_groups_not_dividing_heads", "v4-tiny-c", {"o_groups": 3}, "o_groups"),
    ("topk_above_experts", "v4-tiny-c", {"num_experts_per_tok": 9}, "num_experts_per_tok"),
    ("rope_scaling_linear", "v4-tiny-c", {"rope_scaling": {"type": "linear", "factor": 2.0}}, "rope_scaling"),
    ("rope_parameters_linear", "v4-tiny-c",
     {"rope_parameters": {"main": {"rope_type": "default", "rope_theta": 1e4},
                          "compress": {"rope_type": "linear", "factor": 2.0}}}, "rope_parameters.compress"),
    ("yarn_without_original_max", "v4-tiny-c", {"rope_scaling": {"type": "yarn", "factor": 4.0}},
     "rope_scaling.original_max_position_embeddings"),
    ("v3_n_group_not_dividing_experts", "v3-tiny", {"n_group": 3}, "n_group"),
    ("v3_topk_group_above_n_group", "v3-tiny", {"topk_group": 5}, "topk_group"),
    ("num_hash_layers_too_many", "v4-tiny-c", {"num_hash_layers": 5}, "num_hash_layers"),
    ("kv_heads_not_one", "v4-tiny-c", {"num_key_value_heads": 4}, "num_key_value_heads"),
    ("two_mtp_layers", "v4-tiny-c", {"num_nextn_predict_layers": 2}, "num_nextn_predict_layers"),
    ("odd_rope_dim", "v4-tiny-c", {"qk_rope_head_dim": 15}, "qk_rope_head_dim"),
    ("hidden_size_string", "v4-tiny-c", {"hidden_size": "64"}, "hidden_size"),
    ("unknown_quant_method", "v4-tiny-c", {"quantization_config": {"quant_method": "gptq"}},
     "quantization_config.quant_method"),
    ("bad_expert_dtype", "v4-tiny-c", {"expert_dtype": "int4"}, "expert_dtype"),
]


@pytest.mark.parametrize("preset,changes,field", [c[1:] for c in ERROR_CASES], ids=[c[0] for c in ERROR_CASES])
def test_config_error_names_the_field(preset, changes, field):
    d = copy.deepcopy(PRESETS[preset])
    for k, v in changes.items():
        if v is _DROP:
            d.pop(k, None)
        else:
            d[k] = v
    ModelConfig.from_dict(copy.deepcopy(PRESETS[preset]))  # the unchanged preset parses
    with pytest.raises(ConfigError) as ei:
        ModelConfig.from_dict(d)
    assert ei.value.field == field
    assert str(ei.value).startswith(f"{field}: ")


def test_from_pretrained_without_config_json(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match=str(tmp_path)):
        ModelConfig.from_pretrained(tmp_path)


def test_from_pretrained_with_invalid_json_names_the_file(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "deepseek_v4",')
    with pytest.raises(ConfigError) as ei:
        ModelConfig.from_pretrained(tmp_path)
    assert "config.json" in ei.value.field


def test_unknown_preset():
    with pytest.raises(KeyError, match="v4-tiny-a"):  # the message lists the known presets
        ModelConfig.preset("v4-huge")
    with pytest.raises(FileNotFoundError, match="v4-huge.*preset"):
        ModelConfig.resolve("v4-huge")


# ------------------------------------------------------------------------------------------------
# parameter counts
# ------------------------------------------------------------------------------------------------
def spec_counts(preset: str) -> tuple[int, int, int]:
    """(total, active, mtp) from the tensor table of deepseek_v4.md §2.2 and §6, written independently."""
    c = PRESETS[preset]
    D, V, H, d, Q = c["hidden_size"], c["vocab_size"], c["num_attention_heads"], c["head_dim"], c["q_lora_rank"]
    G, R, N = c["o_groups"], c["o_lora_rank"], c["hc_mult"]
    E, K, I = c["n_routed_experts"], c["num_experts_per_tok"], c["moe_intermediate_size"]
    HI, dI = c["index_n_heads"], c["index_head_dim"]
    mix = (2 + N) * N

    def layer(m: int, hashed: bool) -> int:
        x = 2 * D + 2 * (mix * N * D + mix + 3) + H  # norms, hc_attn/hc_ffn, sinks
        x += Q * D + Q + H * d * Q + d * D + d + G * R * (H * d // G) + D * G * R
        if m:
            cm = 2 if m == 4 else 1
            x += m * cm * d + 2 * cm * d * D + d
        if m == 4:
            x += HI * dI * Q + HI * D + 4 * 2 * dI + 2 * 2 * dI * D + dI
        x += E * D + (0 if hashed else E) + 3 * I * D  # gate (tid2eid is a buffer), shared expert
        return x

    n = c["num_hidden_layers"]
    top = 2 * V * D + D + N * N * D + N + 1
    routed = 3 * I * D
    total = top + sum(layer(c["compress_ratios"][i], i < c["num_hash_layers"]) + E * routed for i in range(n))
    active = top + sum(layer(c["compress_ratios"][i], i < c["num_hash_layers"]) + K * routed for i in range(n))
    mtp = layer(0, False) + E * routed + 2 * D * D + 3 * D + N * N * D + N + 1
    return total, active, mtp


@pytest.mark.parametrize("preset", ["v4-flash", "v4-pro", "v4-flash-slice", "v4-tiny-a", "v4-tiny-b"])
def test_parameter_counts_match_the_tensor_table(preset):
    counts = count_parameters(build_model(ModelConfig.preset(preset), device="meta"))
    assert (counts["total"], counts["active"], counts["mtp"]) == spec_counts(preset)


@pytest.mark.parametrize("preset,total,active", [
    ("v4-flash", 284e9, 13.8e9),        # published: 284B total, 13B active
    ("v4-pro", 1.573e12, 49.8e9),       # published: 1.6T total, 49B active
    ("v4-flash-slice", 27.4e9, None),   # benchmark.md: 27.4B
])
def test_parameter_counts_match_published_sizes(preset, total, active):
    model = build_model(ModelConfig.preset(preset), device="meta")
    assert all(p.is_meta for p in model.parameters())
    counts = count_parameters(model)
    assert counts["total"] == pytest.approx(total, rel=0.01)
    if active is not None:
        assert counts["active"] == pytest.approx(active, rel=0.02)
    if preset == "v4-flash":
        assert 13e9 <= counts["active"] < 14e9
    if preset == "v4-pro":
        assert 1.55e12 < counts["total"] < 1.65e12 and 49e9 <= counts["active"] < 50e9


def test_dsv4c_options_round_trip():
    cfg = ModelConfig.preset("v3-tiny").replace(mtp_zero_embed_at_pos0=False)
    assert ModelConfig.from_dict(cfg.to_dict()) == cfg
    assert ModelConfig.from_dict(ModelConfig.preset("v3-tiny").to_dict()).mtp_zero_embed_at_pos0  # V3 default on
