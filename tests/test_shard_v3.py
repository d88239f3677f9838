"""The shard pass on tiny V3.2 (MLA heads, the DSA indexer replicated, a dense layer, MTP): plan (2, 2) on
gloo computes the single-process logits; sharded V3 and V3.2 artifacts (compile --tp 2 / --ep 2, MTP) on gloo
workers give the single-process artifact's logits and greedy tokens. All `long` (`pytest -m long`)."""
from __future__ import annotations

import pytest
import torch

from dsv4c import ModelConfig
from dsv4c.export import GraphSpec, export_graph
from dsv4c.model import build_model
from dsv4c.parallel import ParallelPlan

from shard_cases import run_sharded, scenario

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


# ---- sharded V3/V3.2 artifacts (compile --tp/--ep; absorb_mla on the rank's heads) ---------------
@pytest.fixture(scope="module", params=["v3-tiny", "v32-tiny"])
def v3_arts(request, tmp_path_factory):
    from dsv4c.checkpoint import write_random_checkpoint
    from dsv4c.compile import compile_checkpoint

    d = tmp_path_factory.mktemp(request.param)
    write_random_checkpoint(ModelConfig.preset(request.param), d / "ckpt", seed=2, dtype=torch.float32)
    kw = dict(target="cpu", max_tokens=32, max_batch=2, dtype=torch.float32, mtp_k=1)
    compile_checkpoint(d / "ckpt", d / "single", verify_boundaries=False, **kw)
    for tp, ep in ((2, 1), (1, 2)):
        compile_checkpoint(d / "ckpt", d / f"p{tp}{ep}", plan=ParallelPlan(tp, ep), **kw)
    return request.param, d


@pytest.mark.long
@pytest.mark.parametrize("tp,ep", [(2, 1), (1, 2)])
def test_sharded_v3_artifact_logits_equal_single_process(v3_arts, tp, ep, tmp_path):
    from dsv4c.compile import read_manifest
    from dsv4c.runtime import Session

    from shard_cases import run_artifact, session_scenario

    preset, d = v3_arts
    m = read_manifest(d / f"p{tp}{ep}")
    cfg = ModelConfig.preset(preset)
    H, dn, c = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.kv_lora_rank
    uk = m["ranks"][1]["weights"]["model.model.layers.0.self_attn.kv_b_proj.w_uk"]["shape"]
    assert uk == [H // tp, dn, c]  # absorb_mla on the rank's heads
    ref = session_scenario(Session.load(d / "single"))
    got = run_artifact(d / f"p{tp}{ep}", 2, tmp_path)
    for k in ref:
        if k != "tokens":
            err = ((got[k] - ref[k]).abs().max() / ref[k].abs().max()).item()
            assert err <= TOL, f"{preset} ({tp},{ep}) {k}: rel err {err:.2e}"
    assert torch.equal(got["tokens"], ref["tokens"])


@pytest.mark.long
@pytest.mark.parametrize("mtp", [0, 1])
def test_sharded_v3_workers_generate_the_single_process_tokens(v3_arts, mtp, capfd):
    from dsv4c.cli import main as cli_main

    preset, d = v3_arts

    def tokens(art) -> list[str]:
        capfd.readouterr()
        assert cli_main(["run", str(art), "--device", "cpu", "--max-new-tokens", "6", "--mtp", str(mtp),
                         "--worker-timeout", "600", "--prompt-ids", "5,6,7,8,9,10,11", "--prompt-ids", "3,4"]) == 0
        return [ln for ln in capfd.readouterr().out.splitlines() if ln.strip()][-2:]

    want = tokens(d / "single")
    for tp, ep in ((2, 1), (1, 2)):
        assert tokens(d / f"p{tp}{ep}") == want, (preset, tp, ep, mtp)
