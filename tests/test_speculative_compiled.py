"""MTP speculative decoding on a compiled artifact (runtime/speculative.py, issue 8): the bundled model's first
three layers compiled with --mtp 3 for the cpu target. Greedy equals plain greedy with rollback at every offset,
the fused verify_mtp graph in the manifest and the executor, an artifact without it, `dsv4c bench --mtp`.
Split from tests/test_speculative.py (its eager-graph tests, whose helpers these use): under --dist loadfile the
two halves run on different workers instead of one long file."""
from __future__ import annotations

import dataclasses

import pytest
import torch
from test_speculative import _closing_rejections, _rollback_check, _run_rounds, corrupt_every_offset, eager_session, prompts

from dsv4c import ModelConfig, load_model
from dsv4c.runtime import Session
from dsv4c.runtime.speculative import speculator


# ------------------------------------------------------------------------------------------------
# the compiled artifact (bundled model's first three layers, --mtp 3, target cpu)
# ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def cut(tmp_path_factory):
    """The bundled model's first three layers (sliding, CSA, HCA: every cache kind; trained weights and
    MTP block) as a checkpoint, its eager model, and plain greedy's tokens on `prompts`: what the
    compiled tests compile and compare with (half the export work of all six layers; its MTP still
    has drafts accepted)."""
    from cut_presets import bundle_cut

    ck = bundle_cut(tmp_path_factory.mktemp("cut") / "ckpt", 3)
    model = load_model(ck, dtype=torch.float32).eval()
    ps = prompts(model.config.vocab_size)
    with torch.no_grad():
        ref = [r.tokens for r in eager_session(model).generate(ps, max_new_tokens=20)]
    return ck, model, (ps, ref)


@pytest.fixture(scope="module")
def compiled(cut):
    from dsv4c.compile import compile_checkpoint

    out = cut[0].parent / "art"
    compile_checkpoint(cut[0], out, target="cpu", max_tokens=104, max_batch=4, mtp_k=3, dtype=torch.float32)
    return Session.load(out)


@pytest.mark.slow
@torch.no_grad()
def test_compiled_artifact_greedy_mtp_equals_plain_and_rolls_back(compiled, cut):
    _, model, (ps, ref) = cut
    sess = compiled
    assert sess.caches["0.ring"].shape[1] == model.config.sliding_window + 3  # extra_ring_slots = K
    assert speculator(sess).fused and speculator(sess).mtp_caches["0.ring"].shape[1] == model.config.sliding_window + 3
    assert [r.tokens for r in sess.generate(ps, max_new_tokens=20)] == ref
    spec = speculator(sess)
    for k in (1, 2, 3):
        spec.draft_filter = corrupt_every_offset(k, model.config.vocab_size, dict(enumerate(ref))) if k == 2 else None
        try:
            out = sess.generate(ps, max_new_tokens=20, mtp=k)
        finally:
            spec.draft_filter = None
        assert [r.tokens for r in out] == ref, k
        assert sum(r.stats["fused_rounds"] for r in out) > 0 and sum(r.stats["fallback_refreshes"] for r in out) == 0
    (prompt,) = prompts(model.config.vocab_size, [61], seed=1)
    trace = []
    _run_rounds(model, sess, prompt, 3, 4, _rollback_check(model, sess, 3, trace))
    assert _closing_rejections(len(prompt), trace, 3) > 0


@pytest.mark.slow
def test_compiled_fused_graph_in_the_manifest(compiled):
    """verify_mtp is in the manifest, the plan and `dsv4c inspect`, and reads no weight that verify and mtp
    do not (one weight table: nothing new is stored)."""
    from dsv4c.compile import describe_artifact

    m = compiled.manifest
    g = m["graphs"]["verify_mtp"]
    assert (g["kind"], g["k"], g["tokens_per_seq"]) == ("verify_mtp", 3, 4)
    assert set(g["weights"]) == set(m["graphs"]["verify"]["weights"]) | set(m["graphs"]["mtp"]["weights"])
    assert "verify_mtp" in m["segment_plan"] and "verify_mtp" in describe_artifact(compiled.art)
    # one dynamic (router) segment per main MoE layer plus the MTP block's
    assert len(m["segment_plan"]["verify_mtp"]["segments"]) == len(m["segment_plan"]["verify"]["segments"]) + 2


