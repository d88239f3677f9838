"""Deterministic mode (`compile --deterministic`, `Session.load(..., deterministic=True)`).

CPU: a tiny V4 model with an MTP block compiled for the cpu target in deterministic mode. The test
checks the plumbing: every GEMM, expert, hc-mix and reduction node is the batch-invariant op, the
manifest records the mode, and greedy tokens are identical at batch 1 and 3 and with MTP k = 0..3.
What that does NOT prove: on the CPU those ops run their torch references (fp32), whose batch
invariance is not guaranteed by construction. `test_decode_rows_bit_identical_with_the_triton_kernels_
interpreted` points them at their Triton kernels (interpreter) and checks bit-identical rows of the
whole decode graph; the interpreter runs the kernels' program structure and K order, not the GPU's
MMA units or the other ops' GPU kernels: the `gpu` tests below and examples/bench_deterministic.py
check those (bit-identical logits rows at batch 1/8/64 at Flash dimensions).
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dsv4c import ModelConfig, write_random_checkpoint
from dsv4c.compile import ArtifactError, DeterminismError, compile_checkpoint, deterministic_target
from dsv4c.runtime import Session
from dsv4c.targets import get_target

ROOT = Path(__file__).resolve().parents[1]
BUNDLE = ROOT / "examples" / "models" / "v4-tiny-pystdlib"
PROMPTS = [[5, 9, 17, 3], [3, 44, 2, 7, 19], [4, 8]]
GEMM_OPS = ("aten.linear", "aten.matmul", "aten.mm", "aten.addmm", "aten.bmm", "aten.einsum",
            "dsv4c.linear_f32", "dsv4c.moe_experts.", "dsv4c.hc_pre.", "dsv4c.grouped_linear.",
            "dsv4c.rms_norm.", "dsv4c.hc_post.", "dsv4c.sinkhorn.")  # the last three: variant by row count


@pytest.fixture(scope="module")
def art(tmp_path_factory):
    d = tmp_path_factory.mktemp("det")
    cfg = ModelConfig.preset("v4-tiny-a")  # cut to 2 layers (a CSA layer among them) to keep the compile short
    cfg = cfg.replace(num_hidden_layers=2, compress_ratios=(0, 4, 0), num_hash_layers=1)
    write_random_checkpoint(cfg, d / "ckpt", seed=3, dtype=torch.float32)
    m = compile_checkpoint(d / "ckpt", d / "art", target="cpu", max_tokens=32, max_batch=3, mtp_k=3,
                           dtype=torch.float32, fused_mtp=False, deterministic=True, verify_boundaries=False)
    return d / "art", m


def test_deterministic_artifact_has_only_invariant_reductions(art):
    path, m = art
    assert m["deterministic"]["enabled"] and m["deterministic"]["blockers"] == {}
    assert "not proven" in m["deterministic"]["note"]  # the CPU target says what it does not prove
    for name in ("decode", "mtp"):
        g = m["graphs"][name]
        ep = torch.export.load(str(path / g["file"]))
        targets = [str(n.target) for n in ep.graph.nodes if n.op == "call_function"]
        assert not [t for t in targets if t.startswith(GEMM_OPS)], name
        assert any(t.startswith("dsv4c.linear_bi") for t in targets), name
        tiles = {n.args[5] for n in ep.graph.nodes if str(n.target).startswith("dsv4c.linear_bi")}
        assert tiles == {True}, (name, tiles)  # the decode tile survives the artifact's save and load
        assert any(t.startswith("dsv4c.moe_experts_bi") for t in targets), name
        assert any(t.startswith("dsv4c.rms_norm_bi") for t in targets), name


@torch.no_grad()
def test_greedy_identical_across_batch_and_mtp(art):
    sess = Session.load(art[0], deterministic=True)
    together = [r.tokens for r in sess.generate(PROMPTS, max_new_tokens=8)]
    alone = [sess.generate([p], max_new_tokens=8)[0].tokens for p in PROMPTS]
    for k in (1, 2, 3):
        assert [r.tokens for r in sess.generate(PROMPTS, max_new_tokens=8, mtp=k)] == together, k
    assert together == alone
    assert all(len(t) == 8 for t in together)


@pytest.mark.parametrize("mode", ["deterministic", "deterministic-mxfp4-fp8dense"])
def test_decode_rows_bit_identical_with_the_triton_kernels_interpreted(monkeypatch, mode):
    """The whole deterministic decode graph (2-layer tiny V4, h200 lowering; bf16 experts and dense, or MXFP4
    weight-only experts through `moe_experts_fp4_bi` with FP8 dense linears) with the batch-invariant ops' CPU
    paths pointed at their Triton kernels under the interpreter: row 0's logits are the same bits at batch 1
    and 3. (The other ops run their CPU references here; on the GPU the gpu tests and
    examples/bench_deterministic.py check the real kernels. The hash router's reference runs one row at a time:
    ATen's vectorised softplus gives a row other bits at another row count on some CPUs, e.g. AVX2 ones,
    where the rows' elements fall in a vector body or its scalar tail.)"""
    import sys

    import dsv4c.kernels.batch_invariant as bi
    import dsv4c.kernels.mhc as mhc
    import dsv4c.kernels.router as router

    sys.path.insert(0, str(ROOT / "examples"))
    import bench_deterministic

    monkeypatch.setattr(bi, "bi_matmul_ref", lambda x, w, b=None, o=None: bi.bi_matmul(x.contiguous(), w, b, o))
    monkeypatch.setattr(bi, "bi_gemv_gathered_ref", bi.bi_gemv_gathered)
    fp8 = []  # the FP8 dense linears' CPU path: the kernel, counted
    monkeypatch.setattr(bi, "bi_matmul_fp8_ref", lambda x, q, s, o=None: fp8.append(q.shape) or bi.bi_matmul_fp8(
        x.contiguous().to(torch.bfloat16), q, s, o or x.dtype))
    monkeypatch.setattr(mhc, "hc_pre_ref", lambda *a: mhc.hc_pre(*a, rows=True, exact=False))
    hashed = router.route_hashed_ref
    monkeypatch.setattr(router, "route_hashed_ref", lambda logits, idx, scale: torch.cat(
        [hashed(logits[i:i + 1], idx[i:i + 1], scale) for i in range(logits.shape[0])]))
    calls, gemv = [], bi.moe_experts_fp4_bi_gemv  # the FP4 experts' CPU path: the GEMV kernel, counted
    monkeypatch.setattr(bi, "moe_experts_fp4_bi_ref", lambda *a: calls.append(a[3].format) or gemv(*a))
    res = bench_deterministic.run(layers=2, batches=[1, 3], prompt=12, steps=2, modes=(mode,),
                                  device="cpu", preset="v4-tiny-a")[mode]
    assert res["blockers"] == [] and res["rows_identical"] and res["tokens_identical"], res
    assert bool(calls) == mode.startswith("deterministic-mxfp4") and set(calls) <= {"mxfp4"}, calls
    assert bool(fp8) == mode.endswith("fp8dense"), fp8  # quantize_dense left FP8 linears for make_batch_invariant


@pytest.mark.parametrize("entry", ["run", "verify_rows"])
def test_bench_frees_the_previous_build_before_the_next(monkeypatch, entry):
    """An earlier call's model, graphs and caches hold each other in reference cycles; each entry point
    collects them before it builds (on the H100 the GPU test's second mode ran out of memory without it)."""
    import gc
    import sys
    import weakref

    sys.path.insert(0, str(ROOT / "examples"))
    import bench_deterministic
    import bench_segments

    class Built(Exception):
        pass

    class Cycle:
        def __init__(self):
            self.me = self

    first = []

    def build(*a, **k):
        alive = [r() is not None for r in first]
        first.append(weakref.ref(Cycle()))  # garbage in a cycle, as a finished call leaves its model
        raise Built(alive)

    monkeypatch.setattr(bench_segments, "build", build)
    fn = getattr(bench_deterministic, entry)
    kw = {"mode": "deterministic"} if entry == "verify_rows" else {}
    gc.disable()
    try:
        for _ in range(2):
            with pytest.raises(Built) as e:
                fn(layers=1, batches=(1,), device="cpu", **kw)
    finally:
        gc.enable()
    assert e.value.args[0] == [False]  # the first call's cycle was gone when the second built


def test_session_refuses_an_artifact_not_compiled_deterministic(art, monkeypatch):
    import dsv4c.runtime.session as session_mod

    real = session_mod.read_manifest
    monkeypatch.setattr(session_mod, "read_manifest", lambda a, verify=True: {**real(a, verify), "deterministic": False})
    with pytest.raises(ArtifactError, match="--deterministic"):
        Session.load(art[0], deterministic=True)


def test_deterministic_target_refuses_what_it_cannot_make_invariant():
    h200 = get_target("h200")
    tgt, kernels = deterministic_target(h200, None, None, 0)
    assert kernels["v4_attention"] == "fused_det" and tgt.expert_format == "reference"
    with pytest.raises(DeterminismError, match="whole call"):
        deterministic_target(h200, "nvfp4_w4a4", None, 0)
    for fmt in ("mxfp4_w4a16", "nvfp4_w4a16"):  # FP4 weight-only: the GEMV path at every token count
        fp4, _ = deterministic_target(h200, fmt, None, 0)
        assert fp4.expert_format == fmt and "moe_experts_fp4_bi" in fp4.expert_format_reason
    fp8, _ = deterministic_target(h200, "fp8_block", None, 0)  # FP8 block: the grouped kernel with one tile
    assert fp8.expert_format == "fp8_block" and "moe_experts_fp8_bi" in fp8.expert_format_reason
    assert deterministic_target(h200, None, None, 3)[1] == kernels  # MTP: fused_det's rows do not depend on T
    with pytest.raises(DeterminismError, match="v4_attention=fused"):
        deterministic_target(h200, None, {"v4_attention": "fused"}, 0)
    cpu, _ = deterministic_target(get_target("cpu"), None, None, 2)  # reference attention: allowed
    assert cpu.device == "cpu"


def test_unmatched_gemm_is_a_blocker():
    from dsv4c.passes.make_batch_invariant import batch_invariance_blockers

    class M(torch.nn.Module):
        def forward(self, x, y):
            return (x @ y).sum(0)  # no weight transpose, a sum over several dims: not rewritten

    gm = torch.export.export(M(), (torch.randn(3, 4), torch.randn(4, 5))).module()
    found = batch_invariance_blockers(gm)
    assert any("aten.mm" in b or "aten.matmul" in b for b in found), found


# ------------------------------------------------------------------------------------------------
# GPU (-m gpu): the bundled model, bf16, h200 lowering with full CUDA graphs
# ------------------------------------------------------------------------------------------------
@pytest.mark.gpu
@torch.no_grad()
def test_gpu_bundled_greedy_identical_across_batch_1_8_64_and_mtp_0_to_3(tmp_path):
    out = tmp_path / "art"
    compile_checkpoint(BUNDLE, out, target="h200", max_tokens=160, max_batch=64, buckets=(1, 8, 64), mtp_k=3,
                       deterministic=True, verify_boundaries=False)
    sess = Session.load(out, device="cuda", deterministic=True)
    g = torch.Generator().manual_seed(0)
    V = sess.config.vocab_size
    prompts = [torch.randint(2, V, (n,), generator=g).tolist() for n in (5, 9, 17, 3, 30, 12, 7, 21)]
    alone = [sess.generate([p], max_new_tokens=48)[0].tokens for p in prompts]
    eight = [r.tokens for r in sess.generate(prompts, max_new_tokens=48)]
    many = [r.tokens for r in sess.generate(prompts * 8, max_new_tokens=48)]
    assert eight == alone
    assert many == alone * 8
    for k in (1, 2, 3):  # the bundled model accepts drafts: verify rows and rollbacks are exercised
        assert [sess.generate([p], max_new_tokens=48, mtp=k)[0].tokens for p in prompts[:2]] == alone[:2], k
        assert [r.tokens for r in sess.generate(prompts, max_new_tokens=48, mtp=k)] == alone, k
        assert [r.tokens for r in sess.generate(prompts * 8, max_new_tokens=48, mtp=k)] == alone * 8, k


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["deterministic", "deterministic-mxfp4", "deterministic-fp8"])
def test_gpu_flash_two_layer_rows_and_tokens_identical_across_batch_and_mtp_k_0_to_3(mode):
    """The random 2-layer Flash-dimension model (a window layer and a CSA layer), bf16, full CUDA graphs,
    bf16 experts, MXFP4 weight-only ones (`moe_experts_fp4_bi`) or FP8 block ones (`moe_experts_fp8_bi`),
    batch 1/8/64: decode rows at batch 1 and 8 are the same bits as at 64; a verify step of 1 + k tokens
    (k = 1..3) gives every row and token the same logits bits as 1 + k decode steps fed the same tokens;
    greedy speculative rounds (teacher drafts, 30% corrupted: rejections and rollbacks) give the same
    tokens as plain decode at batch 64."""
    import sys

    sys.path.insert(0, str(ROOT / "examples"))
    import bench_deterministic

    res = bench_deterministic.verify_rows(k_max=3, layers=2, batches=(1, 8, 64), prompt=256, steps=16, mode=mode)
    for B in (1, 8, 64):
        assert res["batch_rows_identical"][B], res
        assert all(res["verify_rows_identical"][B].values()), res
        assert all(res["tokens_identical"][B].values()), res
    assert res["accepted_per_round"][64][3] > 0.5, res  # the rounds did accept drafts


