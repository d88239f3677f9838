"""The shard pass (passes/shard.py) on gloo: every plan's ranks compute the single-process logits."""
from __future__ import annotations

import copy
import time

import pytest
import torch

from dsv4c import ModelConfig
from dsv4c.export import GraphSpec, export_graph
from dsv4c.model import build_model
from dsv4c.parallel import ParallelPlan, PlanError
from dsv4c.convert import ALIGN, KERNEL_FORMAT, padded, shard_inter
from dsv4c.kernels.tolerances import KERNEL_REL_ERR, rel_err
from dsv4c.passes import PassContext, get_param, set_param
from dsv4c.passes.quantize_experts import quantize_experts_as
from dsv4c.passes.shard import weight_recipe

from shard_cases import run_sharded, scenario

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


# (2, 2) covers what (2, 1) and (1, 2) do (tp and ep, world 4): those two run with the long tests (`-m long`;
# the default run has a tp = 2 world of 2 in test_sharded_quantised_experts_match_the_single_process_graphs)
@pytest.mark.parametrize("tp,ep", [pytest.param(2, 1, marks=pytest.mark.long), pytest.param(1, 2, marks=pytest.mark.long),
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


def _rank_quantiser(cfg, fmt: str, qgraphs: dict):
    """What compile does on a rank after the shard pass: quantise_experts on the sharded graph, whose
    quantised weights are then the rank's cut of the unsplit containers (convert.shard_inter; the
    artifact's bytes, tests/test_shard_quantized.py checks the streamed ones)."""
    kfmt = KERNEL_FORMAT[fmt]
    E, I = cfg.n_routed_experts, cfg.moe_intermediate_size

    def after_shard(name, gm, stats):
        res = quantize_experts_as(fmt)(gm, PassContext(cfg, "cpu", name))
        assert res.stats["layers"], "no routed experts were quantised"
        for lay in res.stats["layers"]:
            cut = {d: (lo, hi) for d, lo, hi in stats["slices"][lay["sources"]["w1"]]}
            (e0, e1), (lo, hi) = cut.get(0, (0, E)), cut.get(1, (0, I))
            full = {f: get_param(qgraphs[name], t)[e0:e1] for f, t in lay["tensors"].items()}
            part = shard_inter(kfmt, full, padded(I, ALIGN[kfmt]), lo, hi)
            for f, t in lay["tensors"].items():
                assert part[f].shape == get_param(res.graph, t).shape, (t, part[f].shape)
                set_param(res.graph, t, part[f])
        return res.graph

    return after_shard


# quantised routed experts: ep splits whole experts, tp their intermediate columns on the format's
# blocks (I = 32 here: nvfp4's 16-column groups split in two; mxfp4's 32 would not, so it goes over ep)
@pytest.mark.parametrize("fmt,tp,ep", [pytest.param("mxfp4_w4a16", 1, 2, marks=pytest.mark.long), ("nvfp4_w4a16", 2, 1)])
def test_sharded_quantised_experts_match_the_single_process_graphs(v4, fmt, tp, ep, tmp_path):
    """Tolerance: the sharded graphs hold the unsplit containers' bytes (weights equal); what differs
    is where the expert output is rounded to bf16 (moe_experts_q returns bf16: each rank's partial sum
    vs the whole sum), the rounding that KERNEL_REL_ERR[format] already allows the single-process
    quantised experts against their fp32 reference. Measured: about 1e-3."""
    model, graphs, _ = v4
    cfg = model.config
    qgraphs = {k: quantize_experts_as(fmt)(copy.deepcopy(gm), PassContext(cfg, "cpu", k)).graph for k, gm in graphs.items()}
    with torch.no_grad():
        ref = scenario(model, qgraphs)
    outs, _ = run_sharded(model, graphs, ParallelPlan(tp, ep), tmp_path, after_shard=_rank_quantiser(cfg, fmt, qgraphs))
    tol = KERNEL_REL_ERR[KERNEL_FORMAT[fmt]]
    for rank, out in enumerate(outs):
        assert sorted(out) == sorted(ref)
        for k in ref:
            err = rel_err(out[k], ref[k])
            assert err <= tol, f"{fmt} plan ({tp},{ep}) rank {rank} {k}: rel err {err:.2e} > {tol}"
            print(f"{fmt} ({tp},{ep}) rank {rank} {k}: rel err {err:.2e}")
