"""Decode step of the V4-Flash-shaped slice: eager segments vs piecewise CUDA graphs vs one full graph.

    python examples/bench_segments.py --out bench_segments.json          # H200: v4-flash-slice, bf16
    python examples/bench_segments.py --quick --device cpu               # a smoke run (tiny model)

What it does, in one run (benchmark.md's rules):
  1. builds the slice (seeded random weights on the GPU, every parameter non-trivial), and a cache of
     max(batch)+1 slots (the last is the scratch slot) prefilled with a 1024-token prompt per slot by
     the eager model;
  2. exports the decode graph (1 token per row) twice, through the h200 pipeline: with the reference
     expert op (eager between graph segments) and with the capture-safe `moe_experts_gathered`;
  3. for each graph and executor mode, restores the prefilled caches and runs the same greedy decode
     steps at each batch size, timing each step with CUDA events (median after warm-up);
  4. checks that every mode gives the same tokens and logits as the eager split module, that a batch
     that is not a bucket size (padded) equals eager, and records capture time and graph memory;
  5. measures copy bandwidth and derives the decode roofline (benchmark.md: bytes the step must read).

Legend: B batch rows, T tokens per row (1), V vocab, D hidden.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import time
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from dsv4c import ModelConfig
from dsv4c.export import GraphSpec, export_graph, flat_caches
from dsv4c.model import build_model
from dsv4c.passes import PassContext, run_pipeline
from dsv4c.passes.overlap_shared_experts import overlap_shared_experts
from dsv4c.passes.split_at_routers import apply_plan, plan_segments
from dsv4c.runtime.sampling import greedy_rows
from dsv4c.runtime.segments import SegmentExecutor
from dsv4c.targets import DEFAULT_BUCKETS


def slice_config(preset: str, layers: int | None = None) -> ModelConfig:
    """The preset's config, cut to its first `layers` layers when given (the MTP layer's ratio kept)."""
    cfg = ModelConfig.preset(preset)
    if layers:
        r = list(cfg.compress_ratios)
        cfg = cfg.replace(num_hidden_layers=layers, compress_ratios=tuple(r[:layers]) + (r[-1],),
                          num_hash_layers=min(cfg.num_hash_layers, layers))
    return cfg


def build(preset: str, device, dtype, layers: int | None = None):
    return build_model(slice_config(preset, layers), device, dtype, on_device=True)


# --only h200-static-ops: the h200 lowering with the capture-safe ATen forms of the cache ops and the
# unfused router instead of the Triton ones (the lowering before the fused kernels), for a side-by-side
STATIC_OPS = {"v4_attention": "static", "v4_compress": "static", "v4_indexer_topk": "reference",
              "head_rms_rope": "reference"}
ABLATED = ("fuse_sinkhorn", "fuse_hc", "fuse_rmsnorm", "fuse_rope", "lower_f32_linears")  # --ablate: without these passes


def graph(model, n_slots: int, max_len: int, kernels: dict, quantize: bool = False, skip: tuple = (),
          kind: str = "decode", k: int = 0, extra_ring_slots: int = 0, expert_format: str | None = None,
          dense_format: str | None = None, deterministic: bool = False, side_stream: bool = False):
    """A graph (default: decode, 1 token per row) lowered for h200; `quantize=False` skips
    quantize_experts (bf16 experts); `skip` leaves out further passes; `expert_format` and `dense_format`
    override the target's formats (as `compile --expert-format / --dense-format`; in-memory dense weights
    are quantised to FP8 blocks by passes/quantize_dense.py); `deterministic` lowers as `compile
    --deterministic` does (passes/make_batch_invariant.py; the caller picks the kernels and experts);
    `side_stream` forks the shared experts onto a second stream as `Session.load` does for a step captured
    whole (passes/overlap_shared_experts.py; only where every segment is capturable)."""
    ctx = PassContext(model.config, "h200", kind, tuple(sorted(kernels.items())), expert_format,
                      dense_format=dense_format, deterministic=deterministic)
    spec = GraphSpec(kind, k=k, n_slots=n_slots, max_len=max_len, extra_ring_slots=extra_ring_slots)
    gm = export_graph(model, spec).module()
    gm, records = run_pipeline(gm, ctx, skip=tuple(skip) + (() if quantize else ("quantize_experts",)))
    plan = plan_segments(gm, ctx)
    stats = {r.name: r.stats for r in records}
    if side_stream and plan.n_capturable == len(plan.segments):
        gm = (res := overlap_shared_experts(gm, ctx)).graph
        stats["overlap_shared_experts"] = res.stats
        plan = plan_segments(gm, ctx)
    return plan, apply_plan(gm, plan), stats


@torch.no_grad()
def prefill(model, n_slots: int, prompt: int, max_len: int, chunk_rows: int, seed: int):
    cache = model.new_cache(n_slots, max_len=max_len)
    g = torch.Generator().manual_seed(seed)
    V = model.config.vocab_size
    for s in range(0, n_slots - 1, chunk_rows):  # the last slot is scratch
        rows = torch.arange(s, min(s + chunk_rows, n_slots - 1))
        ids = torch.randint(0, V, (len(rows), prompt), generator=g)
        model(ids.to(cache.pos.device), cache, slots=rows.to(cache.pos.device))
    return cache


class _ExpertCount(TorchDispatchMode):
    """Unique routed experts per MoE call (for the roofline)."""

    def __init__(self):
        super().__init__()
        self.unique: list[int] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if "moe_experts" in str(func):
            self.unique.append(int(args[1].unique().numel()))
        return func(*args, **(kwargs or {}))


def decode(ex, flat, pos0, B: int, steps: int, V: int, dev, seed: int = 1, lead_cycles: int = 0):
    """Greedy steps from the prefilled state; -> (tokens [steps, B], first logits, step times ms).
    lead_cycles > 0 (GPU): a sleep kernel of that many clock cycles runs before each step's start event,
    so the host has enqueued the step before the GPU reaches it and the time is the GPU's alone."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (B, 1), generator=g).to(dev)
    slots = torch.arange(B, device=dev)
    pos = pos0[:B].clone()
    one = torch.ones(B, dtype=torch.int64, device=dev)
    toks, times, first = [], [], None
    for _ in range(steps):
        if dev.type == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            if lead_cycles:
                torch.cuda._sleep(lead_cycles)
            a.record()
        t0 = time.perf_counter()
        logits = ex.run(ids, slots, pos, one, flat)[0]  # [B, 1, V]
        if dev.type == "cuda":
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
        else:
            times.append((time.perf_counter() - t0) * 1e3)
        first = logits.float().clone() if first is None else first
        ids = greedy_rows(logits[:, -1])[:, None]  # the Session's greedy pick (kernels/argmax.py on a GPU)
        toks.append(ids[:, 0].cpu())
        pos += 1
    return torch.stack(toks), first, times


