"""Issue 4's benchmark: `dsv4c compile` the v4-flash-slice for h200, `dsv4c bench` the artifact, and time
the eager reference, `torch.compile` of it and HF transformers in the same run (benchmark.md's rules).

    python examples/bench_artifact.py --work /tmp/dsv4c_slice --out $OUT/artifact.json    # H200
    python examples/bench_artifact.py --quick --device cpu --work /tmp/q --out q.json      # a smoke run

Stages, each timed; the JSON is rewritten after every stage, so a timeout keeps what was measured:
  1. copy bandwidth; the slice built on the GPU (seeded random, every parameter non-trivial), its
     weights rounded in place to the release formats (FP8 128x128 attention and shared expert, MXFP4
     routed experts), so that the eager model and the checkpoint hold the same values;
  2. the release checkpoint written (`save_checkpoint(quant="release")`, the official layout);
  3. peers: B prompts of P tokens prefilled by the eager model, then greedy decode steps of
     `model.step` (the eager reference) and of `torch.compile(model.step, dynamic=True)`, each step
     timed with CUDA events; the first eager step of each batch also counts the unique routed experts
     (the roofline's expert bytes); then HF transformers' DeepseekV4ForCausalLM holding the same weights
     (examples/hf_peer.py `build_direct`), greedy `generate` of S tokens after B random P-token prompts at
     the batches up to 8 (`--hf-batches`), its decode time per step, and its logits' SNR against eager's;
  4. `dsv4c compile CKPT --target h200 --max-batch 64 ...` (a subprocess; log in the work folder);
  5. `dsv4c bench ART --batch 1 8 64 --prompt-len P --output-len S --graphs full --json ...`
     (a subprocess), and with --long-context N one more call at batch 1 with an N-token prompt;
     then benchmark.md's prefill workloads (--prefill, default 4096 and 16384 tokens at batch 1): one
     `dsv4c bench --batch 1 --prompt-len N --output-len 2` each (and per --prefill-chunks size, its
     `--max-num-batched-tokens`), whose prefill calls are timed one by one
     from an idle GPU, against the compute roofline (`prefill_flops` at the matmul peaks measured in
     stage 1: all FLOPs at the FP8 peak, and the FP8- or FP4-stored weights' FLOPs at the FP8 peak with
     the rest at the bf16 peak), and against the per-call bound (each call reads the weights and the experts
     its tokens touch again: at 2048-token calls the slice's prefill is bound by bytes, not FLOPs);
  6. on a GPU, where a Session step's time goes: the interval between decode steps against the CUDA
     graph replay alone (`step_breakdown`), in this process;
  7. accuracy next to speed (`artifact_accuracy`): the artifact's prefill logits of one prompt through
     Session.logits against the eager model's, with routing pinned to eager's decisions (only the
     kernels' and formats' error: a fast but wrong lowering shows here) and free; every summary row
     carries the pinned SNR (`pinned_snr_db`), so no speed figure stands without it.
The decode roofline is benchmark.md's: bytes a step must read (FP8 routed experts, as the artifact stores
them; bf16 everything else) over the measured copy bandwidth. Beside it, issue 28's stored-format roofline:
the dense linears the release checkpoint stores as FP8 blocks (attention, shared experts) counted at 1 byte
and one scale byte per 128 x 128 tile, as the h100/h200 targets' default `fp8_block_w8a16` reads them
(`roofline_stored_ms`; examples/bench_dense_formats.py's `stored`). `--dense-format` compiles with another
dense format (`bf16`: the widened weights the bf16-counted roofline counts).

Legend: B batch rows, P prompt tokens, S new tokens per sequence.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_segments import (EXPERT_BYTE_FACTOR, _commit, _ExpertCount, build, copy_bandwidth,  # noqa: E402
                            decode, matmul_peaks, prefill, prefill_chunk_bound, prefill_flops, step_bytes,
                            stored_bytes_saved)

from dsv4c import quant as Q  # noqa: E402
from dsv4c.checkpoint import keeps_fp32, release_format, save_checkpoint  # noqa: E402
from dsv4c.model.generate import greedy  # noqa: E402
from dsv4c.names import expert_disk_name, is_stacked  # noqa: E402


@torch.no_grad()
def round_to_release_(model) -> dict:
    """Replace every weight the release layout stores quantised by its stored (dequantised) value, in
    place: loading the written checkpoint then gives the same model. Returns counts per format."""
    cfg, counts = model.config, {"fp8": 0, "fp4": 0, "bf16": 0}
    for name, p in model.named_parameters():
        if not p.dtype.is_floating_point:
            continue
        disk = expert_disk_name(name, 0) if is_stacked(name) else name
        fmt = release_format(cfg, disk)
        if fmt is None and p.dtype != torch.bfloat16 and not keeps_fp32(disk):  # stored as bf16 (an fp32 model)
            p.copy_(p.to(torch.bfloat16))
            counts["bf16"] += 1
            continue
        if fmt == "fp4":
            for e in range(p.shape[0]):  # one expert at a time: fp32 temporaries stay small
                w, s = Q.quant_mxfp4(p[e].float())
                p[e].copy_(Q.dequant_mxfp4(w, s))
        elif fmt == "fp8":
            q, s = Q.quant_fp8_block(p.float(), scale_fmt="ue8m0")
            p.copy_(Q.dequant_fp8_block(q, Q.e8m0_to_float(s)))
        else:
            continue
        counts[fmt] += 1
    return counts


def _cache_tensors(cache) -> list[torch.Tensor]:
    return [t for lc in cache.layers for t in vars(lc).values() if isinstance(t, torch.Tensor)]


class _EagerStep:
    """bench_segments.decode's executor interface over the eager model's `step` and cache."""

    def __init__(self, step, cache):
        self.step, self.layers = step, cache.layers

    def run(self, ids, slots, pos, n_real, flat):
        return self.step(ids, slots, pos, n_real, self.layers)


@torch.no_grad()
def time_steps(step, model, cache, snapshot, B: int, steps: int, count_experts: bool = False) -> dict:
    """Greedy decode steps of `step(ids, slots, pos0, n_real, layers)` from the prefilled state
    (bench_segments.decode); with `count_experts`, one untimed step first counts the unique routed
    experts per MoE layer."""
    ex, V, dev = _EagerStep(step, cache), model.config.vocab_size, cache.pos.device
    unique = None
    if count_experts:
        for t, s in zip(_cache_tensors(cache), snapshot):
            t.copy_(s)
        with _ExpertCount() as rec:
            decode(ex, None, cache.pos, B, 1, V, dev)
        unique = rec.unique
    for t, s in zip(_cache_tensors(cache), snapshot):
        t.copy_(s)
    toks, _, times = decode(ex, None, cache.pos, B, steps, V, dev)
    warm = times[3:] if len(times) > 4 else times[1:]
    return {"batch": B, "step_ms": statistics.median(warm), "first_step_ms": times[0],
            "spread_ms": abs(statistics.median(warm[0::2]) - statistics.median(warm[1::2])) if len(warm) > 2 else 0.0,
            "tokens": toks.T.tolist(), "unique_experts": unique}


@torch.no_grad()
def hf_peer_rows(model, batches: list[int], prompt: int, steps: int, check: tuple, dtype) -> tuple[list, dict]:
    """The HF transformers peer (examples/hf_peer.py): HF's DeepseekV4ForCausalLM holding `model`'s weights
    (`build_direct`: made on the model's device in `dtype`; on a GPU the model moves to the CPU first and
    stays there, so the GPU holds one copy of the weights), greedy `generate` of `steps` tokens after B
    random prompts of `prompt` tokens (one short warm-up call first); a row's `step_ms` is its decode time
    per step. Its accuracy: its logits of `check`'s prompt against the eager model's (its own routing).
    -> (rows, info); a failure is reported in info and the run goes on (the artifact still gets measured)."""
    import hf_peer

    from dsv4c.compare import error_metrics

    why = hf_peer.unavailable_reason()
    if why:
        print(f"HF peer not available: {why}", flush=True)
        return [], {"unavailable": why}
    dev = next(model.parameters()).device
    if dev.type == "cuda":  # HF's copy is made on the GPU from the model's tensors on the CPU: one copy there
        model.to("cpu")
        gc.collect()
        torch.cuda.empty_cache()
    try:
        hf, info = hf_peer.build_direct(model, dtype, dev)
        ids, _, _, ref, _ = check
        acc = error_metrics(hf(torch.tensor([ids], device=dev)).logits[0].float().cpu(), ref.float())
        info.update(transformers=hf_peer.transformers_version(), snr_db=acc["snr_db"], cosine=acc["cosine"])
        g, V, rows = torch.Generator().manual_seed(5), model.config.vocab_size, []
        for B in batches:
            prompts = torch.randint(0, V, (B, prompt), generator=g).tolist()
            hf_peer.generate_speed(hf, prompts, 2)  # warm-up
            sp = hf_peer.generate_speed(hf, prompts, steps)
            rows.append({"batch": B, "step_ms": sp["decode_ms_per_step"], "prefill_ms": sp["prefill_ms"]})
            print(f"HF B={B}: {rows[-1]['step_ms']:.2f} ms/step", flush=True)
        del hf
    except Exception as e:  # report and go on, as the torch.compile peer does
        print(f"HF peer failed: {e}", flush=True)
        return [], {"failed": f"{type(e).__name__}: {str(e)[:300]}"}
    finally:
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    print(f"HF peer: {info}", flush=True)
    return rows, info


def _run(cmd: list[str], log: Path) -> float:
    """Run a dsv4c command line; output to `log`; raises with the log's tail on failure."""
    t0 = time.perf_counter()
    env = {**os.environ, "TQDM_MININTERVAL": "10"}
    with log.open("w") as f:
        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env).returncode
    if rc:
        raise RuntimeError(f"{' '.join(cmd)} exited {rc}:\n{log.read_text()[-3000:]}")
    return time.perf_counter() - t0


