"""Sharded artifacts with FP8 dense linears (compile --tp 2 --dense-format fp8_block_w8a16, cpu target).

A rank's FP8 dense weights are its slices of the checkpoint's stored e4m3 bytes and the 128x128 scale tiles
covering them (passes/shard.py `slice_fp8_block`): column-split weights (wq_b, fused with the replicated
indexer wq_b) and the grouped wo_a (whole groups) by rows, row-split ones (wo_b, the shared expert's w2) by
columns. Checked: every rank's
dequantised weight is the single-process artifact's slice, and the two ranks on gloo give the
single-process artifact's logits and greedy tokens. A slice that would split a scale tile is refused.
"""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from dsv4c import ModelConfig
from dsv4c import quant as Q
from dsv4c.checkpoint import write_random_checkpoint
from dsv4c.compile import ArtifactError, compile_checkpoint
from dsv4c.kernels.tolerances import KERNEL_REL_ERR, rel_err
from dsv4c.parallel import ParallelPlan, PlanError
from dsv4c.passes.shard import slice_fp8_block
from dsv4c.runtime import Session

from shard_cases import run_artifact, session_scenario

CFG = dict(num_hidden_layers=2, compress_ratios=(0, 4, 0), num_hash_layers=1, hc_sinkhorn_iters=3)
KW = dict(target="cpu", max_tokens=32, max_batch=2, dtype=torch.float32, dense_format="fp8_block_w8a16")


@pytest.fixture(scope="module")
def arts(tmp_path_factory):
    d = tmp_path_factory.mktemp("dshard")
    cfg = ModelConfig.preset("v4-tiny-a").replace(**CFG)
    write_random_checkpoint(cfg, d / "ckpt", seed=3, quant="release", dtype=torch.float32)
    single = compile_checkpoint(d / "ckpt", d / "single", **KW)
    tp2 = compile_checkpoint(d / "ckpt", d / "tp2", plan=ParallelPlan(2, 1), **KW)
    return d, single, tp2


def _weights(art, files) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted({v["file"] for v in files.values()}):
        out.update(load_file(str(art / f)))
    return out


def _dequant(w: dict, module: str) -> torch.Tensor:
    base = module[: -len(".weight")]
    return Q.dequant_fp8_block(w[f"{base}.w_q"], w[f"{base}.w_s"].view(torch.float8_e8m0fnu))


def test_each_rank_holds_its_slice_of_the_stored_fp8_weights(arts):
    d, single, tp2 = arts
    dense = single["quant_map"]["dense"]["modules"]
    assert "model.layers.0.attn.wq_b.weight" in dense and "model.layers.0.attn.wo_b.weight" in dense
    c = ModelConfig.preset("v4-tiny-a").replace(**CFG)
    assert dense["model.layers.0.attn.wo_a.weight"]["shape"] == [  # the grouped wo_a, [G·R, H·d/G] as stored
        c.o_groups * c.o_lora_rank, c.num_attention_heads * c.head_dim // c.o_groups]
    assert tp2["target"]["dense_format"] == "fp8_block_w8a16"
    full = _weights(d / "single", single["weights"])
    ranks = [_weights(d / "tp2", r["weights"]) for r in tp2["ranks"]]
    for module in dense:
        assert all(module in r["quant_map"]["dense"]["modules"] for r in tp2["ranks"]), module
        whole, parts = _dequant(full, module), [_dequant(w, module) for w in ranks]
        if (".wq_b" in module and "indexer" not in module) or ".wo_a" in module:  # heads (wo_a: whole groups): rows
            assert torch.equal(torch.cat(parts, 0), whole), module
        elif "fused_wq_b__indexer_wq_b" in module:  # the rank's q heads, then the whole replicated indexer
            q_local = whole.shape[0] - parts[0].shape[0]  # half the q rows (the indexer's rows are in both)
            assert q_local > 0 and torch.equal(torch.cat([p[:q_local] for p in parts], 0), whole[:2 * q_local])
            assert all(torch.equal(p[q_local:], whole[2 * q_local:]) for p in parts), module
        else:  # wo_b, the shared expert's w2: input columns
            assert torch.equal(torch.cat(parts, 1), whole), module


def test_ranks_on_gloo_give_the_single_process_logits(arts, tmp_path):
    d, _, _ = arts
    ref = session_scenario(Session.load(d / "single"))
    got = run_artifact(d / "tp2", 2, tmp_path)
    for k in ref:
        if k != "tokens":
            assert rel_err(got[k], ref[k]) <= KERNEL_REL_ERR["dense_w8a16"], k
    assert torch.equal(got["tokens"], ref["tokens"])


def test_a_slice_that_splits_a_scale_tile_is_refused():
    w = torch.randn(384, 256) * 0.05
    q, s = Q.quant_fp8_block(w)
    q1, s1 = slice_fp8_block(q, s, [(0, 128, 384)])  # on a tile boundary
    assert torch.equal(Q.dequant_fp8_block(q1, s1), Q.dequant_fp8_block(q, s)[128:])
    q2, s2 = slice_fp8_block(q, s, [(1, 16, 100)])  # inside one tile
    assert torch.equal(Q.dequant_fp8_block(q2, s2), Q.dequant_fp8_block(q, s)[:, 16:100])
    with pytest.raises(PlanError, match="crosses into the next"):
        slice_fp8_block(q, s, [(0, 64, 192)], name="w")


def test_compile_names_the_weight_a_tp_would_cut_mid_tile(tmp_path):
    """Six heads of 64 rows: tp = 2 gives each rank 192 rows of wq_b, so rank 1's rows [192, 384) start inside
    a 128-row scale tile and end in the next. The compile refuses, naming the weight."""
    cfg = ModelConfig.preset("v4-tiny-a").replace(**CFG, num_attention_heads=6, index_n_heads=6)
    write_random_checkpoint(cfg, tmp_path / "ckpt", seed=1, quant="release", dtype=torch.float32)
    with pytest.raises(ArtifactError, match="wq_b.*scale block"):
        compile_checkpoint(tmp_path / "ckpt", tmp_path / "tp2", plan=ParallelPlan(2, 1), **KW)
    from dsv4c.planner import fp8_dense_problems, plan_problems  # the planner refuses the same plan

    problems = plan_problems(cfg, ParallelPlan(2, 1), None, "fp8_block_w8a16")
    assert problems == fp8_dense_problems(cfg, ParallelPlan(2, 1)) and len(problems) == 1, problems  # 2 layers + MTP
    assert problems[0].startswith("layers.0.attn.wq_b.weight (and 2 more like it): tp=2 slices dim 0 into "
                                  "[192, 384)"), problems
    assert plan_problems(cfg, ParallelPlan(2, 1), None, "bf16") == []