def copy_bandwidth(dev) -> float:
    """Bytes read + written per second of a 1 GiB device-to-device copy."""
    x = torch.empty(1 << 30, dtype=torch.uint8, device=dev)
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    torch.cuda.synchronize()
    ms = []
    for _ in range(10):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        y.copy_(x)
        b.record()
        b.synchronize()
        ms.append(a.elapsed_time(b))
    return 2 * x.numel() / (statistics.median(ms) / 1e3)


# bytes of a routed-expert weight in a format against bf16's 2 (weights + block scales)
EXPERT_BYTE_FACTOR = {"fp8_block": (1 + 4 / 128 ** 2) / 2, "mxfp4_w4a16": (0.5 + 1 / 32) / 2,
                      "nvfp4_w4a16": (0.5 + 1 / 16) / 2}


def expected_unique(E: int, top: int, tokens: int) -> float:
    """Expected distinct experts `tokens` tokens choose under uniform routing (top of E each)."""
    return E * (1 - (1 - top / E) ** tokens)


def matmul_peaks(dev, n: int = 8192) -> dict:
    """benchmark.md's matmul peaks, FLOP/s of one n^3 product: bf16 `torch.matmul` and FP8 e4m3
    `torch._scaled_mm` (per-tensor scales, bf16 out); median of 10 CUDA-event timings after warm-up."""
    a = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    a8, b8 = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn).t()  # _scaled_mm: b column-major
    one = torch.ones((), device=dev)
    out = {}
    for name, fn in (("bf16", lambda: a @ b),
                     ("fp8", lambda: torch._scaled_mm(a8, b8, one, one, out_dtype=torch.bfloat16))):
        for _ in range(3):
            fn()
        ms = []
        for _ in range(10):
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            fn()
            e1.record()
            e1.synchronize()
            ms.append(e0.elapsed_time(e1))
        out[name] = 2 * n ** 3 / (statistics.median(ms) / 1e3)
    return out


