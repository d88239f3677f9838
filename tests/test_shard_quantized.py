"""Sharded artifacts with quantised routed experts (compile --tp/--ep --expert-format F, cpu target).

Each rank's experts are streamed from the checkpoint and built over their whole intermediate dim as
the single-GPU artifact builds them, then cut to the rank's columns on the format's block boundaries
(dsv4c/convert.py `shard_inter`). Fast: the streamed per-rank containers hold exactly the values of
their slice of the unsplit ones (every format, ep and tp splits, float and MXFP4 checkpoints), and a tp that would cut a
block is refused naming the limit. Long (`pytest -m long`): whole artifacts, single-process vs plans
(1,2) and (2,1) on gloo, logits and greedy tokens.
"""
from __future__ import annotations

import pytest
import torch

from dsv4c import ModelConfig
from dsv4c.checkpoint import CheckpointReader, write_random_checkpoint
from dsv4c.cli import main as cli_main
from dsv4c.compile import compile_checkpoint, read_manifest
from dsv4c.convert import ALIGN, KERNEL_FORMAT, CheckpointExperts, padded
from dsv4c.kernels.tolerances import KERNEL_REL_ERR, rel_err
from dsv4c.parallel import ParallelPlan, PlanError

from shard_cases import run_artifact, session_scenario

# every V4 layer type, a hash layer; I = 256 so that tp = 2 keeps whole fp8 128-blocks
CFG = dict(num_hidden_layers=3, compress_ratios=(0, 4, 8, 0), num_hash_layers=1, hc_sinkhorn_iters=3,
           moe_intermediate_size=256)
FORMATS = ("fp8_block", "mxfp4_w4a16", "nvfp4_w4a16")
PLANS = ((1, 2), (2, 1))
MODULE = "model.layers.1.ffn.experts"


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    d = tmp_path_factory.mktemp("qshard")
    cfg = ModelConfig.preset("v4-tiny-a").replace(**CFG)
    write_random_checkpoint(cfg, d / "float", seed=5, dtype=torch.float32)
    write_random_checkpoint(cfg, d / "release", seed=5, quant="release", dtype=torch.float32)
    return cfg, d


def _recipe(cfg, kfmt: str, shard: dict | None) -> dict:
    E, I, D = cfg.n_routed_experts, cfg.moe_intermediate_size, cfg.hidden_size
    e0, e1 = shard["experts"] if shard else (0, E)
    lo, hi = shard["inter"] if shard else (0, I)
    a = ALIGN[kfmt]
    rec = {"module": MODULE, "kernel_format": kfmt, "experts": e1 - e0, "padded": {"I": padded(hi - lo, a),
           "D": padded(D, a)}, "dims": {"I": hi - lo, "D": D}, "limit": float(cfg.swiglu_limit),
           "sources": {k: f"{MODULE}.{k}" for k in ("w1", "w3", "w2")}}
    return {**rec, "shard": shard} if shard else rec


def _fields(reader, rec: dict) -> dict[str, torch.Tensor]:
    from dsv4c.convert import field_specs

    src = CheckpointExperts(reader)
    return {f: src({**rec, "field": f}).clone()
            for f in field_specs(rec["kernel_format"], rec["experts"], rec["padded"]["I"], rec["padded"]["D"])}


def _dequant(kfmt: str, fields: dict) -> tuple[torch.Tensor, ...]:
    from dsv4c.kernels.moe_grouped import experts_from_tensors

    return experts_from_tensors(kfmt, **fields).dequantize()


@pytest.mark.parametrize("fmt", (*FORMATS, "bf16"))
@pytest.mark.parametrize("source", ["float", "release"])
def test_each_rank_streams_its_slice_of_the_single_gpu_experts(ckpts, fmt, source):
    """Per plan and rank, the streamed fields dequantise to exactly the rank's experts x columns of the
    unsplit container (weights equal, so the sharded sum has the single-GPU terms), with nvfp4's
    per-expert global scales of the whole expert."""
    cfg, d = ckpts
    kfmt = KERNEL_FORMAT[fmt]
    E, I = cfg.n_routed_experts, cfg.moe_intermediate_size
    reader = CheckpointReader(d / source, cfg)
    try:
        full = _fields(reader, _recipe(cfg, kfmt, None))
        w1, w3, w2 = _dequant(kfmt, full)
        for tp, ep in PLANS:
            for rank in range(tp * ep):
                e, t = ParallelPlan(tp, ep).coords(rank)
                e0, e1 = e * E // ep, (e + 1) * E // ep
                lo, hi = t * I // tp, (t + 1) * I // tp
                shard = {"experts": [e0, e1], "inter": [lo, hi], "E": E, "I": I}
                part = _fields(reader, _recipe(cfg, kfmt, shard))
                p1, p3, p2 = _dequant(kfmt, part)
                where = f"{fmt} from {source}, plan ({tp},{ep}) rank {rank}"
                assert torch.equal(p1, w1[e0:e1, lo:hi]) and torch.equal(p3, w3[e0:e1, lo:hi]), where
                assert torch.equal(p2[..., : w2.shape[1], :], w2[e0:e1, :, lo:hi]), where
                for f in ("w13_global", "w2_global"):
                    if f in full:
                        assert torch.equal(part[f], full[f][e0:e1]), (where, f)
    finally:
        reader.close()


