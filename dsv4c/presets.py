"""Named configs: the released models, the benchmark slice, and tiny test models.

Values for the released models come from deepseek_v4.md §0-1 and deepseek_v3_mla.md §1; the tiny
configs are those of deepseek_v4.md §8 and deepseek_v3_mla.md §9.
"""
from __future__ import annotations

_V4_SHARED = {
    "model_type": "deepseek_v4", "architectures": ["DeepseekV4ForCausalLM"],
    "num_key_value_heads": 1, "n_shared_experts": 1, "scoring_func": "sqrtsoftplus", "topk_method": "noaux_tc",
    "norm_topk_prob": True, "hc_mult": 4, "hc_sinkhorn_iters": 20, "hc_eps": 1e-6, "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0, "compress_rope_theta": 160000.0, "max_position_embeddings": 1048576,
    "num_nextn_predict_layers": 1, "tie_word_embeddings": False, "bos_token_id": 0, "eos_token_id": 1,
    "hidden_act": "silu",
    "rope_scaling": {"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536,
                     "beta_fast": 32, "beta_slow": 1},
}
_V4_QUANT = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "scale_fmt": "ue8m0",
             "weight_block_size": [128, 128]}

V4_FLASH = {
    **_V4_SHARED, "vocab_size": 129280, "hidden_size": 4096, "num_hidden_layers": 43, "num_attention_heads": 64,
    "head_dim": 512, "qk_rope_head_dim": 64, "q_lora_rank": 1024, "o_groups": 8, "o_lora_rank": 1024,
    "sliding_window": 128, "compress_ratios": [0, 0] + [4, 128] * 20 + [4] + [0], "num_hash_layers": 3,
    "n_routed_experts": 256, "num_experts_per_tok": 6, "moe_intermediate_size": 2048,
    "routed_scaling_factor": 1.5, "swiglu_limit": 10.0, "index_n_heads": 64, "index_head_dim": 128,
    "index_topk": 512, "expert_dtype": "fp4", "quantization_config": _V4_QUANT,
}
V4_PRO = {
    **_V4_SHARED, "vocab_size": 129280, "hidden_size": 7168, "num_hidden_layers": 61, "num_attention_heads": 128,
    "head_dim": 512, "qk_rope_head_dim": 64, "q_lora_rank": 1536, "o_groups": 16, "o_lora_rank": 1024,
    "sliding_window": 128, "compress_ratios": [128, 128] + [4, 128] * 29 + [4] + [0], "num_hash_layers": 3,
    "n_routed_experts": 384, "num_experts_per_tok": 6, "moe_intermediate_size": 3072,
    "routed_scaling_factor": 2.5, "swiglu_limit": 10.0, "index_n_heads": 64, "index_head_dim": 128,
    "index_topk": 1024, "quantization_config": _V4_QUANT,
}
# benchmark.md: V4-Flash per-layer dimensions, 4 layers SWA/CSA/HCA/CSA, one hash layer, MTP.
V4_FLASH_SLICE = {**V4_FLASH, "num_hidden_layers": 4, "compress_ratios": [0, 4, 128, 4, 0], "num_hash_layers": 1}