def _linear_params(model) -> tuple[int, int]:
    """(all, FP8-stored) weight elements one token multiplies in the non-expert linears of all layers:
    every 2-D parameter of `layers.*` but the routed experts and the compressors' `ape` (added, not
    multiplied). The embedding (a lookup), the head (prefill's last row only) and the MTP block stay out."""
    from dsv4c.checkpoint import release_format

    total = fp8 = 0
    for name, p in model.named_parameters():
        if not name.startswith("layers.") or p.dim() != 2 or ".ffn.experts." in name or name.endswith(".ape"):
            continue
        total += p.numel()
        fp8 += p.numel() if release_format(model.config, name) == "fp8" else 0
    return total, fp8


def prefill_flops(model, P: int) -> dict:
    """FLOPs a prefill of one P-token prompt from position 0 must do (deepseek_v4.md §4), counted as
    2 per multiply-add: the non-expert linears and the top-k routed experts per token, the LM head for
    the last row, and per layer the attention over each query's keys (its window, plus the visible
    compressed entries: all of them for HCA, the indexer's top-k for CSA, QK^T and PV with one shared
    KV row of head_dim) and the indexer's scores over every visible entry. Elementwise work (norms,
    RoPE, SwiGLU, compressor pooling, softmax) is left out. `fp8` is the share of the FLOPs whose
    weights the release stores as FP8 or FP4 (dense FP8 blocks and routed experts)."""
    cfg = model.config
    dense, dense_fp8 = _linear_params(model)
    expert = 3 * cfg.hidden_size * cfg.moe_intermediate_size * cfg.num_experts_per_tok * cfg.num_hidden_layers
    t = torch.arange(1, P + 1, dtype=torch.float64)  # keys visible to query t - 1, itself included
    attn = index = 0.0
    for m in cfg.compress_ratios[:cfg.num_hidden_layers]:
        keys = t.clamp(max=cfg.sliding_window)
        if m:
            visible = torch.div(t, m, rounding_mode="floor")
            keys = keys + (visible.clamp(max=cfg.index_topk) if m == 4 else visible)
            if m == 4:
                index += 2 * cfg.index_n_heads * cfg.index_head_dim * float(visible.sum())
        attn += 2 * 2 * cfg.num_attention_heads * cfg.head_dim * float(keys.sum())
    out = {"linear": 2 * P * dense, "experts": 2 * P * expert, "head": 2 * cfg.vocab_size * cfg.hidden_size,
           "attention": attn, "indexer": index}
    out["total"] = sum(out.values())
    out["fp8"] = 2 * P * (dense_fp8 + expert)
    return out