@pytest.mark.slow
@torch.no_grad()
def test_compiled_fused_graph_in_the_executor(compiled, cut):
    """The fused graph through the SegmentExecutor (emulated buckets 1/2/4, as the cpu target has none):
    a batch of 3 (one padded row with n_real = 0) gives plain greedy's tokens."""
    _, _, (ps, ref) = cut
    sess = Session(compiled.art, {**compiled.manifest, "buckets": [1, 2, 4]}, compiled.graphs, compiled.weights,
                   compiled.device, None, graph_mode="emulate")  # the loaded graphs and weights, shared
    ex = sess.executors["verify_mtp"]
    caches = {n: t.clone() for n, t in sess.caches.items()}
    spec = speculator(sess)  # allocates the MTP caches, runs nothing
    assert all(torch.equal(caches[n], t) for n, t in sess.caches.items()) and not sess.pos.any()
    out = sess.generate(ps[:3], max_new_tokens=12, mtp=2)
    assert spec is speculator(sess)
    assert [r.tokens for r in out] == [t[:12] for t in ref[:3]]
    assert sess.executors["verify"].stats["runs"] == 0  # rejections need no replay through verify
    assert ex.stats["runs"] > 0 and ex.stats["eager_fallbacks"] == 0 and ex.buckets == (1, 2, 4)
    assert sum(r.stats["fused_rounds"] for r in out) > 0


@pytest.mark.slow
@torch.no_grad()
def test_artifact_without_the_fused_graph_still_speculates(compiled, cut):
    """An artifact compiled before verify_mtp existed (this one's manifest and graphs without it: the
    Session is built from them as `Session.load` does) speculates through verify + mtp, exactly."""
    _, _, (ps, ref) = cut
    m = {**compiled.manifest, "graphs": {k: g for k, g in compiled.manifest["graphs"].items() if k != "verify_mtp"}}
    graphs = {k: g for k, g in compiled.graphs.items() if k != "verify_mtp"}
    sess = Session(compiled.art, m, graphs, compiled.weights, compiled.device, None)
    assert not speculator(sess).fused
    out = sess.generate(ps[:3], max_new_tokens=20, mtp=2)
    assert [r.tokens for r in out] == ref[:3]
    assert sum(r.stats["fused_rounds"] for r in out) == 0 and sum(r.stats["accepted_draft_tokens"] for r in out) > 0


def test_graph_kinds_add_the_fused_graph_with_mtp():
    from dsv4c.compile import graph_kinds

    cfg = ModelConfig.preset("v4-tiny-a")
    assert [n for n, _, _ in graph_kinds(cfg, 0)] == ["prefill", "decode"]
    assert graph_kinds(cfg, 2)[2:] == [("verify", "decode", 2), ("mtp", "mtp", 2), ("verify_mtp", "verify_mtp", 2)]
    assert [n for n, _, _ in graph_kinds(cfg, 2, fused_mtp=False)] == ["prefill", "decode", "verify", "mtp"]
    assert "verify_mtp" in [n for n, _, _ in graph_kinds(ModelConfig.preset("v3-tiny"), 1)]
    # an MTP block with a compressor: no fused graph (untested there, see graph_kinds)
    n = cfg.num_hidden_layers
    hca = dataclasses.replace(cfg, compress_ratios=cfg.compress_ratios[:n] + (16,))
    assert [n for n, _, _ in graph_kinds(hca, 2)] == ["prefill", "decode", "verify", "mtp"]


@pytest.mark.slow
@torch.no_grad()
def test_bench_reports_speculation_statistics(compiled):
    """`dsv4c bench --mtp k`: acceptance per draft position, mean accepted length and the histogram,
    merged over the batch's requests, consistent with each other."""
    from dsv4c.bench import bench_artifact, format_table

    res = bench_artifact(compiled.art, [2], prompt_len=8, output_len=12, mtp=2, warmup=False)
    (row,) = res["rows"]
    st = row["speculation"]
    hist = st["accept_histogram"]
    assert st["mtp_k"] == 2 and len(hist) == 3 and st["rounds"] == sum(hist) > 0
    accepted = sum(a * h for a, h in enumerate(hist))
    assert row["accepted_draft_tokens"] == accepted
    assert st["mean_accepted_length"] == pytest.approx((accepted + st["rounds"]) / st["rounds"])
    # the first draft is checked in every round that drafted (rounds near max_new_tokens may draft fewer)
    assert 0 < st["proposed_per_position"][0] <= st["rounds"]
    assert st["proposed_per_position"][1] <= st["proposed_per_position"][0]
    assert all(a is None or 0 <= a <= 1 for a in st["acceptance_per_position"])
    assert "acceptance per draft position" in format_table(res)
    plain = bench_artifact(compiled.art, [2], prompt_len=8, output_len=4, mtp=0, warmup=False)
    assert "speculation" not in plain["rows"][0]