def test_a_tp_that_cuts_a_block_names_the_limit(tmp_path):
    ck = write_random_checkpoint(ModelConfig.preset("v4-tiny-a").replace(num_hidden_layers=1, compress_ratios=(0, 0),
                                                                         num_hash_layers=0), tmp_path / "ck")
    with pytest.raises(PlanError, match=r"tp: routed experts: moe_intermediate_size 32 split over tp = 2 .* "
                                        r"not a multiple of mxfp4's block of 32"):
        compile_checkpoint(ck, tmp_path / "art", plan=ParallelPlan(2, 1), expert_format="mxfp4_w4a16")
    assert not (tmp_path / "art").exists()


# ---- whole artifacts (long) ----------------------------------------------------------------------
@pytest.fixture(scope="module", params=FORMATS)
def arts(request, ckpts):
    cfg, d = ckpts
    fmt = request.param
    kw = dict(target="cpu", max_tokens=32, max_batch=2, dtype=torch.float32, expert_format=fmt)
    compile_checkpoint(d / "float", d / f"{fmt}-single", verify_boundaries=False, **kw)
    for tp, ep in PLANS:
        compile_checkpoint(d / "float", d / f"{fmt}-{tp}{ep}", plan=ParallelPlan(tp, ep), **kw)
    return fmt, d


@pytest.mark.long
@pytest.mark.parametrize("tp,ep", PLANS)
def test_sharded_artifact_logits_and_tokens_equal_the_single_process_artifact(arts, tp, ep, tmp_path):
    """fp32 activations, quantised experts. Tolerance: KERNEL_REL_ERR[format], as in tests/test_shard.py
    (the weights are equal; the bf16 rounding of the expert output happens per rank partial sum)."""
    from dsv4c.runtime import Session

    fmt, d = arts
    m = read_manifest(d / f"{fmt}-{tp}{ep}")
    assert m["parallel"] == {"tp": tp, "ep": ep, "world_size": 2}
    assert m["ranks"][1]["quant_map"]["modules"][MODULE]["shard"]["experts"] == ([4, 8] if ep == 2 else [0, 8])
    ref = session_scenario(Session.load(d / f"{fmt}-single"))
    got = run_artifact(d / f"{fmt}-{tp}{ep}", 2, tmp_path)
    tol = KERNEL_REL_ERR[KERNEL_FORMAT[fmt]]
    for k in ref:
        if k != "tokens":
            err = rel_err(got[k], ref[k])
            assert err <= tol, f"{fmt} ({tp},{ep}) {k}: rel err {err:.2e} > {tol}"
    assert torch.equal(got["tokens"], ref["tokens"])


@pytest.mark.long
def test_workers_generate_the_single_process_tokens(arts, capfd):
    """`dsv4c run` (one worker per rank) on both plans: the single-process artifact's greedy tokens."""
    fmt, d = arts

    def tokens(art) -> list[str]:
        argv = ["run", str(art), "--device", "cpu", "--max-new-tokens", "6", "--worker-timeout", "600",
                "--prompt-ids", "5,6,7,8,9,10,11", "--prompt-ids", "3,4"]
        capfd.readouterr()
        assert cli_main(argv) == 0
        return [ln for ln in capfd.readouterr().out.splitlines() if ln.strip()][-2:]

    want = tokens(d / f"{fmt}-single")
    assert len(want) == 2
    for tp, ep in PLANS:
        assert tokens(d / f"{fmt}-{tp}{ep}") == want, (fmt, tp, ep)


def _expert_kernels(gm) -> list[tuple]:
    """(op, format) of every routed-experts call after lowering."""
    out = []
    for n in gm.graph.nodes:
        name = n.target.name() if n.op == "call_function" and hasattr(n.target, "name") else ""
        if name.startswith("dsv4c::moe_experts"):
            out.append((name, n.args[3] if name.startswith("dsv4c::moe_experts_q") else None))
    return out


def _dsv4c_ops(gm) -> dict[str, int]:
    from collections import Counter

    return dict(Counter(n.target.name() for n in gm.graph.nodes if n.op == "call_function"
                        and hasattr(n.target, "name") and n.target.name().startswith("dsv4c::")))


def test_h200_ranks_lower_to_the_single_gpu_kernels():
    """compile's per-rank lowering (shard pass, then the default pipeline) for target h200 picks the
    single-GPU artifact's expert kernels and formats, and the same custom ops elsewhere (rank 3 of
    plan (2, 2): experts split over ep and tp; on meta, as compile traces)."""
    from dsv4c.export import GraphSpec, export_graph
    from dsv4c.model import build_model
    from dsv4c.passes import PassContext, default_pipeline, run_pipeline
    from dsv4c.passes.shard import shard_pass

    cfg = ModelConfig.preset("v4-tiny-a").replace(num_hidden_layers=1, compress_ratios=(4, 0), num_hash_layers=0,
                                                  hc_sinkhorn_iters=3, moe_intermediate_size=256)
    eg = export_graph(build_model(cfg, device="meta"), GraphSpec("decode", n_slots=3, max_len=32))
    for fmt in ("fp8_block", "mxfp4_w4a16"):
        ctx = PassContext(cfg, "h200", "decode", (), fmt)
        single, _ = run_pipeline(eg.module(), ctx)
        rank, recs = run_pipeline(eg.module(), ctx, passes=[("shard", shard_pass(ParallelPlan(2, 2), 3)),
                                                             *default_pipeline()])
        assert recs[0].changed and recs[0].stats["collectives"]["expert_remap"] == 1
        kinds = _expert_kernels(single)
        assert kinds == _expert_kernels(rank) and len(kinds) == 1 and {k[1] for k in kinds} == {KERNEL_FORMAT[fmt]}
        assert _dsv4c_ops(rank) == _dsv4c_ops(single), fmt