def prefill_chunk_bound(model, P: int, chunk: int, flop_s: float, byte_s: float, expert_factor: float) -> dict:
    """The bound of a prefill of P tokens in calls of `chunk` tokens: per call, max(its FLOPs at `flop_s`, the
    bytes it must read at `byte_s`), summed. A call reads every non-expert weight, counted in bf16 as
    `step_bytes` counts it (an artifact with FP8 dense reads those linears' stored bytes: fewer), the head (its last row's logits) and the unique routed experts its tokens touch
    under uniform routing (`expected_unique`; a 2048-token call of Flash's top-6 of 256 touches all), at
    `expert_factor` of their bf16 bytes (EXPERT_BYTE_FACTOR). Seconds: {"ms", "bytes_ms", "flops_ms"}."""
    cfg = model.config
    by = step_bytes(model, 1, 0, [1] * cfg.num_hidden_layers)  # one expert per layer: its bytes
    expert = by["routed_experts"] / cfg.num_hidden_layers * expert_factor  # one expert of one layer
    total = {"ms": 0.0, "bytes_ms": 0.0, "flops_ms": 0.0}
    done, prev = 0, prefill_flops(model, 0)["total"] - 2 * cfg.vocab_size * cfg.hidden_size  # no head yet
    while done < P:
        n = min(chunk, P - done)
        f = prefill_flops(model, done + n)["total"]
        fl = f - prev  # the call's FLOPs: its tokens' linears, experts, attention and indexer, and its head row
        prev = f - 2 * cfg.vocab_size * cfg.hidden_size
        nbytes = (by["non_expert_weights"] + by["head"]
                  + cfg.num_hidden_layers * expected_unique(cfg.n_routed_experts, cfg.num_experts_per_tok, n) * expert)
        total["flops_ms"] += fl / flop_s * 1e3
        total["bytes_ms"] += nbytes / byte_s * 1e3
        total["ms"] += max(fl / flop_s, nbytes / byte_s) * 1e3
        done += n
    return total


