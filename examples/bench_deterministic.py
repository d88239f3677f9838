"""Deterministic mode on the v4-flash-slice: its cost per decode step, and that rows do not depend on the batch.

    python examples/bench_deterministic.py --out $OUT/det.json              # H200, ~2-3 min
    python examples/bench_deterministic.py --device cpu --quick             # CPU smoke run (tiny model)
    python examples/bench_deterministic.py --mtp 3 --layers 2 --prompt 256 --steps 16 --out $OUT/det_mtp.json
                                    # MTP: verify rows vs decode rows, speculative tokens (`verify_rows`)

For each lowering (h200 pipeline, decode graph, one full CUDA graph per bucket):
  default        the target's kernels, fp8_block experts (what `compile --target h200` ships)
  default-bf16   the target's kernels, bf16 experts (`moe_experts_gathered`): the same expert bytes as
                 the deterministic mode, so the difference is the kernels' alone
  deterministic  `PassContext(deterministic=True)`: passes/make_batch_invariant.py + v4_attention=fused_det
  default-mxfp4, deterministic-mxfp4
                 the same two with MXFP4 weight-only experts (`--expert-format mxfp4_w4a16`; deterministic:
                 `moe_experts_fp4_bi`, the FP4 GEMV at every token count): the experts' bytes as stored
  deterministic-mxfp4-fp8dense
                 deterministic-mxfp4 with the FP8-stored dense linears as stored (`--dense-format
                 fp8_block_w8a16`: `fp8_linear_bi`, the batch-invariant tiles on e4m3 bytes), the default
                 modes' dense format since the h100/h200 targets run FP8 dense
  deterministic-fp8
                 the deterministic mode with FP8 block experts (`--expert-format fp8_block`: `moe_experts_fp8_bi`,
                 the grouped tensor-core kernel with one tile: an expert read once per 16 of its assignments),
                 beside `default` (the same expert bytes)
it prefills max(batch) slots with a `--prompt`-token prompt (eager model), then from the same cache state
and the same first tokens runs `--steps` greedy decode steps at each batch size, and records
  * the median step time (CUDA events, after 3 warm-up steps) per batch: the mode's cost;
  * `rows_identical`: the first step's logits of rows 0..B-1 are bit-identical at every batch size;
  * `tokens_identical`: every greedy token of rows 0..B-1 is the same at every batch size.
Only the deterministic mode claims the two; the others are recorded for contrast.
`--layers N` cuts the slice to N layers (the gpu test uses 2: a random 2-layer Flash-dimension model).
"""
from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
from pathlib import Path

import torch

from dsv4c.export import GraphSpec, export_graph, flat_caches
from dsv4c.passes import PassContext, run_pipeline
from dsv4c.passes.split_at_routers import apply_plan, plan_segments
from dsv4c.runtime.segments import SegmentExecutor
from dsv4c.targets import DEFAULT_BUCKETS

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_segments as bs  # noqa: E402  (build: the slice, cut to --layers)

MODES = {  # name -> (kernel overrides, skip quantize_experts, deterministic, expert format)
    "default": ({}, False, False, None),
    "default-bf16": ({"moe_experts": "gathered"}, True, False, None),
    "deterministic": ({"v4_attention": "fused_det"}, True, True, None),
    "default-mxfp4": ({}, False, False, "mxfp4_w4a16"),
    "deterministic-mxfp4": ({"v4_attention": "fused_det"}, False, True, "mxfp4_w4a16"),
    "deterministic-mxfp4-fp8dense": ({"v4_attention": "fused_det"}, False, True, "mxfp4_w4a16"),
    "deterministic-fp8": ({"v4_attention": "fused_det"}, False, True, "fp8_block"),  # moe_experts_fp8_bi
}
DENSE = {"deterministic-mxfp4-fp8dense": "fp8_block_w8a16"}  # mode -> dense format (else the mode's default)
DEFAULT_MODES = ("default", "default-bf16", "deterministic")


def lower(model, n_slots: int, max_len: int, mode: str, k: int = 0, extra_ring_slots: int = 0):
    """The decode graph with 1 + k tokens per row (k > 0: the verify graph of `--mtp k`), lowered for
    the h200 target in `mode` -> (plan, split graph, blockers)."""
    kernels, no_quant, det, experts = MODES[mode]
    ctx = PassContext(model.config, "h200", "decode", tuple(sorted(kernels.items())), experts, deterministic=det,
                      dense_format=DENSE.get(mode))
    spec = GraphSpec("decode", k=k, n_slots=n_slots, max_len=max_len, extra_ring_slots=extra_ring_slots)
    gm = export_graph(model, spec).module()
    gm, records = run_pipeline(gm, ctx, skip=("quantize_experts",) if no_quant else ())
    blockers = [b for r in records if r.name == "make_batch_invariant" for b in r.stats.get("blockers", [])]
    plan = plan_segments(gm, ctx)
    return plan, apply_plan(gm, plan), blockers