def test_w8a8_dense_is_a_blocker_w8a16_dense_fp8_and_fp4_experts_are_rewritten():
    """make_batch_invariant runs after quantize_experts / quantize_dense: a W8A8 dense linear keeps kernels
    that choose their path by token count (a blocker, which compile refuses on a CUDA target); a W8A16 dense
    linear becomes `fp8_linear_bi` on the same FP8 bytes, FP4 weight-only experts `moe_experts_fp4_bi` with
    the activation-scale inputs dropped, FP8 block experts `moe_experts_fp8_bi` (their scales kept)."""
    import dsv4c.kernels.fp8_gemm  # noqa: F401  (registers the FP8 linear ops)
    import dsv4c.kernels.moe_grouped  # noqa: F401  (registers moe_experts_q)
    from dsv4c import ModelConfig
    from dsv4c.passes import PassContext
    from dsv4c.passes.make_batch_invariant import make_batch_invariant

    ops = torch.ops.dsv4c
    g = torch.fx.Graph()
    x, idx, wt = g.placeholder("x"), g.placeholder("idx"), g.placeholder("wt")
    w = [g.placeholder(f"w{i}") for i in range(6)]
    dense = g.call_function(ops.fp8_linear_w8a16.default, (x, w[0], w[1]))
    w8a8 = g.call_function(ops.fp8_linear_w8a8.default, (x, w[0], w[1]))
    fp8 = g.call_function(ops.moe_experts_q.default, (x, idx, wt, "fp8_block", w[0], w[1], None, w[2], w[3], None,
                                                      None, None, 7.0))
    fp4 = g.call_function(ops.moe_experts_q.default, (x, idx, wt, "mxfp4", w[0], w[1], None, w[2], w[3], None,
                                                      None, None, 7.0))
    g.output((dense, w8a8, fp8, fp4))
    gm = torch.fx.GraphModule(torch.nn.Module(), g)
    res = make_batch_invariant(gm, PassContext(ModelConfig.preset("v4-tiny-a"), "h200", "decode", deterministic=True))
    blockers = res.stats["blockers"]
    assert len(blockers) == 1 and "fp8_linear_w8a8" in blockers[0], blockers  # the W8A16, FP8 and FP4 nodes are not
    (bi,) = [n for n in res.graph.graph.nodes if n.op == "call_function" and "fp8_linear_bi" in str(n.target)]
    assert [a.name for a in bi.args] == ["x", "w0", "w1"]  # no weight values here: the ops' default tile
    (new,) = [n for n in res.graph.graph.nodes if n.op == "call_function" and "moe_experts_fp4_bi" in str(n.target)]
    assert new.args[3] == "mxfp4" and len(new.args) == 11 and new.args[-1] == 7.0
    (q8,) = [n for n in res.graph.graph.nodes if n.op == "call_function" and "moe_experts_fp8_bi" in str(n.target)]
    assert [getattr(a, "name", a) for a in q8.args] == ["x", "idx", "wt", "w0", "w1", "w2", "w3", 7.0]