def step_bytes(model, B: int, ctx_len: int, unique: list[int]) -> dict:
    """benchmark.md's roofline bytes of one decode step, as stored (bf16 weights, bf16 caches)."""
    cfg = model.config
    el = 2
    routed = head = embed = other = 0
    for name, p in model.named_parameters():
        if name.startswith("mtp."):
            continue
        n = p.numel() * p.element_size()
        if ".ffn.experts." in name:
            routed += n // cfg.n_routed_experts  # one expert's bytes, summed over layers
        elif name.startswith("embed."):
            embed += B * cfg.hidden_size * el
        elif name.startswith("head."):
            head += n
        else:
            other += n
    experts = sum(unique) * routed // cfg.num_hidden_layers  # unique experts per layer x one expert's bytes
    kv = 0
    d = cfg.head_dim
    for i in range(cfg.num_hidden_layers):
        m = cfg.compress_ratios[i]
        kv += B * min(ctx_len, cfg.sliding_window) * d * el
        if m == 4:
            kv += B * min(ctx_len // 4, cfg.index_topk) * d * el
            kv += B * (ctx_len // 4) * cfg.index_head_dim * el  # indexer keys scanned
        elif m:
            kv += B * (ctx_len // m) * d * el
    total = other + experts + embed + head + kv
    return {"non_expert_weights": other, "routed_experts": experts, "embedding_rows": embed, "head": head,
            "kv": kv, "total": total,
            "total_fp8_experts": total - experts // 2,  # 1-byte experts (their scales are negligible)
            "total_mxfp4_experts": total - experts + experts * 17 // 64,  # 4 bits + one e8m0 byte per 32
            "per_layer_no_head": (other + experts + kv) / cfg.num_hidden_layers}


def stored_bytes_saved(model) -> dict:
    """Bytes a decode step reads less when the release's FP8 non-expert weights are read as stored
    (2 bytes -> 1 byte + 1 scale byte per 128x128 tile), in total and for the grouped wo_a alone."""
    from dsv4c.checkpoint import release_format

    saved = wo_a = 0
    for name, p in model.named_parameters():
        if name.startswith("mtp.") or ".ffn.experts." in name or release_format(model.config, name) != "fp8":
            continue
        n = p.numel()
        d = n * p.element_size() - (n + n // (128 * 128))
        saved += d
        wo_a += d if ".attn.wo_a." in name else 0
    return {"saved": saved, "wo_a_saved": wo_a}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="v4-flash-slice")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--prompt", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=27, help="decode steps; the first 3 are warm-up")
    ap.add_argument("--quick", action="store_true", help="tiny model, short prompt (a smoke run)")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--quantized", action="store_true", help="add the h200 lowerings of the experts "
                    "(quantize_experts: the target's format, Triton grouped kernels)")
    ap.add_argument("--only", nargs="+", default=None, help="lowerings to time (ref-experts is always built: "
                    "the roofline counts its routing), e.g. --only h200-experts")
    ap.add_argument("--skip-passes", nargs="+", default=None, metavar="PASS",
                    help="add h200-skip: the h200-experts lowering without these passes (their effect, same run)")
    ap.add_argument("--ablate", action="store_true",
                    help=f"add the gathered lowering without {', '.join(ABLATED)} (their speedup in the same run)")
    ap.add_argument("--inductor", action="store_true",
                    help="add the peer: torch.compile of the whole eager reference step (slow to compile)")
    a = ap.parse_args(argv)
    if a.quick:
        a.preset, a.batches, a.prompt, a.steps = "v4-tiny-a", [1, 3], 40, 6
    dev = torch.device(a.device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    t0 = time.perf_counter()
    model = build(a.preset, dev, dtype)
    cfg = model.config
    n_slots = max(a.batches) + 1
    max_len = a.prompt + a.steps + 8
    res: dict = {"preset": a.preset, "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
                 "torch": torch.__version__, "batches": a.batches, "prompt": a.prompt, "steps": a.steps,
                 "commit": _commit(), "build_s": round(time.perf_counter() - t0, 1)}
    print(f"built {a.preset} in {res['build_s']}s", flush=True)
    t0 = time.perf_counter()
    cache = prefill(model, n_slots, a.prompt, max_len, chunk_rows=8, seed=0)
    if dev.type == "cuda":
        torch.cuda.synchronize()
    res["prefill_s"] = round(time.perf_counter() - t0, 1)
    flat = flat_caches(cache.layers)
    snapshot = {k: t.clone() for k, t in flat.items()}
    pos0 = cache.pos.clone()
    print(f"prefilled {n_slots - 1} x {a.prompt} tokens in {res['prefill_s']}s", flush=True)

    graphs = {}
    variants = [("ref-experts", {}, False), ("gathered-experts", {"moe_experts": "gathered"}, False)]
    if a.ablate:  # the same lowering without the fusion passes, timed in the same run
        variants.append(("gathered-unfused", {"moe_experts": "gathered"}, False))
    if a.quantized:
        variants.append(("h200-experts", {}, True))
        variants.append(("h200-mxfp4", {}, True))   # the release MXFP4 experts, weight-only (W4A16)
        variants.append(("h200-static-ops", STATIC_OPS, True))  # the cache ops before the fused kernels
        if a.skip_passes:
            variants.append(("h200-skip", {}, True))
    if a.only:  # keep GPU memory for one lowering (each holds its own fused / quantised weights)
        variants = [v for v in variants if v[0] in a.only or v[0] == "ref-experts"]
    for name, kernels, quantize in variants:
        skip = (ABLATED if name.endswith("-unfused") else ("fuse_router",) if name == "h200-static-ops"
                else tuple(a.skip_passes) if name == "h200-skip" else ())
        t0 = time.perf_counter()
        try:
            graphs[name] = graph(model, n_slots, max_len, kernels, quantize, skip,
                                 expert_format="mxfp4_w4a16" if name == "h200-mxfp4" else None)
        except Exception as e:  # report, keep measuring the others
            print(f"{name}: lowering failed: {type(e).__name__}: {e}", flush=True)
            res.setdefault("failed", {})[name] = f"{type(e).__name__}: {e}"
            continue
        plan = graphs[name][0]
        print(f"{name}: exported + lowered in {time.perf_counter() - t0:.1f}s; {len(plan.segments)} segments, "
              f"{plan.n_capturable} capturable", flush=True)
    buckets = tuple(b for b in DEFAULT_BUCKETS if b < n_slots) + tuple(b for b in DEFAULT_BUCKETS if b >= n_slots)[:1]
    graph_mode = "graphs" if dev.type == "cuda" else "emulate"
    full_mode = "full" if dev.type == "cuda" else "full-emulate"
    configs = [("ref-experts", "eager"), ("ref-experts", graph_mode), ("gathered-experts", "eager"),
               ("gathered-experts", graph_mode), ("gathered-experts", full_mode)]
    configs = [c for c in configs if c[0] in graphs and (not a.only or c[0] in a.only)]
    if "gathered-unfused" in graphs:
        configs += [("gathered-unfused", "eager"), ("gathered-unfused", full_mode)]
    for q in ("h200-experts", "h200-mxfp4", "h200-static-ops", "h200-skip"):  # quantised Triton experts (capture-safe)
        if q in graphs:
            configs += [(q, "eager"), (q, graph_mode), (q, full_mode)]
    if a.inductor:  # the peer: torch.compile of the eager reference step
        configs.append(("ref-experts", "eager+torch.compile"))
    # roofline
    plan, split, _ = graphs["ref-experts"]
    ex = SegmentExecutor(split, plan, dev, mode="eager")
    roof = {}
    bw = copy_bandwidth(dev) if dev.type == "cuda" else None
    res["copy_bandwidth_GBps"] = bw / 1e9 if bw else None
    for B in a.batches:
        for k, t in flat.items():
            t.copy_(snapshot[k])
        rec = _ExpertCount()
        with rec:
            ids = torch.randint(0, cfg.vocab_size, (B, 1), generator=torch.Generator().manual_seed(B)).to(dev)
            ex.run(ids, torch.arange(B, device=dev), pos0[:B].clone(),
                   torch.ones(B, dtype=torch.int64, device=dev), flat)
        by = step_bytes(model, B, a.prompt, rec.unique)
        roof[B] = {**by, "unique_experts": rec.unique, "roofline_ms": by["total"] / bw * 1e3 if bw else None,
                   "roofline_fp8_experts_ms": by["total_fp8_experts"] / bw * 1e3 if bw else None,
                   "roofline_mxfp4_experts_ms": by["total_mxfp4_experts"] / bw * 1e3 if bw else None}
    res["roofline"] = roof

    rows = []
    baseline = {}
    res["rows"] = rows  # written after every configuration: a timeout keeps what was measured
    for gname, mode in configs:
        try:
            plan, split, _ = graphs[gname]
            t0, setup = time.perf_counter(), None
            ex = SegmentExecutor(split, plan, dev, buckets=buckets, mode=mode.removesuffix("+torch.compile"),
                                 pad_slot=n_slots - 1)
            if mode.endswith("+torch.compile"):  # compile up front, timed
                ex.gm = torch.compile(split, dynamic=True)  # the whole eager step, reference ops opaque
                for k, t in flat.items():
                    t.copy_(snapshot[k])
                decode(ex, flat, pos0, 1, 1, cfg.vocab_size, dev)
                setup = time.perf_counter() - t0
                print(f"torch.compile of the eager step: {setup:.1f}s", flush=True)
            for B in a.batches:
                for k, t in flat.items():
                    t.copy_(snapshot[k])
                toks, logits, ms = decode(ex, flat, pos0, B, a.steps, cfg.vocab_size, dev)
                key = (gname, B)
                if mode == "eager":
                    baseline[key] = (toks, logits)
                ref_toks, ref_logits = baseline[key]
                err = ((logits - ref_logits).abs().max() / ref_logits.abs().max()).item()
                med = statistics.median(ms[3:])
                spread = abs(statistics.median(ms[3::2]) - statistics.median(ms[4::2])) if len(ms) > 5 else 0.0
                rows.append({"graph": gname, "mode": mode, "batch": B, "step_ms": med, "spread_ms": spread,
                             "tokens_equal_eager": bool(torch.equal(toks, ref_toks)), "logits_rel_err_vs_eager": err})
                print(f"{gname:17} {mode:12} B={B:3}: {med:8.3f} ms/step  tokens==eager {rows[-1]['tokens_equal_eager']}"
                      f"  rel err {err:.2e}", flush=True)
            st = ex.stats
            rows.append({"graph": gname, "mode": mode, "capture_s": st["capture_s"],
                         "setup_s": setup, "graph_bytes": st["graph_bytes"],
                         "graph_reserved_bytes": st["graph_reserved_bytes"], "static_buffer_bytes": st["static_buffer_bytes"],
                         "buckets": list(ex.buckets)})
            del ex
        except Exception as e:  # a failed configuration is reported, the others still run
            print(f"{gname} {mode}: failed: {type(e).__name__}: {e}", flush=True)
            rows.append({"graph": gname, "mode": mode, "failed": f"{type(e).__name__}: {str(e)[:300]}"})
        if a.out:
            a.out.write_text(json.dumps(res, indent=1, default=str))
    res["rows"] = rows

    # padding: a batch that is not a bucket size equals eager
    odd = next((b for b in range(2, max(a.batches)) if b not in buckets), None)
    padded_graph = next((g for g in ("gathered-experts", "h200-experts") if g in graphs), None)
    if odd and padded_graph:
        plan, split, _ = graphs[padded_graph]
        outs = {}
        for mode in ("eager", graph_mode, full_mode):
            ex = SegmentExecutor(split, plan, dev, buckets=buckets, mode=mode, pad_slot=n_slots - 1)
            for k, t in flat.items():
                t.copy_(snapshot[k])
            outs[mode] = decode(ex, flat, pos0, odd, 4, cfg.vocab_size, dev)
            del ex
        e_t, e_l, _ = outs["eager"]
        res["padding_check"] = {"batch": odd, "graph": padded_graph, **{m: {"tokens_equal": bool(torch.equal(o[0], e_t)),
                                                     "logits_rel_err": ((o[1] - e_l).abs().max() / e_l.abs().max()).item()}
                                                 for m, o in outs.items() if m != "eager"}}
        print("padding check", res["padding_check"], flush=True)

    for r in rows:
        if "step_ms" in r and roof[r["batch"]]["roofline_ms"]:
            # the h200-* lowerings store the experts in FP8 (the target's format), but h200-mxfp4
            key = ("roofline_mxfp4_experts_ms" if r["graph"] == "h200-mxfp4" else
                   "roofline_fp8_experts_ms" if r["graph"].startswith("h200-") else "roofline_ms")
            r["roofline_fraction"] = roof[r["batch"]][key] / r["step_ms"]
    print(table(res))
    if a.out:
        a.out.write_text(json.dumps(res, indent=1, default=str))
    return 0


def table(res: dict) -> str:
    lines = ["| graph | mode | batch | ms/step | vs eager same graph | roofline | tokens = eager | logits rel err |",
             "|---|---|---:|---:|---:|---:|---|---:|"]
    eager = {(r["graph"], r["batch"]): r["step_ms"] for r in res["rows"] if r.get("mode") == "eager" and "step_ms" in r}
    for r in res["rows"]:
        if "step_ms" not in r:
            continue
        rf = r.get("roofline_fraction")
        lines.append(f"| {r['graph']} | {r['mode']} | {r['batch']} | {r['step_ms']:.2f} ± {r['spread_ms']:.2f} | "
                     f"{eager[(r['graph'], r['batch'])] / r['step_ms']:.2f}x | {f'{rf:.1%}' if rf else '-'} | "
                     f"{r['tokens_equal_eager']} | {r['logits_rel_err_vs_eager']:.1e} |")
    lines += ["", "| graph | mode | buckets | capture s | graph MiB | reserved MiB |", "|---|---|---|---:|---:|---:|"]
    for r in res["rows"]:
        if "capture_s" in r:
            lines.append(f"| {r['graph']} | {r['mode']} | {r['buckets']} | {r['capture_s']:.2f} | "
                         f"{r['graph_bytes'] / 2**20:.0f} | {r['graph_reserved_bytes'] / 2**20:.0f} |")
    return "\n".join(lines)


def _commit() -> str:
    """HEAD's short hash, "+dirty" when tracked files differ from it (a device that runs a copied working tree
    under older git metadata reports its HEAD, not the tree it ran: the suffix says so)."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], capture_output=True, text=True, cwd=Path(__file__).parent).stdout.strip()

    try:
        dirty = git("status", "--porcelain", "--untracked-files=no")
        return (git("rev-parse", "--short", "HEAD") or "unknown") + ("+dirty" if dirty else "")
    except OSError:
        return "unknown"


if __name__ == "__main__":
    raise SystemExit(main())
