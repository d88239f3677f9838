"""The shard pass (passes/shard.py) on gloo: every plan's ranks compute the single-process logits."""
from __future__ import annotations

import time

import pytest
import torch

from dsv4c import ModelConfig
from dsv4c.export import GraphSpec, export_graph
from dsv4c.model import build_model
from dsv4c.parallel import ParallelPlan, PlanError
from dsv4c.passes.shard import weight_recipe

from tests.shard_cases import run_sharded, scenario

TOL = 1e-5  # fp32: max |sharded - single| / max |single|
# every V4 layer type (SWA, CSA, HCA), a hash layer, MTP; 3 Sinkhorn iterations keep the graphs small
V4_CFG = dict(num_hidden_layers=3, compress_ratios=(0, 4, 8, 0), num_hash_layers=1, hc_sinkhorn_iters=3)


@pytest.fixture(scope="module")
def v4():
    model = build_model(ModelConfig.preset("v4-tiny-a").replace(**V4_CFG))
    specs = {"prefill": GraphSpec("prefill", n_slots=3, max_len=32), "decode": GraphSpec("decode", n_slots=3, max_len=32),
             "mtp": GraphSpec("mtp", n_slots=3, max_len=32)}
    graphs = {name: export_graph(model, s).module() for name, s in specs.items()}
    with torch.no_grad():
        ref = scenario(model, graphs)
    return model, graphs, ref


def _rel(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


def _check_stats(cfg, stats: dict) -> None:
    """Rank 3 of plan (2, 2) = (ep 1, tp 1): what the pass sliced and inserted in the decode graph."""
    s = stats["decode"]
    E, I, H, d = cfg.n_routed_experts, cfg.moe_intermediate_size, cfg.num_attention_heads, cfg.head_dim
    assert s["coords"] == [1, 1]
    assert s["slices"]["model.layers.0.ffn.experts.w1"] == [[0, E // 2, E], [1, I // 2, I]]
    assert s["slices"]["model.layers.0.ffn.experts.w2"] == [[0, E // 2, E], [2, I // 2, I]]
    assert s["slices"]["model.layers.1.attn.wq_b.weight"] == [[0, H * d // 2, H * d]]
    assert s["slices"]["model.embed.weight"] == [[0, cfg.vocab_size // 2, cfg.vocab_size]]
    assert "model.layers.1.attn.wkv.weight" not in s["slices"]  # the K=V latent is replicated
    assert not any(".indexer." in k for k in s["slices"])
    n = cfg.num_hidden_layers
    assert s["collectives"] == {"all_reduce_tp": 2 * n, "all_reduce_world": n, "all_gather_tp": 1,
                                "vocab_embed": 1, "expert_remap": n}


# (2, 2) covers what (2, 1) and (1, 2) do (tp and ep, world 4): those two run with the slow tests
@pytest.mark.parametrize("tp,ep", [pytest.param(2, 1, marks=pytest.mark.slow), pytest.param(1, 2, marks=pytest.mark.slow),
                                   (2, 2), (1, 4)])
def test_sharded_logits_equal_single_process(v4, tp, ep, tmp_path):
    model, graphs, ref = v4
    t0 = time.perf_counter()
    outs, stats = run_sharded(model, graphs, ParallelPlan(tp, ep), tmp_path)
    assert len(outs) == tp * ep
    for rank, out in enumerate(outs):
        assert sorted(out) == sorted(ref) and len(ref) == 2 + 3  # prefill, 3 decode steps, mtp
        for k in ref:
            assert out[k].shape == ref[k].shape, (rank, k)
            err = _rel(out[k], ref[k])
            assert err <= TOL, f"plan ({tp},{ep}) rank {rank} {k}: rel err {err:.2e}"
    if (tp, ep) == (2, 2):
        _check_stats(model.config, stats[3])
    print(f"plan ({tp},{ep}): {time.perf_counter() - t0:.1f}s")


def test_plan_that_does_not_divide_names_the_weight():
    with pytest.raises(PlanError, match="experts.w1 dim 0 over ep"):
        weight_recipe("model.layers.0.ffn.experts.w1", (8, 32, 64), ParallelPlan(1, 3), 0)
