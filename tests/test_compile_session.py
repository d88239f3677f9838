"""`dsv4c compile` -> artifact -> `Session`: equal to the eager model, and every bad input named."""
from __future__ import annotations

import json
import shutil
import zipfile

import pytest
import torch
from cut_presets import small

from dsv4c import ModelConfig, load_model, write_random_checkpoint
from dsv4c.cli import main as cli_main
from dsv4c.compile import ArtifactError, compile_checkpoint
from dsv4c.model.generate import greedy
from dsv4c.passes import default_pipeline
from dsv4c.runtime import Session
from dsv4c.targets import TargetError

PROMPTS = [[5, 9, 17], [3, 44, 2, 7, 19, 23, 1, 8], [4], [6, 6, 6, 6, 6], [8, 9], [10, 11, 12]]


@pytest.fixture(scope="module", params=["v4-tiny-a", "v32-tiny"])
def compiled(request, tmp_path_factory):
    d = tmp_path_factory.mktemp(request.param)
    write_random_checkpoint(small(request.param), d / "ckpt", seed=3, dtype=torch.float32)
    manifest = compile_checkpoint(d / "ckpt", d / "art", target="cpu", max_tokens=64, max_batch=4,
                                  dtype=torch.float32)
    return d, manifest, load_model(d / "ckpt")


@pytest.fixture(scope="module")
def session(compiled):
    return Session.load(compiled[0] / "art")


def test_manifest_lists_every_file_with_its_hash(compiled):
    d, m, _ = compiled
    files = {str(p.relative_to(d / "art")) for p in (d / "art").rglob("*") if p.is_file()} - {"manifest.json"}
    assert set(m["files"]) == files and {"graphs/prefill.pt2", "graphs/decode.pt2"} <= files
    assert m["format_version"] == 3 and m["target"]["name"] == "cpu"
    # the single-GPU layout (tests/test_parallel_run.py checks the sharded one's rank folders)
    assert "parallel" not in m and "ranks" not in m and all(f.startswith(("graphs/", "weights/")) for f in files)
    assert m["limits"]["cache_slots"] == m["limits"]["max_batch"] + 1
    assert m["boundary_check"]["ok"] and "no CUDA-graph buckets" in m["boundary_check"]["skipped"]  # cpu target
    assert ModelConfig.from_dict(m["model_config"]) == compiled[2].config
    assert [p["name"] for p in m["graphs"]["decode"]["passes"]] == [n for n, _ in default_pipeline()]


def test_graphs_hold_no_weights_and_no_pickle(compiled):
    d, m, _ = compiled
    for g in m["graphs"].values():
        ep = torch.export.load(str(d / "art" / g["file"]))
        assert len(ep.state_dict) == 0 and len(ep.constants) == 0
        with zipfile.ZipFile(d / "art" / g["file"]) as z:
            for info in z.infolist():
                data = z.read(info.filename)
                assert not data.startswith(b"\x80"), f"{info.filename} looks like a pickle"
                assert not info.filename.endswith((".pkl", ".pickle")) and (
                    not info.filename.endswith(".pt") or info.file_size == 0), info.filename


@torch.no_grad()
def test_session_logits_equal_eager_and_chunked_prefill_equals_one_shot(compiled, session):
    d, _, model = compiled
    sess = session
    ids = [5, 9, 17, 3, 44, 2, 7, 19, 23, 30, 31]
    ref = model(torch.tensor([ids]))[0]
    full = sess.logits(ids)
    assert ((full - ref).abs().max() / ref.abs().max()).item() < 1e-5
    saved, sess.max_num_batched_tokens = sess.max_num_batched_tokens, 4
    try:
        assert ((sess.logits(ids) - full).abs().max() / full.abs().max()).item() < 1e-5
    finally:
        sess.max_num_batched_tokens = saved
    with pytest.raises(ValueError, match="max_num_batched_tokens: between 1 and the artifact's max_tokens"):
        Session.load(d / "art", max_num_batched_tokens=10_000)
    # a valid max_num_batched_tokens is kept: checked on test_graphs_auto_...'s load (one load less)