_V4_TINY_SHARED = {**_V4_SHARED}
V4_TINY_A = {
    **_V4_TINY_SHARED, "vocab_size": 256, "hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4,
    "head_dim": 64, "qk_rope_head_dim": 16, "q_lora_rank": 32, "o_groups": 2, "o_lora_rank": 16,
    "sliding_window": 8,
    "layer_types": ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
                    "compressed_sparse_attention"],
    "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
    "compress_ratios": [0, 4, 8, 4, 0], "num_hash_layers": 2, "mlp_layer_types": ["hash_moe", "hash_moe", "moe", "moe"],
    "index_n_heads": 16, "index_head_dim": 32, "index_topk": 2,
    "n_routed_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "routed_scaling_factor": 1.5,
    "swiglu_limit": 0.3,
}
V4_TINY_B = {
    **_V4_TINY_SHARED, "vocab_size": 512, "hidden_size": 128, "num_hidden_layers": 5, "num_attention_heads": 4,
    "head_dim": 128, "qk_rope_head_dim": 64, "q_lora_rank": 64, "o_groups": 2, "o_lora_rank": 32,
    "sliding_window": 16,
    "layer_types": ["heavily_compressed_attention", "heavily_compressed_attention", "compressed_sparse_attention",
                    "heavily_compressed_attention", "compressed_sparse_attention"],
    "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 16},
    "compress_ratios": [16, 16, 4, 16, 4, 0], "num_hash_layers": 3,
    "mlp_layer_types": ["hash_moe", "hash_moe", "hash_moe", "moe", "moe"],
    "index_n_heads": 16, "index_head_dim": 64, "index_topk": 4,
    "n_routed_experts": 16, "num_experts_per_tok": 4, "moe_intermediate_size": 128, "routed_scaling_factor": 2.5,
    "swiglu_limit": 10.0,
}
V4_TINY_C = {
    **_V4_TINY_SHARED, "vocab_size": 256, "hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4,
    "head_dim": 64, "qk_rope_head_dim": 16, "q_lora_rank": 32, "o_groups": 2, "o_lora_rank": 16,
    "sliding_window": 128, "compress_ratios": [0, 4, 128, 4, 0], "num_hash_layers": 1,
    "index_n_heads": 16, "index_head_dim": 32, "index_topk": 8,
    "n_routed_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "routed_scaling_factor": 1.5,
    "swiglu_limit": 10.0,
}

_V3_YARN = {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "beta_fast": 32, "beta_slow": 1,
            "mscale": 1.0, "mscale_all_dim": 1.0}
V3 = {
    "model_type": "deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"],
    "vocab_size": 129280, "hidden_size": 7168, "num_hidden_layers": 61, "num_attention_heads": 128,
    "num_key_value_heads": 128, "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64, "v_head_dim": 128, "intermediate_size": 18432, "first_k_dense_replace": 3,
    "moe_layer_freq": 1, "moe_intermediate_size": 2048, "n_routed_experts": 256, "n_shared_experts": 1,
    "num_experts_per_tok": 8, "n_group": 8, "topk_group": 4, "scoring_func": "sigmoid", "topk_method": "noaux_tc",
    "norm_topk_prob": True, "routed_scaling_factor": 2.5, "num_nextn_predict_layers": 1, "rope_theta": 10000.0,
    "max_position_embeddings": 163840, "rope_scaling": _V3_YARN, "rms_norm_eps": 1e-6, "hidden_act": "silu",
    "tie_word_embeddings": False, "bos_token_id": 0, "eos_token_id": 1,
    "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                            "weight_block_size": [128, 128]},
}
V32 = {**V3, "model_type": "deepseek_v32", "architectures": ["DeepseekV32ForCausalLM"],
       "index_n_heads": 64, "index_head_dim": 128, "index_topk": 2048,
       "quantization_config": {**V3["quantization_config"], "scale_fmt": "ue8m0"}}

V3_TINY = {
    "model_type": "deepseek_v3", "vocab_size": 256, "hidden_size": 64, "intermediate_size": 96,
    "moe_intermediate_size": 32, "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 4,
    "q_lora_rank": 32, "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16,
    "n_routed_experts": 16, "n_shared_experts": 1, "num_experts_per_tok": 4, "n_group": 4, "topk_group": 2,
    "first_k_dense_replace": 1, "routed_scaling_factor": 2.5, "norm_topk_prob": True,
    "max_position_embeddings": 163840, "rope_theta": 10000.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
    "scoring_func": "sigmoid", "topk_method": "noaux_tc", "num_nextn_predict_layers": 1,
    "rope_scaling": _V3_YARN, "bos_token_id": 0, "eos_token_id": 1,
}
V32_TINY = {**V3_TINY, "model_type": "deepseek_v32", "index_n_heads": 16, "index_head_dim": 16, "index_topk": 6}

PRESETS: dict[str, dict] = {
    "v4-flash": V4_FLASH,
    "v4-pro": V4_PRO,
    "v4-flash-slice": V4_FLASH_SLICE,
    "v4-tiny-a": V4_TINY_A,
    "v4-tiny-b": V4_TINY_B,
    "v4-tiny-c": V4_TINY_C,
    "v3": V3,
    "v32": V32,
    "v3-tiny": V3_TINY,
    "v32-tiny": V32_TINY,
}