def dsv4c(*args: str) -> list[str]:
    return [sys.executable, "-m", "dsv4c", *args]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="v4-flash-slice")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--target", default="h200")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--prompt", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=27, help="decode steps per batch; the first 3 are warm-up")
    ap.add_argument("--long-context", type=int, nargs="*", default=[],
                    help="also bench batch 1 after prompts this long (benchmark.md: 8192; issue 28: 65536)")
    ap.add_argument("--prefill", type=int, nargs="*", default=[4096, 16384],
                    help="prompt lengths whose prefill (batch 1) is timed against the compute roofline")
    ap.add_argument("--prefill-chunks", type=int, nargs="+", default=[0],
                    help="prefill chunk sizes (max_num_batched_tokens) to time them at; 0: the Session's default")
    ap.add_argument("--work", type=Path, required=True, help="folder for the checkpoint and the artifact")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--dense-format", help="compile --dense-format (default: the target's)")
    ap.add_argument("--no-torch-compile", action="store_true", help="leave out the torch.compile peer")
    ap.add_argument("--no-hf", action="store_true", help="leave out the HF transformers peer")
    ap.add_argument("--hf-batches", type=int, nargs="+", default=None,
                    help="batches the HF peer decodes (default: those up to 8; its eager attention's prefill "
                         "scores at 64 x 1024 tokens, about 17 GB a layer in fp32, outgrow an 80 GB card beside "
                         "the slice's weights)")
    ap.add_argument("--quick", action="store_true", help="tiny model, short prompt, cpu target (a smoke run)")
    a = ap.parse_args(argv)
    if a.quick:
        a.preset, a.batches, a.prompt, a.steps, a.target = "v4-tiny-a", [1, 3], 40, 6, "cpu"
        a.prefill = [64] if a.prefill else []
        a.prefill_chunks = [0, 32] if a.prefill_chunks == [0] else a.prefill_chunks
    dev = torch.device(a.device)
    max_tokens = max([a.prompt, *a.long_context, *a.prefill]) + a.steps + 8  # the artifact's, every workload fits
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    a.work.mkdir(parents=True, exist_ok=True)
    ckpt, art = a.work / "ckpt", a.work / "art"
    res: dict = {"preset": a.preset, "target": a.target, "batches": a.batches, "prompt": a.prompt, "steps": a.steps,
                 "commit": _commit(), "torch": torch.__version__, "stages_s": {},
                 "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"}

    def stage(name: str, t0: float) -> None:
        res["stages_s"][name] = round(time.perf_counter() - t0, 1)
        a.out.write_text(json.dumps(res, indent=1, default=str))
        print(f"[{name}] {res['stages_s'][name]}s", flush=True)

    # 1-2. the model, rounded to the release formats, and its checkpoint
    t0 = time.perf_counter()
    bw = copy_bandwidth(dev) if dev.type == "cuda" else None
    res["copy_bandwidth_GBps"] = bw / 1e9 if bw else None
    peaks = matmul_peaks(dev) if dev.type == "cuda" else {}
    res["matmul_peak_TFLOPs"] = {k: v / 1e12 for k, v in peaks.items()}
    model = build(a.preset, dev, dtype)
    res["rounded"] = round_to_release_(model)
    stage("build", t0)
    t0 = time.perf_counter()
    save_checkpoint(model, ckpt, quant="release", overwrite=True, progress=False)
    res["checkpoint_bytes"] = sum(f.stat().st_size for f in ckpt.glob("*.safetensors"))
    stage("write_checkpoint", t0)

    # 3. peers: the eager reference and torch.compile of it
    t0 = time.perf_counter()
    n_slots, max_len = max(a.batches), a.prompt + a.steps + 8
    cache = prefill(model, n_slots + 1, a.prompt, max_len, chunk_rows=8, seed=0)  # + bench_segments' scratch slot
    snapshot = [t.clone() for t in _cache_tensors(cache)]
    stage("prefill_eager", t0)
    t0 = time.perf_counter()
    peers = res["peers"] = {"eager": [], "torch.compile": [], "hf": []}
    for B in a.batches:
        peers["eager"].append(time_steps(model.step, model, cache, snapshot, B, a.steps, count_experts=True))
        print(f"eager B={B}: {peers['eager'][-1]['step_ms']:.2f} ms/step", flush=True)
    stage("eager", t0)
    if not a.no_torch_compile:
        t0 = time.perf_counter()
        compiled = torch.compile(model.step, dynamic=True)
        for B in a.batches:
            try:
                peers["torch.compile"].append(time_steps(compiled, model, cache, snapshot, B, a.steps))
                print(f"torch.compile B={B}: {peers['torch.compile'][-1]['step_ms']:.2f} ms/step "
                      f"(first call {peers['torch.compile'][-1]['first_step_ms'] / 1e3:.1f}s)", flush=True)
            except Exception as e:  # report and go on: the artifact still gets measured
                peers["torch.compile"].append({"batch": B, "failed": f"{type(e).__name__}: {str(e)[:300]}"})
                print(f"torch.compile B={B} failed: {e}", flush=True)
        stage("torch_compile", t0)
    # the artifact's answer is checked against the eager model's on one prompt (in the breakdown stage)
    chk = torch.randint(0, model.config.vocab_size, (min(64, a.prompt),), generator=torch.Generator().manual_seed(11))
    from dsv4c.compare import eager_routing

    with torch.no_grad():
        full, routing = eager_routing(model, chk.tolist())  # logits [T, V] and eager's routing decisions
        check = (chk.tolist(), full[-1].cpu(), greedy(model, chk[None].to(dev), 8)[0].tolist(), full.cpu(), routing)
    saved = stored_bytes_saved(model)["saved"]  # the FP8-stored dense linears read as stored (issue 28)
    compiled = None  # the compiled function holds the model
    torch._dynamo.reset()
    del cache, snapshot
    if not a.no_hf:  # the HF transformers peer: the same weights in HF's DeepseekV4, `generate`
        t0 = time.perf_counter()
        hf_batches = a.hf_batches or [B for B in a.batches if B <= 8]
        peers["hf"], res["hf_peer"] = hf_peer_rows(model, hf_batches, a.prompt, a.steps, check, dtype)
        stage("hf", t0)

    def roofline(B: int, ctx: int, unique: list) -> dict:
        by = step_bytes(model, B, ctx, unique)
        roof = {"roofline_ms": by["total_fp8_experts"], "roofline_stored_ms": by["total_fp8_experts"] - saved}
        return {**by, **{k: v / bw * 1e3 if bw else None for k, v in roof.items()}}

    res["roofline"] = {r["batch"]: roofline(r["batch"], a.prompt, r["unique_experts"]) for r in peers["eager"]}
    # the batch-1 step after a long prompt: its caches' bytes, batch 1's unique experts
    unique1 = peers["eager"][0]["unique_experts"] if a.batches[0] == 1 else []
    res["roofline_long_context"] = {n: roofline(1, n, unique1) for n in a.long_context}
    res["prefill_flops"] = {P: prefill_flops(model, P) for P in a.prefill}
    if peaks and bw:  # per call: max(FLOPs at the FP8 peak, bytes at copy bandwidth), experts as the target stores
        from dsv4c.runtime.session import PREFILL_CHUNK
        from dsv4c.targets import get_target

        default = min(max_tokens, PREFILL_CHUNK)  # the Session's max_num_batched_tokens
        factor = EXPERT_BYTE_FACTOR.get(get_target(a.target).expert_format, 1.0)
        res["prefill_chunk_bound"] = {f"{P}/{c or default}": prefill_chunk_bound(model, P, c or default, peaks["fp8"],
                                                                                  bw, factor)
                                      for P in a.prefill for c in a.prefill_chunks}
    del model
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()

    # 4. dsv4c compile
    t0 = time.perf_counter()
    cmd = dsv4c("compile", str(ckpt), "--target", a.target, "-o", str(art), "--force", "--max-batch",
                str(max(a.batches)), "--max-tokens", str(max_tokens),
                "--buckets", ",".join(map(str, sorted(set(a.batches)))),  # capture only what is timed
                *(["--dense-format", a.dense_format] if a.dense_format else []))
    res["compile_command"] = " ".join(cmd[2:])
    _run(cmd, a.work / "compile.log")
    m = json.loads((art / "manifest.json").read_text())
    res["artifact"] = {"bytes": sum(f["size"] for f in m["files"].values()), "compile_seconds": m["compile_seconds"],
                       "expert_format": m["target"]["expert_format"], "dense_format": m["target"]["dense_format"],
                       "convert_device": m.get("convert_device"),
                       "buckets": m["buckets"]}
    stage("compile", t0)

    # 5. dsv4c bench; 6. the step breakdown and the check against eager (GPU); 5b. the long prompt
    graphs = "full" if dev.type == "cuda" else "off"
    res["bench"] = []

    def bench(batches: list[int], prompt: int, steps: int = a.steps, key: str = "bench", chunk: int = 0) -> None:
        t0 = time.perf_counter()
        tag = f"{key}_{prompt}" + (f"_chunk{chunk}" if chunk else "")
        js = a.work / f"{tag}.json"
        cmd = dsv4c("bench", str(art), "--batch", *map(str, batches), "--prompt-len", str(prompt), "--output-len",
                    str(steps), "--graphs", graphs, "--device", str(dev), "--json", str(js),
                    *(["--max-num-batched-tokens", str(chunk)] if chunk else []))
        _run(cmd, a.work / f"{tag}.log")
        res.setdefault(key, []).append({"command": " ".join(cmd[2:]), **json.loads(js.read_text())})
        stage(tag, t0)

    bench(a.batches, a.prompt)
    if dev.type == "cuda":
        t0 = time.perf_counter()
        try:
            res["breakdown"], res["artifact_vs_eager"] = step_breakdown(art, a.batches, a.prompt, a.steps, dev, check)
        except Exception as e:  # the bench figures above stand without it
            res["breakdown_failed"] = f"{type(e).__name__}: {str(e)[:300]}"
            print(f"breakdown failed: {e}", flush=True)
        stage("breakdown", t0)
    t0 = time.perf_counter()
    try:
        res["accuracy"] = artifact_accuracy(art, dev, check)
    except Exception as e:  # reported in every row: a speed figure without its accuracy is marked
        res["accuracy"] = {"failed": f"{type(e).__name__}: {str(e)[:300]}"}
        print(f"accuracy failed: {e}", flush=True)
    stage("accuracy", t0)
    for n in a.long_context:
        bench([1], n)
    for chunk in a.prefill_chunks:
        for P in a.prefill:
            try:
                bench([1], P, steps=2, key="prefill", chunk=chunk)
            except RuntimeError as e:  # the decode figures above stand without it
                res.setdefault("prefill_failed", {})[f"{P}/{chunk}"] = str(e)[-300:]
                print(f"prefill {P} (chunk {chunk or 'default'}) failed: {e}", flush=True)
    res["summary"] = summarize(res)
    res["long_context_summary"] = summarize_long(res)
    res["prefill_summary"] = summarize_prefill(res)
    print(table(res))
    a.out.write_text(json.dumps(res, indent=1, default=str))
    return 0


@torch.no_grad()
def step_breakdown(art: Path, batches: list[int], prompt: int, steps: int, dev,
                   check: tuple | None) -> tuple[list, dict | None]:
    """Where a Session decode step's time goes (full graphs), from CUDA events recorded without
    synchronising: `step` is the interval between consecutive decode steps' ends (what `dsv4c bench`
    reports), `replay` the CUDA graph's own span (the GPU's work; with the steps queued back to back
    nothing else delays it). step - replay is what each step runs outside its graph (input copies, the
    sampler, the token copy) and any wait for the host. Also (unless `check` is None): the Session's
    last-position logits and 8 greedy tokens for `check`'s prompt against the eager model's."""
    from dsv4c.runtime import Session

    sess = Session.load(art, device=dev, graphs="full")
    vs_eager = None
    if check is not None:
        ids, ref_logits, ref_tokens = check[:3]
        got = sess.logits(ids)[-1]
        tokens = sess.generate([ids], max_new_tokens=len(ref_tokens))[0].tokens
        vs_eager = {"prompt_len": len(ids), "logits_rel_err": ((got - ref_logits).norm() / ref_logits.norm()).item(),
                    "argmax_equal": int(got.argmax()) == int(ref_logits.argmax()),
                    "greedy_tokens_equal": sum(a == b for a, b in zip(tokens, ref_tokens)), "of": len(ref_tokens)}
        print(f"artifact vs eager: {vs_eager}", flush=True)
    ex = sess.executors["decode"]
    marks: list[tuple[str, torch.cuda.Event, torch.cuda.Event]] = []

    def wrap(obj, name: str, tag: str, only_decode: bool = False) -> None:
        f = getattr(obj, name)

        def timed(*args, **kw):
            if only_decode and args[0] != "decode":
                return f(*args, **kw)
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            out = f(*args, **kw)
            b.record()
            marks.append((tag, a, b))
            return out

        setattr(obj, name, timed)

    wrap(sess, "_run", "step", only_decode=True)
    wrap(ex, "_replay_full", "replay")
    g = torch.Generator().manual_seed(7)
    out = []
    for B in batches:
        prompts = [torch.randint(0, sess.config.vocab_size, (prompt,), generator=g).tolist() for _ in range(B)]
        sess.generate(prompts, max_new_tokens=2)
        marks.clear()
        sess.generate(prompts, max_new_tokens=steps)
        torch.cuda.synchronize(dev)
        ends = [b for tag, _, b in marks if tag == "step"]
        step = [x.elapsed_time(y) for x, y in zip(ends, ends[1:])]
        replay = [a.elapsed_time(b) for tag, a, b in marks if tag == "replay"]
        med = {"step": statistics.median(step[2:]), "replay": statistics.median(replay[3:])}
        out.append({"batch": B, "step_ms": med["step"], "replay_ms": med["replay"],
                    "host_wait_ms": med["step"] - med["replay"]})
        print(f"breakdown B={B}: step {med['step']:.3f} ms, replay {med['replay']:.3f}", flush=True)
    del sess
    torch.cuda.empty_cache()
    return out, vs_eager


@torch.no_grad()
def artifact_accuracy(art: Path, dev, check: tuple) -> dict:
    """The artifact's prefill logits of `check`'s prompt (Session.logits, op by op) against the eager
    model's, routing pinned to eager's decisions and free; per-layer routing flips (free)."""
    from dsv4c.compare import artifact_logits, error_metrics
    from dsv4c.routing import routing_flips
    from dsv4c.runtime import Session

    ids, _, _, ref, routing = check
    sess = Session.load(art, device=dev, graphs="off")
    pinned, _ = artifact_logits(sess, ids, routing)
    free, tap = artifact_logits(sess, ids)
    del sess
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    p, f = error_metrics(pinned, ref), error_metrics(free, ref)
    out = {"prompt_len": len(ids), "pinned_snr_db": p["snr_db"], "pinned_max_abs_err": p["max_abs_err"],
           "pinned_cosine": p["cosine"], "free_snr_db": f["snr_db"], "free_cosine": f["cosine"],
           "flips": [x["share"] for x in routing_flips(routing, tap.seen)]}
    print(f"artifact accuracy (pinned routing): {out}", flush=True)
    return out


def summarize(res: dict) -> list[dict]:
    """Per batch: the artifact's decode step against its roofline and against the peers."""
    peer = {name: {r["batch"]: r for r in rows if "step_ms" in r} for name, rows in res["peers"].items()}
    out = []
    for r in res["bench"][0]["rows"]:
        B = r["batch"]
        roof = res["roofline"].get(B, {}).get("roofline_ms")
        stored = res["roofline"].get(B, {}).get("roofline_stored_ms")  # FP8-stored dense at 1 byte (issue 28)
        row = {"batch": B, "artifact_step_ms": r["step_ms_p50"], "artifact_decode_tok_s": r["decode_tokens_per_s"],
               "roofline_ms": roof, "roofline_fraction": roof / r["step_ms_p50"] if roof else None,
               "roofline_stored_ms": stored, "roofline_stored_fraction": stored / r["step_ms_p50"] if stored else None,
               "pinned_snr_db": res.get("accuracy", {}).get("pinned_snr_db"),
               "free_snr_db": res.get("accuracy", {}).get("free_snr_db")}
        bd = next((x for x in res.get("breakdown", []) if x["batch"] == B), None)
        if bd:
            row["replay_ms"] = bd["replay_ms"]
            row["replay_roofline_fraction"] = roof / bd["replay_ms"] if roof else None
        for name, by_b in peer.items():
            if B in by_b:
                row[f"{name}_step_ms"] = by_b[B]["step_ms"]
                row[f"speedup_vs_{name}"] = by_b[B]["step_ms"] / r["step_ms_p50"]
        out.append(row)
    return out


def summarize_long(res: dict) -> list[dict]:
    """Per long prompt: the batch-1 step after it against the roofline at that context (its cache reads)."""
    roofs = res.get("roofline_long_context") or {}
    out = []
    for b in res["bench"][1:]:
        r = b["rows"][0]
        roof = roofs.get(r["prompt_len"]) or roofs.get(str(r["prompt_len"]))  # int keys turn str in JSON
        row = {"prompt": r["prompt_len"], "artifact_step_ms": r["step_ms_p50"],
               "prefill_tokens_per_s": r["prefill_tokens_per_s"]}
        for k in ("roofline_ms", "roofline_stored_ms"):
            row[k] = roof[k]
            row[k.replace("_ms", "_fraction")] = roof[k] / r["step_ms_p50"] if roof[k] else None
        out.append(row)
    return out


def summarize_prefill(res: dict) -> list[dict]:
    """Per prompt length: the prefill's time (its calls, each from an idle GPU) against the compute
    roofline: all FLOPs at the FP8 peak (`fp8_roofline`), and FP8/FP4-stored weights' FLOPs at the FP8
    peak with the rest at the bf16 peak (`mixed_roofline`); and against the calls' bound (`chunk_bound`,
    bench_segments.prefill_chunk_bound: per call the larger of its FLOPs and the bytes it must read)."""
    peak = {k: v * 1e12 for k, v in res.get("matmul_peak_TFLOPs", {}).items()}
    out = []
    for b in res.get("prefill", []):
        r = b["rows"][0]
        P, s = r["prompt_len"], r["prefill_s"]
        fl = res["prefill_flops"].get(P) or res["prefill_flops"].get(str(P))  # int keys turn str in JSON
        row = {"prompt": P, "chunk": r.get("max_num_batched_tokens"), "calls": r.get("prefill_calls"),
               "prefill_ms": s * 1e3, "tokens_per_s": r["prefill_tokens_per_s"],
               "tflop": fl["total"] / 1e12, "achieved_TFLOPs": fl["total"] / s / 1e12}
        bound = res.get("prefill_chunk_bound", {}).get(f"{P}/{row['chunk']}")
        if bound:  # the calls' bound: bytes before FLOPs while a call re-reads every expert
            row.update(chunk_bound_ms=bound["ms"], chunk_bound_fraction=bound["ms"] / 1e3 / s)
        if peak:
            fp8 = fl["total"] / peak["fp8"]
            mixed = fl["fp8"] / peak["fp8"] + (fl["total"] - fl["fp8"]) / peak["bf16"]
            row.update(fp8_roofline_ms=fp8 * 1e3, fp8_roofline_fraction=fp8 / s,
                       mixed_roofline_ms=mixed * 1e3, mixed_roofline_fraction=mixed / s)
        out.append(row)
    return out


def table(res: dict) -> str:
    def f(v, fmt):
        return "-" if v is None else format(v, fmt)

    lines = [f"{res['preset']} -> {res['target']} artifact on {res['device']} (copy bandwidth "
             f"{f(res.get('copy_bandwidth_GBps'), '.0f')} GB/s), prompt {res['prompt']}",
             "| batch | artifact ms/step | tok/s | roofline ms | vs roofline | stored-format roofline ms | vs it | "
             "replay ms | replay vs roofline | eager ms | vs eager | torch.compile ms | vs torch.compile | "
             "HF ms | vs HF | SNR dB pinned (free) |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in res["summary"]:
        lines.append(f"| {r['batch']} | {r['artifact_step_ms']:.2f} | {r['artifact_decode_tok_s']:.1f} | "
                     f"{f(r['roofline_ms'], '.3f')} | {f(r['roofline_fraction'], '.1%')} | "
                     f"{f(r.get('roofline_stored_ms'), '.3f')} | {f(r.get('roofline_stored_fraction'), '.1%')} | "
                     f"{f(r.get('replay_ms'), '.3f')} | {f(r.get('replay_roofline_fraction'), '.1%')} | "
                     f"{f(r.get('eager_step_ms'), '.2f')} | {f(r.get('speedup_vs_eager'), '.1f')}x | "
                     f"{f(r.get('torch.compile_step_ms'), '.2f')} | {f(r.get('speedup_vs_torch.compile'), '.1f')}x | "
                     f"{f(r.get('hf_step_ms'), '.2f')} | {f(r.get('speedup_vs_hf'), '.1f')}x | "
                     f"{_snr(r.get('pinned_snr_db'))} ({_snr(r.get('free_snr_db'))}) |")
    for lc in res.get("long_context_summary") or []:
        lines.append(f"batch 1 after a {lc['prompt']}-token prompt: {lc['artifact_step_ms']:.3f} ms/step, "
                     f"{f(lc['roofline_fraction'], '.1%')} of its roofline ({f(lc['roofline_ms'], '.3f')} ms), "
                     f"{f(lc['roofline_stored_fraction'], '.1%')} of the stored-format one; prefill "
                     f"{lc['prefill_tokens_per_s']:.0f} tokens/s")
    pk = res.get("matmul_peak_TFLOPs") or {}
    if res.get("prefill_summary"):
        lines += [f"prefill, batch 1 (matmul peaks: bf16 {f(pk.get('bf16'), '.0f')}, FP8 {f(pk.get('fp8'), '.0f')} "
                  "TFLOP/s)",
                  "| tokens | chunk | calls | ms | tokens/s | TFLOP | TFLOP/s | FP8 roofline ms | vs it | "
                  "mixed roofline ms | vs it | per-call bound ms | vs it |",
                  "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for r in res["prefill_summary"]:
            lines.append(f"| {r['prompt']} | {r['chunk']} | {r['calls']} | {r['prefill_ms']:.1f} | "
                         f"{r['tokens_per_s']:.0f} | {r['tflop']:.2f} | "
                         f"{r['achieved_TFLOPs']:.1f} | {f(r.get('fp8_roofline_ms'), '.2f')} | "
                         f"{f(r.get('fp8_roofline_fraction'), '.1%')} | {f(r.get('mixed_roofline_ms'), '.2f')} | "
                         f"{f(r.get('mixed_roofline_fraction'), '.1%')} | {f(r.get('chunk_bound_ms'), '.2f')} | "
                         f"{f(r.get('chunk_bound_fraction'), '.1%')} |")
    acc = res.get("accuracy", {})
    lines.append(f"SNR: the artifact's prefill logits (Session.logits, {acc.get('prompt_len', '?')} tokens) against the "
                 "eager model's with routing pinned to eager's decisions (free in parentheses)"
                 + (f"; accuracy check failed: {acc['failed']}" if "failed" in acc else ""))
    hf = res.get("hf_peer")
    if hf:
        lines.append("HF peer: " + (f"transformers {hf['transformers']} DeepseekV4ForCausalLM, eager attention, "
                                    f"{hf['cast']}, `generate` (decode ms per step); its logits vs eager's: "
                                    f"{_snr(hf['snr_db'])} dB SNR, its own routing" if "snr_db" in hf
                                    else hf.get("unavailable") or hf.get("failed", "?")))
    return "\n".join(lines)


def _snr(v) -> str:
    return "-" if v is None else ("inf" if v == float("inf") else f"{v:.1f}")


if __name__ == "__main__":
    raise SystemExit(main())