@torch.no_grad()
def test_generate_batches_continuously_and_equals_eager_greedy(compiled, session):
    d, _, model = compiled
    sess = session
    results = sess.generate(PROMPTS, max_new_tokens=6)  # 6 prompts through 4 cache slots
    for p, r in zip(PROMPTS, results):
        assert r.tokens == greedy(model, torch.tensor([p]), 6)[0].tolist()
        assert r.finish_reason == "length" and r.stats["prefill_chunks"] == 1
    streamed = {}
    for i, tok in sess.stream(PROMPTS[:3], max_new_tokens=6):
        streamed.setdefault(i, []).append(tok)
    assert [streamed[i] for i in range(3)] == [r.tokens for r in results[:3]]


@torch.no_grad()
def test_greedy_steps_in_flight_stop_early_and_admit_the_waiting(compiled, session):
    """Greedy decoding keeps the next step queued before the host reads a step's tokens. Requests that stop
    at different steps (a stop id), while others wait for their slot, must still get exactly eager greedy's
    tokens, truncated at the stop id."""
    _, _, model = compiled
    ref = [greedy(model, torch.tensor([p]), 8)[0].tolist() for p in PROMPTS]
    stop = ref[1][2]  # request 1 stops at its third token; others at their first occurrence, if any
    results = session.generate(PROMPTS, max_new_tokens=8, stop=[stop])
    for want, r in zip(ref, results):
        cut = want[: want.index(stop) + 1] if stop in want else want
        assert r.tokens == cut
        assert r.finish_reason == ("stop" if stop in want else "length")
    assert sum(r.finish_reason == "stop" for r in results) >= 1


def test_graphs_auto_captures_whole_steps_only_where_every_segment_can_be(compiled):
    from types import SimpleNamespace

    from dsv4c.runtime.session import _executor_mode

    whole, split = SimpleNamespace(n_capturable=3, segments=[0, 1, 2]), SimpleNamespace(n_capturable=2, segments=[0, 1, 2])
    assert (_executor_mode("auto", whole), _executor_mode("auto", split)) == ("full", "graphs")
    assert _executor_mode("piecewise", whole) == "graphs" and _executor_mode("off", whole) == "eager"
    sess = Session.load(compiled[0] / "art", graphs="auto", max_num_batched_tokens=5)
    assert sess.executors == {}  # no GPU: auto is off
    assert sess.max_num_batched_tokens == 5  # a valid max_num_batched_tokens is kept


def test_sampling_is_seeded(session):
    sess = session
    a = sess.generate(PROMPTS[:2], max_new_tokens=8, temperature=1.0, top_p=0.9, seed=1)
    b = sess.generate(PROMPTS[:2], max_new_tokens=8, temperature=1.0, top_p=0.9, seed=1)
    c = sess.generate(PROMPTS[:2], max_new_tokens=8, temperature=1.0, top_p=0.9, seed=2)
    assert [r.tokens for r in a] == [r.tokens for r in b] != [r.tokens for r in c]


def test_bad_prompts_are_rejected_before_any_work(compiled, session):
    d, _, model = compiled
    sess = session
    V = model.config.vocab_size
    with pytest.raises(ValueError, match="max_tokens=64"):
        sess.generate([[1] * 60], max_new_tokens=8)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        sess.generate([[1, 2], [V + 3]])
    with pytest.raises(ValueError, match="empty"):
        sess.generate([[1], []])
    before = sess.pos.clone()
    with pytest.raises(ValueError, match="max_tokens=64"):
        sess.generate([[2, 3], [1] * 60], max_new_tokens=8)  # the good prompt is not started either
    assert torch.equal(sess.pos, before)


def _copy(d, tmp_path):
    art = tmp_path / "art"
    shutil.copytree(d / "art", art)
    return art


def test_load_errors_name_the_file_or_field(compiled, tmp_path):
    d, m, _ = compiled
    art = _copy(d, tmp_path)
    w = sorted((art / "weights").glob("*.safetensors"))[0]
    data = bytearray(w.read_bytes())
    data[-1] ^= 0xFF
    w.write_bytes(bytes(data))
    with pytest.raises(ArtifactError, match=f"{w.name}: sha256"):
        Session.load(art)
    (art / "graphs" / "decode.pt2").unlink()
    with pytest.raises(ArtifactError, match="decode.pt2: listed in the manifest but missing"):
        Session.load(art)
    newer = json.loads((d / "art" / "manifest.json").read_text())
    newer["format_version"] = 99
    art2 = _copy(d, tmp_path / "b")
    (art2 / "manifest.json").write_text(json.dumps(newer))
    with pytest.raises(ArtifactError, match="format_version 99 is newer"):
        Session.load(art2)
    newer["format_version"] = 2  # the compressors' state had another layout
    (art2 / "manifest.json").write_text(json.dumps(newer))
    with pytest.raises(ArtifactError, match="format_version 2 is older .* recompile"):
        Session.load(art2)
    edited = json.loads((d / "art" / "manifest.json").read_text())
    edited["limits"]["max_tokens"] = 4096  # would let prompts overrun the compiled caches
    art3 = _copy(d, tmp_path / "c")
    (art3 / "manifest.json").write_text(json.dumps(edited))
    with pytest.raises(ArtifactError, match="manifest.json: checksum does not match"):
        Session.load(art3)