@torch.no_grad()
def greedy(ex, flat, snap, pos0, ids0, B: int, steps: int):
    """`steps` greedy steps of rows 0..B-1 from the snapshot -> (first logits [B, V], tokens [steps, B], ms)."""
    for name, t in flat.items():
        t.copy_(snap[name])
    dev = ids0.device
    ids, slots, pos = ids0[:B].clone(), torch.arange(B, device=dev), pos0[:B].clone()
    one = torch.ones(B, dtype=torch.int64, device=dev)
    first, toks, ms = None, [], []
    for _ in range(steps):
        a = b = None
        if dev.type == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
        logits = ex.run(ids, slots, pos, one, flat)[0][:, -1]  # [B, V]
        if dev.type == "cuda":
            b.record()
            b.synchronize()
            ms.append(a.elapsed_time(b))
        first = logits.float().clone() if first is None else first
        ids = logits.argmax(-1, keepdim=True)
        toks.append(ids[:, 0].cpu())
        pos += 1
    return first, torch.stack(toks), ms


def _collect_previous() -> None:
    """Free an earlier call's model, graphs and caches before building the next: they hold each other in
    reference cycles, which only the cycle collector frees (two 2-layer Flash builds do not fit an H100)."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def run(layers: int | None = None, batches=(1, 8, 64), prompt: int = 1024, steps: int = 12,
        modes=DEFAULT_MODES, device: str = "cuda", preset: str = "v4-flash-slice") -> dict:
    dev = torch.device(device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    batches = sorted(batches)
    _collect_previous()
    model = bs.build(preset, dev, dtype, layers)
    cfg = model.config
    n_slots, max_len = batches[-1] + 1, prompt + steps + 8
    cache = model.new_cache(n_slots, max_len=max_len)
    g = torch.Generator().manual_seed(0)
    for s in range(0, n_slots - 1, 8):
        rows = torch.arange(s, min(s + 8, n_slots - 1), device=dev)
        model(torch.randint(0, cfg.vocab_size, (len(rows), prompt), generator=g).to(dev), cache, slots=rows)
    flat = flat_caches(cache.layers)
    snap = {k: t.clone() for k, t in flat.items()}
    pos0 = cache.pos.clone()
    ids0 = torch.randint(0, cfg.vocab_size, (batches[-1], 1), generator=g).to(dev)
    buckets = tuple(sorted({b for b in DEFAULT_BUCKETS if b < n_slots} | {n_slots - 1}))
    res: dict = {"preset": preset, "layers": cfg.num_hidden_layers, "prompt": prompt, "steps": steps,
                 "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu", "torch": torch.__version__}
    for mode in modes:
        plan, split, blockers = lower(model, n_slots, max_len, mode)
        ex = SegmentExecutor(split, plan, dev, buckets=buckets, mode="full" if dev.type == "cuda" else "eager",
                             pad_slot=n_slots - 1)
        out = {b: greedy(ex, flat, snap, pos0, ids0, b, steps) for b in batches}
        big_first, big_toks, _ = out[batches[-1]]
        r = {"step_ms": {b: statistics.median(o[2][3:]) if len(o[2]) > 3 else None for b, o in out.items()},
             "rows_identical": all(torch.equal(o[0], big_first[:b]) for b, o in out.items()),
             "tokens_identical": all(torch.equal(o[1], big_toks[:, :b]) for b, o in out.items()),
             "blockers": blockers,  # deterministic mode: ops make_batch_invariant could not vouch for
             "max_logit_diff_vs_largest_batch": {b: float((o[0] - big_first[:b]).abs().max()) for b, o in out.items()}}
        res[mode] = r
        print(f"{mode:14} " + "  ".join(f"B={b}: {ms:.3f} ms" for b, ms in r["step_ms"].items() if ms is not None)
              + f"  rows identical: {r['rows_identical']}  tokens identical: {r['tokens_identical']}", flush=True)
        del ex, split
    for det, base, key in (("deterministic", "default", "cost_vs_default"),
                           ("deterministic-mxfp4", "default-mxfp4", "cost_vs_default_mxfp4"),
                           ("deterministic-fp8", "default", "cost_fp8_vs_default"),
                           ("deterministic-mxfp4", "default", "cost_mxfp4_vs_default"),
                           ("deterministic-mxfp4-fp8dense", "default-mxfp4", "cost_fp8dense_vs_default_mxfp4")):
        if det in res and base in res:
            res[key] = {b: res[det]["step_ms"][b] / res[base]["step_ms"][b] for b in batches if res[base]["step_ms"][b]}
    return res


@torch.no_grad()
def verify_rows(k_max: int = 3, layers: int | None = None, batches=(1, 8, 64), prompt: int = 1024,
                device: str = "cuda", preset: str = "v4-flash-slice", dtype: torch.dtype | None = None,
                steps: int = 16, corrupt: float = 0.3, mode: str = "deterministic") -> dict:
    """Deterministic mode, MTP, from one cache state (h200 lowering, deterministic decode and verify graphs),
    at each batch size B (rows 0..B-1):
      * `batch_rows_identical[B]`: the decode steps' logits of rows 0..B-1 are the same bits as at the
        largest batch;
      * `verify_rows_identical[B][k]`: a verify step with 1 + k real tokens per row (k = 1..k_max; the
        graph of T = 1 + k_max tokens, the rest padding, as the runtime runs `--mtp k` on a `--mtp K`
        artifact) gives every real row and token the same logits bits as 1 + k decode steps fed the
        same tokens;
      * `tokens_identical[B][k]`: `steps` greedy tokens by speculative rounds of the verify graph (drafts:
        the k = 0 continuation, each corrupted with probability `corrupt`, so rounds reject and roll
        back) equal plain greedy decode's at the largest batch (k = 0: plain decode at B itself).
    `mode`: "deterministic" (bf16 experts), "deterministic-mxfp4" (MXFP4 weight-only experts) or
    "deterministic-fp8" (FP8 block experts, `moe_experts_fp8_bi`)."""
    if not MODES[mode][2]:
        raise ValueError(f"verify_rows: mode must be a deterministic one, got {mode!r}")
    dev = torch.device(device)
    dtype = dtype or (torch.bfloat16 if dev.type == "cuda" else torch.float32)
    batches = sorted(batches)
    _collect_previous()
    model = bs.build(preset, dev, dtype, layers)
    cfg = model.config
    n_slots, max_len = batches[-1] + 1, prompt + steps + 2 * k_max + 8
    cache = model.new_cache(n_slots, max_len=max_len, extra_ring_slots=k_max)
    g = torch.Generator().manual_seed(0)
    for s in range(0, n_slots - 1, 8):
        rows = torch.arange(s, min(s + 8, n_slots - 1), device=dev)
        model(torch.randint(0, cfg.vocab_size, (len(rows), prompt), generator=g).to(dev), cache, slots=rows)
    flat = flat_caches(cache.layers)
    snap = {n: t.clone() for n, t in flat.items()}
    ids = torch.randint(0, cfg.vocab_size, (n_slots - 1, 1 + k_max), generator=g).to(dev)  # a token, k_max drafts
    pos0 = cache.pos[:n_slots - 1].clone()
    ex_mode = "full" if dev.type == "cuda" else "eager"

    def executor(k: int) -> SegmentExecutor:
        plan, split, blockers = lower(model, n_slots, max_len, mode, k, k_max)
        if blockers:
            raise RuntimeError(f"deterministic graph (k={k}) keeps blockers: {blockers[:4]}")
        return SegmentExecutor(split, plan, dev, buckets=tuple(batches), mode=ex_mode, pad_slot=n_slots - 1)

    def restore():
        for name, t in flat.items():
            t.copy_(snap[name])

    exs = {k: executor(k) for k in (0, k_max)}  # what the runtime runs: decode, and verify at T = 1 + K
    res: dict = {"preset": preset, "layers": cfg.num_hidden_layers, "prompt": prompt, "steps": steps, "mode": mode,
                 "dtype": str(dtype), "batch_rows_identical": {}, "verify_rows_identical": {}, "max_abs_diff": {},
                 "tokens_identical": {}, "accepted_per_round": {}}
    top = top_rows = None
    for B in reversed(batches):
        slots, one = torch.arange(B, device=dev), torch.ones(B, dtype=torch.int64, device=dev)
        restore()
        decoded = [exs[0].run(ids[:B, t:t + 1], slots, pos0[:B] + t, one, flat)[0][:, -1].clone()
                   for t in range(1 + k_max)]  # [B, V] per position, the tokens of `ids`
        restore()
        ref, x = [], ids[:B, :1]
        for s in range(steps):  # plain greedy decode: the reference continuation
            x = exs[0].run(x, slots, pos0[:B] + s, one, flat)[0][:, -1].argmax(-1, keepdim=True)
            ref.append(x)
        ref = torch.cat(ref, 1)                                                  # [B, steps]
        if top is None:
            top, top_rows = ref, decoded
        res["batch_rows_identical"][B] = all(torch.equal(d, e[:B]) for d, e in zip(decoded, top_rows))
        vr, diff, same, acc = {}, {}, {0: torch.equal(ref, top[:B])}, {}
        for k in range(1, k_max + 1):  # k < K: the T = 1 + K graph with 1 + k real tokens a row, as Session runs it
            restore()
            fed = torch.cat([ids[:B, :1 + k], torch.zeros_like(ids[:B, 1 + k:])], 1)          # [B, 1+K], padded
            out = exs[k_max].run(fed, slots, pos0[:B], torch.full_like(one, 1 + k), flat)[0]   # [B, 1+K, V]
            vr[k] = all(torch.equal(out[:, t], decoded[t]) for t in range(1 + k))
            diff[k] = max(float((out[:, t].float() - decoded[t].float()).abs().max()) for t in range(1 + k))
            toks, acc[k] = _speculate(exs[k_max], flat, restore, ids[:B, :1], ref, slots, pos0[:B], k, k_max,
                                      cfg.vocab_size, corrupt)
            same[k] = torch.equal(toks, top[:B])
        res["verify_rows_identical"][B], res["max_abs_diff"][B] = vr, diff
        res["tokens_identical"][B], res["accepted_per_round"][B] = same, acc
        print(f"B={B}: decode rows as at B={batches[-1]}: {res['batch_rows_identical'][B]}, verify rows identical {vr}, tokens identical {same}, drafts accepted per round {acc}",
              flush=True)
    return res


def _speculate(ex, flat, restore, x, ref, slots, pos0, k: int, K: int, vocab: int, corrupt: float):
    """Greedy speculative decoding with the verify graph of 1 + K tokens, 1 + k of them real (n_real):
    the drafts are the reference continuation with each token replaced by a wrong one with probability
    `corrupt` (seeded), so rounds accept 0..k drafts and rows advance by different counts (the rollback
    path); a row that has its `steps` tokens stops (n_real 0). -> (tokens [B, steps], mean drafts
    accepted per round)."""
    restore()
    B, steps = ref.shape
    dev = ref.device
    g = torch.Generator().manual_seed(k)
    n = torch.zeros(B, dtype=torch.int64, device=dev)  # tokens produced per row
    out = torch.zeros(B, steps + k + 1, dtype=torch.int64, device=dev)
    padded = torch.cat([ref, torch.zeros(B, k + 1, dtype=ref.dtype, device=dev)], 1)
    pos, accepted, rounds = pos0.clone(), 0, 0
    while int(n.min()) < steps:
        live = n < steps                                                        # [B]
        at = (n[:, None] + torch.arange(k, device=dev)).clamp_max(padded.shape[1] - 1)  # [B, k]
        drafts = padded.gather(1, at)
        wrong = (torch.rand(B, k, generator=g) < corrupt).to(dev)
        drafts = torch.where(wrong, (drafts + 1) % vocab, drafts)
        pad = torch.zeros(B, K - k, dtype=drafts.dtype, device=dev)
        nreal = torch.where(live, 1 + k, 0)
        top = ex.run(torch.cat([x, drafts, pad], 1), slots, pos, nreal, flat)[0][:, :1 + k].argmax(-1)  # [B, 1+k]
        ok = (drafts == top[:, :k]).long().cumprod(1).sum(1)                    # [B] drafts accepted
        for b in live.nonzero()[:, 0].tolist():
            a, nb = int(ok[b]), int(n[b])
            out[b, nb:nb + a + 1] = top[b, :a + 1]
        step = torch.where(live, ok + 1, 0)
        n, pos = n + step, pos + step
        x = torch.where(live[:, None], top.gather(1, ok[:, None]), x)
        accepted, rounds = accepted + int(ok[live].sum()), rounds + int(live.sum())
    return out[:, :steps], accepted / rounds


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--prompt", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--layers", type=int, default=None, help="cut the slice to this many layers")
    ap.add_argument("--modes", nargs="+", default=list(DEFAULT_MODES), choices=list(MODES))
    ap.add_argument("--mtp", type=int, default=0, metavar="K",
                    help="instead: the deterministic mode's MTP check (`verify_rows`, k = 1..K) at --batches")
    ap.add_argument("--quick", action="store_true", help="tiny model, short prompt (a smoke run)")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args(argv)
    preset = "v4-flash-slice"
    if a.quick:
        preset, a.batches, a.prompt, a.steps = "v4-tiny-a", [1, 3], 12, 3
    if a.mtp:
        det = [m for m in a.modes if MODES[m][2]]
        res = verify_rows(a.mtp, a.layers, a.batches, a.prompt, a.device, preset, steps=max(a.steps, 8),
                          mode=det[0] if det else "deterministic")
        if a.out:
            a.out.write_text(json.dumps(res, indent=1, default=str))
        return 0
    res = run(a.layers, a.batches, a.prompt, a.steps, tuple(a.modes), a.device, preset)
    for key in ("cost_vs_default", "cost_vs_default_mxfp4", "cost_mxfp4_vs_default"):
        if key in res:
            print(f"{key}: " + ", ".join(f"B={b}: {x:.2f}x" for b, x in res[key].items()))
    if a.out:
        a.out.write_text(json.dumps(res, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