def test_decode_kind_linears_get_a_k_split_from_the_weight_shape_prefill_none():
    """make_batch_invariant on a Flash-shaped [1536, 4096] linear and a grouped [8, 1024, 4096] one (meta
    tensors): a decode-kind graph's ops carry `bi_split`'s K split and the decode tile, the prefill graph's
    neither, whatever the example's row count."""
    from dsv4c.kernels.batch_invariant import bi_split
    from dsv4c.model import register_ops
    from dsv4c.passes import PassContext
    from dsv4c.passes.make_batch_invariant import make_batch_invariant

    register_ops()

    class Two(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.empty(1536, 4096, device="meta"))
            self.g = torch.nn.Parameter(torch.empty(8, 1024, 4096, device="meta"))

        def forward(self, x, xg):
            return torch.nn.functional.linear(x, self.w), torch.ops.dsv4c.grouped_linear(xg, self.g)

    cfg = ModelConfig.preset("v4-tiny-a")
    splits = {}
    for kind, rows in (("decode", 1), ("decode", 64), ("prefill", 1), ("mtp", 3)):
        args = (torch.empty(rows, 4096, device="meta"), torch.empty(rows, 1, 8, 4096, device="meta"))
        gm = torch.export.export(Two(), args, strict=False).module()
        res = make_batch_invariant(gm, PassContext(cfg, "h200", kind, deterministic=True))
        nodes = [n for n in res.graph.graph.nodes if n.op == "call_function" and "_bi" in str(n.target)]
        assert len(nodes) == 2 and not res.stats["blockers"], (kind, res.stats)
        split_at = [2 if "grouped" in str(n.target) else 4 for n in nodes]  # the split's position in the args
        splits[kind, rows] = [tuple(n.args[i:]) for n, i in zip(nodes, split_at)]  # (split, decode) or ()
    assert splits["decode", 1] == splits["decode", 64] == splits["mtp", 3] == [(bi_split(1536, 4096), True),
                                                                              (bi_split(1024, 4096), True)]
    assert [a[0] for a in splits["decode", 1]] == [8, 8]
    assert splits["prefill", 1] == [(), ()]