@pytest.mark.long  # a second compile (b200); tests/test_quantize_experts.py::
# test_emulated_session_logits_within_the_format_threshold[b200] checks the same refusal and emulated run on
# its b200 artifact, and test_compile_never_overwrites below the FileExistsError cases
def test_target_mismatch_needs_emulate(tmp_path):
    write_random_checkpoint(small("v3-tiny"), tmp_path / "ckpt", seed=1, dtype=torch.float32)
    compile_checkpoint(tmp_path / "ckpt", tmp_path / "art", target="b200", max_tokens=32, max_batch=2,
                       dtype=torch.float32)
    with pytest.raises(TargetError, match="b200.*capability 10.0"):
        Session.load(tmp_path / "art")
    sess = Session.load(tmp_path / "art", emulate=True)
    assert len(sess.generate([[1, 2, 3]], max_new_tokens=2)[0].tokens) == 2
    with pytest.raises(FileExistsError):
        compile_checkpoint(tmp_path / "ckpt", tmp_path / "art", target="cpu")
    with pytest.raises(FileExistsError, match="only a dsv4c artifact"):  # --force never wipes other folders
        compile_checkpoint(tmp_path / "ckpt", tmp_path / "ckpt", target="cpu", force=True)
    assert (tmp_path / "ckpt" / "config.json").is_file()


@pytest.fixture(scope="module")
def mtp_compiled(v3_tiny_mtp_art):
    """small('v3-tiny') compiled with --mtp 2 (tests/conftest.py: shared with other files, read only)."""
    d = v3_tiny_mtp_art
    return d, json.loads((d / "art" / "manifest.json").read_text())


def test_mtp_artifact_keeps_a_one_token_decode_graph(mtp_compiled):
    d, m = mtp_compiled
    assert {n: (g["kind"], g["tokens_per_seq"]) for n, g in m["graphs"].items()} == {
        "prefill": ("prefill", None), "decode": ("decode", 1), "verify": ("decode", 3), "mtp": ("mtp", 3),
        "verify_mtp": ("verify_mtp", 3)}
    model = load_model(d / "ckpt")
    out = Session.load(d / "art").generate([[1, 2, 3]], max_new_tokens=4)[0].tokens
    assert out == greedy(model, torch.tensor([[1, 2, 3]]), 4)[0].tolist()


def test_compile_never_overwrites(mtp_compiled):
    d, _ = mtp_compiled
    with pytest.raises(FileExistsError):
        compile_checkpoint(d / "ckpt", d / "art", target="cpu")
    with pytest.raises(FileExistsError, match="only a dsv4c artifact"):  # --force never wipes other folders
        compile_checkpoint(d / "ckpt", d / "ckpt", target="cpu", force=True)
    assert (d / "ckpt" / "config.json").is_file()
    assert Session.load(d / "art").manifest["mtp_k"] == 2  # the refused compiles left the artifact as it was


def test_cli_inspect_and_run(compiled, capsys, tmp_path):
    d, m, model = compiled
    assert cli_main(["inspect", str(d / "art")]) == 0
    out = capsys.readouterr().out
    assert "target     cpu" in out and "graphs/decode.pt2" in out
    cfg = model.config
    n_moe = sum(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers))
    plan = m["segment_plan"]["decode"]
    assert plan["boundaries"] == n_moe and len(plan["segments"]) == 2 * n_moe + 1
    assert cli_main(["inspect", str(d / "art"), "--plan", "--plan-dir", str(tmp_path)]) == 0
    assert "SegmentPlan: decode graph" in capsys.readouterr().out
    assert (tmp_path / "decode.plan.dot").read_text().startswith("digraph")
    assert cli_main(["run", str(d / "art"), "--prompt", "x"]) == 2  # no tokenizer in a random checkpoint
    assert "tokenizer" in capsys.readouterr().err


