"""The shard pass on tiny V3.2 (MLA heads, the DSA indexer replicated, a dense layer, MTP): plan (2, 2) on
gloo computes the single-process logits. Slow (about a minute on two loaded cores): its own file."""
from __future__ import annotations

import pytest
import torch

from dsv4c import ModelConfig
from dsv4c.export import GraphSpec, export_graph
from dsv4c.model import build_model
from dsv4c.parallel import ParallelPlan

from tests.shard_cases import run_sharded, scenario

TOL = 1e-5


@pytest.mark.long  # `pytest -m long`
def test_v32_plan_2x2_equals_single_process(tmp_path):
    model = build_model(ModelConfig.preset("v32-tiny"))
    graphs = {k: export_graph(model, GraphSpec(k, n_slots=3, max_len=32)).module() for k in ("prefill", "decode", "mtp")}
    with torch.no_grad():
        ref = scenario(model, graphs)
    outs, stats = run_sharded(model, graphs, ParallelPlan(2, 2), tmp_path)
    for rank, out in enumerate(outs):
        for k in ref:
            err = ((out[k] - ref[k]).abs().max() / ref[k].abs().max()).item()
            assert err <= TOL, f"rank {rank} {k}: rel err {err:.2e}"
    s = stats[0]["decode"]
    H = model.config.num_attention_heads
    dn, dr = model.config.qk_nope_head_dim, model.config.qk_rope_head_dim
    assert s["slices"]["model.model.layers.0.self_attn.q_b_proj.weight"] == [[0, 0, H // 2 * (dn + dr)]]
    assert "model.model.layers.0.mlp.down_proj.weight" in s["slices"]  # the dense layer, column split
    assert not any(".indexer." in k for k in s["slices"])
    assert s["collectives"]["expert_remap"] == model.config.num_hidden_layers - model.config.first_k_dense_replace