def test_deterministic_h200_compile_keeps_bf16_dense_unless_fp8_is_asked(tmp_path):
    """The h200 target's FP8 dense default does not reach a deterministic artifact (its linears run bf16
    weights; a release-layout tiny V4, MXFP4 experts as stored); `--dense-format fp8_block_w8a16` is
    test_deterministic_h200_compile_with_fp8_experts's."""
    from cut_presets import small

    write_random_checkpoint(small("v4-tiny-a"), tmp_path / "ck", seed=3, quant="release", dtype=torch.float32)
    m = compile_checkpoint(tmp_path / "ck", tmp_path / "art", target="h200", max_tokens=32, max_batch=2,
                           buckets=(1, 2), expert_format="mxfp4_w4a16", deterministic=True, verify_boundaries=False)
    assert m["deterministic"]["blockers"] == {} and m["target"]["dense_format"] == "bf16"
    ep = torch.export.load(str(tmp_path / "art" / m["graphs"]["decode"]["file"]))
    assert not [n for n in ep.graph.nodes if str(n.target).startswith("dsv4c.fp8_linear")]


def test_deterministic_h200_compile_with_fp8_experts(tmp_path):
    """`--deterministic --expert-format fp8_block --dense-format fp8_block_w8a16`: every graph's FP8 block experts
    run `moe_experts_fp8_bi` (no `moe_experts_q` left, no blocker), the stored FP8 dense bytes run on
    `fp8_linear_bi` with the decode tile in decode graphs; the artifact loads and its emulated logits are finite
    (a release-layout tiny V4; the batch-invariance of the CUDA path is tests/test_kernels_batch_invariant.py's
    GPU test)."""
    from cut_presets import small

    write_random_checkpoint(small("v4-tiny-a"), tmp_path / "ck", seed=3, quant="release", dtype=torch.float32)
    art = tmp_path / "art"
    m = compile_checkpoint(tmp_path / "ck", art, target="h200", max_tokens=32, max_batch=2, buckets=(1, 2),
                           expert_format="fp8_block", deterministic=True, dense_format="fp8_block_w8a16",
                           verify_boundaries=False)
    assert m["deterministic"]["blockers"] == {} and m["target"]["expert_format"] == "fp8_block"
    assert m["target"]["dense_format"] == "fp8_block_w8a16"
    for kind in ("decode", "prefill"):
        ep = torch.export.load(str(art / m["graphs"][kind]["file"]))
        ops = [str(n.target) for n in ep.graph.nodes if n.op == "call_function"]
        assert any(o.startswith("dsv4c.moe_experts_fp8_bi") for o in ops), kind
        assert not any(o.startswith("dsv4c.moe_experts_q") for o in ops), kind
        fp8 = [n for n in ep.graph.nodes if str(n.target).startswith("dsv4c.fp8_linear")]
        assert fp8 and all(str(n.target).startswith("dsv4c.fp8_linear_bi") for n in fp8), kind
        assert all((len(n.args) > 4 and n.args[4]) is (kind == "decode") for n in fp8), kind  # the decode tile
    logits = Session.load(art, emulate=True, deterministic=True).logits([5, 9, 17, 3])
    assert torch.isfinite(logits).all()