@pytest.mark.gpu
@torch.no_grad()
def test_h200_artifact_runs_on_cuda_and_equals_eager(tmp_path):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    write_random_checkpoint(ModelConfig.preset("v4-tiny-a"), tmp_path / "ckpt", seed=3, dtype=torch.float32)
    compile_checkpoint(tmp_path / "ckpt", tmp_path / "art", target="h200", max_tokens=64, max_batch=4,
                       dtype=torch.float32, kernels={"moe_experts": "reference"})  # unquantised experts: equal to eager
    sess = Session.load(tmp_path / "art", device="cuda")
    assert sess.executors["decode"].mode == "graphs"  # auto: the reference experts are not capturable
    model = load_model(tmp_path / "ckpt").cuda()
    ids = [5, 9, 17, 3, 44, 2, 7, 19, 23]
    ref = model(torch.tensor([ids], device="cuda"))[0].float().cpu()
    got = sess.logits(ids)
    assert ((got - ref).abs().max() / ref.abs().max()).item() < 1e-4
    results = sess.generate(PROMPTS, max_new_tokens=5)
    for p, r in zip(PROMPTS, results):
        assert r.tokens == greedy(model, torch.tensor([p], device="cuda"), 5)[0].tolist()
    # the pipelined greedy steps with real asynchronous copies: stops at different steps, requests waiting
    stop = results[1].tokens[2]
    stopped = sess.generate(PROMPTS, max_new_tokens=5, stop=[stop])
    for r, full in zip(stopped, results):
        assert r.tokens == (full.tokens[: full.tokens.index(stop) + 1] if stop in full.tokens else full.tokens)


@pytest.mark.gpu
def test_expert_conversion_on_the_gpu_writes_the_same_bytes(tmp_path):
    """compile converts the released MXFP4 experts to the target's FP8 on a GPU when there is one; the
    conversion is exact, so every weight file must hash as the CPU conversion's does."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    cfg = ModelConfig.preset("v4-tiny-a")
    write_random_checkpoint(cfg, tmp_path / "release", seed=3, quant="release")
    write_random_checkpoint(cfg, tmp_path / "bf16", seed=3)
    # MXFP4 -> FP8 (exact conversion) and bf16 -> NVFP4 (quantisation from float values)
    for ckpt, fmt in (("release", None), ("bf16", "nvfp4_w4a16")):
        files = {}
        for dev in ("cpu", "cuda"):
            m = compile_checkpoint(tmp_path / ckpt, tmp_path / f"{ckpt}-{dev}", target="h200", max_tokens=64,
                                   max_batch=4, convert_device=dev, expert_format=fmt)
            assert m["convert_device"] == dev
            files[dev] = {k: v["sha256"] for k, v in m["files"].items() if k.startswith("weights/")}
        assert files["cpu"] and files["cpu"] == files["cuda"], ckpt


@torch.no_grad()
def test_compiled_artifact_serves_shared_prefixes_from_the_prefix_cache(session):
    """The compiled graphs (decode with the capture-safe cache ops) on slots restored from cached blocks
    (runtime/prefix_cache.py, on by default): the same tokens as without the cache (both prefill in
    chunks of one block)."""
    sess, chunk = session, session.max_num_batched_tokens
    pc = sess.prefix
    assert pc is not None and pc.block_size == 16
    base = torch.randint(2, sess.config.vocab_size, (40,), generator=torch.Generator().manual_seed(4)).tolist()
    ps = [base + [5, 6], base[:20] + [7, 8, 9], base[:33]]
    try:
        sess.max_num_batched_tokens, sess.prefix = 16, None
        ref = [r.tokens for r in sess.generate(ps, max_new_tokens=4)]
        sess.prefix = pc
        sess.generate([base], max_new_tokens=1)  # stores blocks [0, 16) and [16, 32)
        before = pc.stats()["hit_tokens"]
        assert [r.tokens for r in sess.generate(ps, max_new_tokens=4)] == ref
    finally:
        sess.max_num_batched_tokens, sess.prefix = chunk, pc
    assert pc.stats()["hit_tokens"] - before == 32 + 16 + 32
