"""Issue 22's accuracy table: is the compiled v4-flash-slice faithful to the eager model? (H200, bf16)

    python examples/accuracy_slice.py --out-dir $OUT/acc                    # H200, <= 6 minutes
    python examples/accuracy_slice.py --quick --device cpu --out-dir /tmp/acc   # v4-tiny-a smoke run
    python examples/accuracy_slice.py --out-dir $OUT/acc --parts passes,formats,floor,fp8 --graphs prefill \
        --formats fp8_block --budget-s 280                                     # issue 22's causes only

The slice is built on the GPU with seeded random weights rounded to the release formats (as
examples/bench_artifact.py does: MXFP4 routed experts, so the mxfp4 container holds them exactly).
Every figure is the logits of random prompts (2 rows x --prompt tokens for the prefill graph) against
the bf16 eager model on the same tokens, with routing free and with routing pinned to eager's
decisions (dsv4c/routing.py, passes/pin_routing.py), so the pinned figures hold only the kernels' and
formats' error. Parts, in order, each skipped with the reason when --budget-s would be exceeded (time
for the artifact part is kept back until it runs; decode and MTP per-pass rows come after the formats):
  1. per pass (`compare_passes`, target h200, its fp8_block experts): prefill, decode and MTP graphs;
  2. per expert format on the prefill graph: fp8_block, mxfp4_w4a16, nvfp4_w4a16 (the fused pipeline
     run once, then quantize_experts_as(format) on copies of the graph that share its weights);
  3. the whole h200 artifact: release checkpoint -> compile_checkpoint -> Session.logits of one prompt,
     pinned and free (`dsv4c.compare.artifact_logits`);
  4. top-k margins per layer (eager, unpinned): the slice's, and the bundled trained model's
     (examples/models/v4-tiny-pystdlib, on text) for contrast.
  5. `floor`: two valid bf16 evaluations of the eager model (one prompt in one forward vs in chunks,
     routing pinned): the spread a fusion pass that only moves bf16 roundings cannot beat;
  6. `fp8`: per MoE layer, the Triton fp8_block kernels vs their reference on identical quantised
     inputs, the format's own error (ue8m0 and fp32 activation scales) vs fp32 math, and how it
     compounds to the logits (eager with fp8 experts emulated, every layer / one layer, pinned).
  Parts 5 and 6 end in a "cause" paragraph generated from their numbers. `--parts` picks parts
  (passes, formats, floor, fp8, margins, artifact).
Per MoE layer, the share of tokens whose top-k expert set differs from eager's: free (cascading) and
pinned (the graph's own router on eager-routed inputs). Targets (issue 22): fusion passes >= 38 dB or
bit-exact, mxfp4/nvfp4 >= 35 dB, fp8_block >= 25 dB, the artifact as its format; pinned.

Output: OUT/accuracy.json and OUT/accuracy.md (rewritten after every part). Plot:
`python examples/plot_routing.py OUT/accuracy.json --out OUT/routing.png`.
Legend: P prompt tokens, B rows.
"""
from __future__ import annotations

import argparse
import copy
import gc
import json
import math
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
from bench_segments import _commit  # noqa: E402  (HEAD's hash, "+dirty" when the tracked files differ)

FORMATS = ("fp8_block", "mxfp4_w4a16", "nvfp4_w4a16")
PARTS = ("passes", "formats", "floor", "fp8", "margins", "artifact")
TARGET_DB = {"fusion": 38.0, "fp8_block": 25.0, "mxfp4_w4a16": 35.0, "nvfp4_w4a16": 35.0}
BUNDLE = ROOT / "examples" / "models" / "v4-tiny-pystdlib"
# rows after the lossy passes carry their error
LOSSY = ("quantize_experts", "quantize_dense", "make_batch_invariant", "select_kernels")
ARTIFACT_S = 140.0  # the artifact part on the H200: checkpoint ~20 s, compile ~65 s, load + two prefills
KIND_S = 40.0  # one more graph kind's per-pass rows (export, passes, two runs per row)
FLOOR_S, FP8_S = 15.0, 90.0  # the bf16-floor and fp8 parts on the H200 (estimates, for the budget)


class Budget:
    def __init__(self, total: float):
        self.total, self.t0 = total, time.perf_counter()

    def left(self) -> float:
        return self.total - (time.perf_counter() - self.t0)


def _free(dev) -> None:
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()


def build(preset: str, dev, dtype):
    from bench_artifact import round_to_release_

    from dsv4c import ModelConfig
    from dsv4c.model import build_model

    model = build_model(ModelConfig.preset(preset), dev, dtype, on_device=dev.type == "cuda").eval()
    round_to_release_(model)
    return model


# ---- parts ------------------------------------------------------------------------------------------
def per_pass(model, target: str, kind: str, prompt: int) -> list[dict]:
    from dsv4c.compare import compare_passes

    return compare_passes(model, target=target, kinds=(kind,), k=1 if kind == "mtp" else 0, pin_routing=True,
                          prompt_len=prompt)


def per_format(model, target: str, prompt: int, formats, budget: Budget, min_s: float) -> list[dict]:
    """The prefill graph lowered once without quantize_experts, then each format on a copy (shared weights)."""
    from torch.fx import GraphModule

    from dsv4c.compare import _cases, case_metrics
    from dsv4c.export import export_graph
    from dsv4c.passes import PassContext, default_pipeline, run_pipeline
    from dsv4c.passes.quantize_experts import quantize_experts_as

    (case,) = _cases(model, ["prefill"], 0, seed=0, prompt_len=prompt)
    ctx = PassContext(model.config, target, "prefill")
    before = [(n, p) for n, p in default_pipeline() if n not in LOSSY]
    base, _ = run_pipeline(export_graph(model, case.spec).module(), ctx, passes=before)
    out = []
    for fmt in formats:
        if budget.left() < min_s:
            out.append({"format": fmt, "skipped": f"time budget: {budget.left():.0f} s left"})
            continue
        t0 = time.perf_counter()
        g = GraphModule(base, copy.deepcopy(base.graph))
        g = quantize_experts_as(fmt)(g, ctx).graph
        m = case_metrics(g, case, pin_routing=True)
        m.pop("_out")
        out.append({"format": fmt, **m, "seconds": time.perf_counter() - t0})
        del g
        _free(case.ref.device)
    return out


def artifact(model, work: Path, target: str, prompt: int, dev) -> dict:
    """Release checkpoint -> compile for `target` -> Session.logits of one prompt, pinned and free."""
    from dsv4c.checkpoint import save_checkpoint
    from dsv4c.compare import artifact_logits, eager_routing, error_metrics
    from dsv4c.compile import compile_checkpoint
    from dsv4c.routing import index_flips, routing_flips
    from dsv4c.runtime import Session

    ids = torch.randint(0, model.config.vocab_size, (prompt,), generator=torch.Generator().manual_seed(5)).tolist()
    ref, table = eager_routing(model, ids)
    ref = ref.cpu()
    t0 = time.perf_counter()
    ckpt, art = work / "ckpt", work / "art"
    save_checkpoint(model, ckpt, quant="release", overwrite=True, progress=False)
    t_ckpt = time.perf_counter() - t0
    t0 = time.perf_counter()
    man = compile_checkpoint(ckpt, art, target=target, max_tokens=prompt + 16, max_batch=2, buckets=(1, 2),
                             force=True, convert_device=str(dev))
    t_compile = time.perf_counter() - t0
    return {"ids": ids, "ref": ref, "table": table, "art": art, "expert_format": man["target"]["expert_format"],
            "checkpoint_s": t_ckpt, "compile_s": t_compile,
            "measure": lambda sess: _measure_artifact(sess, ids, ref, table, artifact_logits, error_metrics,
                                                      routing_flips, index_flips)}


def _measure_artifact(sess, ids, ref, table, artifact_logits, error_metrics, routing_flips, index_flips) -> dict:
    free, ftap = artifact_logits(sess, ids)
    pinned, ptap = artifact_logits(sess, ids, table)
    return {"prompt": len(ids), "free": error_metrics(free, ref), "pinned": error_metrics(pinned, ref),
            "argmax_agree_free": float((free.argmax(-1) == ref.argmax(-1)).float().mean()),
            "argmax_agree_pinned": float((pinned.argmax(-1) == ref.argmax(-1)).float().mean()),
            "flips": routing_flips(table, ftap.seen), "pinned_flips": routing_flips(table, ptap.seen),
            "index_flips": index_flips(table, ftap.seen), "pinned_index_flips": index_flips(table, ptap.seen)}


def trained_margins(dev) -> dict:
    """The bundled trained model's routing margins on text (a source file of this repo)."""
    from tokenizers import Tokenizer

    from dsv4c.checkpoint import load_model
    from dsv4c.compare import eager_routing
    from dsv4c.routing import margin_summary

    model = load_model(BUNDLE, device=str(dev), dtype=torch.float32).eval()
    tok = Tokenizer.from_file(str(BUNDLE / "tokenizer.json"))
    ids = tok.encode((ROOT / "dsv4c" / "compare.py").read_text()).ids[:512]
    _, table = eager_routing(model, ids)
    return {"model": BUNDLE.name, "tokens": len(ids), "margins": margin_summary(table)}


# ---- part: the bf16 evaluation floor (issue 22 (a)) -------------------------------------------------
def _sub_table(table, lo: int, hi: int):
    """Rows lo..hi of a one-row recording (routers' and indexers' decisions for tokens lo..hi)."""
    from dsv4c.routing import IndexEntry, RoutingEntry, RoutingTable

    return RoutingTable([RoutingEntry(e.name, e.idx[lo:hi], e.weight[lo:hi], e.hashed) for e in table.entries],
                        [IndexEntry(e.name, e.idx[lo:hi]) for e in table.index])


def bf16_floor(model, prompt: int, chunks: int = 2) -> dict:
    """Two equally valid bf16 evaluations of the eager model: one prompt (1 row) in one forward, and in
    `chunks` forwards through the cache (other GEMM shapes, so other roundings of the same math), routing
    pinned to the one-forward run's. Their SNR is the model's own bf16 spread: a fusion pass that only
    changes where bf16 rounds cannot be held to more than that. Also: row 0 alone vs in a batch of 2."""
    from dsv4c.compare import _cases, error_metrics
    from dsv4c.routing import record_routing

    (case,) = _cases(model, ["prefill"], 0, seed=0, prompt_len=prompt)
    ids = case.args[0][:1]
    with record_routing(model) as rec:
        one = model(ids, model.new_cache(1, max_len=case.spec.max_len))
    cache = model.new_cache(1, max_len=case.spec.max_len)
    cuts = [round(prompt * j / chunks) for j in range(chunks + 1)]
    outs = []
    for lo, hi in zip(cuts, cuts[1:]):
        with record_routing(model, pin=_sub_table(rec.table, lo, hi)):
            outs.append(model(ids[:, lo:hi], cache))
    chunked = torch.cat(outs, 1)
    return {"prompt": prompt, "chunks": chunks, "chunked_vs_one": error_metrics(chunked, one),
            "batch1_vs_batch2_row0": error_metrics(one[0], case.ref[0])}


# ---- part: fp8_block W8A8 experts, kernel vs format (issue 22 (b)) ------------------------------------
def _act_fp8(v: torch.Tensor, ue8m0: bool) -> torch.Tensor:
    """v's fp8_block activation quantisation (e4m3 per 1x128; ue8m0 power-of-two or fp32 scales), dequantised."""
    from dsv4c import quant as Q

    return Q.dequant_act(*Q.quant_act_fp8(v, ue8m0=ue8m0))


def fp8_moe_emulated(u: torch.Tensor, idx: torch.Tensor, weight: torch.Tensor, w1, w3, w2, limit: float,
                     ue8m0: bool = True, lossless: dict | None = None) -> torch.Tensor:
    """The routed experts in fp8_block W8A8, emulated in fp32 one expert at a time (no fp32 copy of the
    stack): weights as quantize_experts converts them (dsv4c.convert.quantize_stack), x and h quantised
    per 1x128 with `ue8m0` (spec) or fp32 scales, routing weight before w2. u [T, D]; idx, weight [T, K];
    w1, w3 [E, I, D], w2 [E, D, I] -> [T, D] in u's dtype. With ue8m0 it is moe_grouped_ref's function.
    `lossless` (a dict kept across calls): experts whose conversion was found exact, used as they are
    (the slice's MXFP4 values convert exactly; this skips re-converting them on every forward)."""
    from dsv4c.convert import ALIGN, padded, quantize_stack
    from dsv4c.kernels.moe_grouped import experts_from_tensors

    t, d = u.shape
    i = w1.shape[1]
    ip, dp = padded(i, ALIGN["fp8_block"]), padded(d, ALIGN["fp8_block"])
    xb = u.to(torch.bfloat16).float()                                                  # the op's input is bf16
    xa = _act_fp8(torch.nn.functional.pad(xb, (0, dp - d)), ue8m0)                     # [T, Dp]
    flat, wf = idx.reshape(-1), weight.reshape(-1).float()
    tok = torch.arange(t, device=u.device).repeat_interleave(idx.shape[1])           # [T·K]
    out = torch.zeros(t, dp, dtype=torch.float32, device=u.device)
    for e in flat.unique().tolist():
        sel = (flat == e).nonzero()[:, 0]
        key = (w1.data_ptr(), e)
        if lossless is not None and lossless.get(key):
            q1, q3, q2 = (torch.nn.functional.pad(w[e].float(), (0, c - w.shape[2], 0, r - w.shape[1]))
                          for w, r, c in ((w1, ip, dp), (w3, ip, dp), (w2, dp, ip)))
        else:
            f = quantize_stack("fp8_block", w1[e:e + 1], w3[e:e + 1], w2[e:e + 1], ip, dp)
            q1, q3, q2 = (w[0] for w in experts_from_tensors("fp8_block", **f).dequantize())
            if lossless is not None:
                lossless[key] = all(torch.equal(q[:w.shape[1], :w.shape[2]], w[e].float())
                                    for q, w in ((q1, w1), (q3, w3), (q2, w2)))
        xs = xa[tok[sel]]
        g, up = xs @ q1.t(), xs @ q3.t()
        if limit > 0:
            g, up = g.clamp(max=limit), up.clamp(-limit, limit)
        h = _act_fp8(torch.nn.functional.silu(g) * up * wf[sel, None], ue8m0)
        out.index_add_(0, tok[sel], h @ q2.t())
    return out[:, :d].to(u.dtype)


def _moe_layers(model) -> list[tuple[str, torch.nn.Module]]:
    return [(f"layers.{j}", b.ffn) for j, b in enumerate(model.layers)]


def _layer_inputs(model, ids) -> tuple[dict, object, torch.Tensor]:
    """One eager forward of ids [1, P]: each MoE layer's input u [P, D], the routing table, the logits."""
    from dsv4c.routing import record_routing

    caps = {}
    hooks = [ffn.register_forward_pre_hook(lambda m, a, n=name: caps.__setitem__(n, a[0].reshape(-1, a[0].shape[-1])))
             for name, ffn in _moe_layers(model)]
    try:
        with record_routing(model) as rec:
            logits = model(ids)
    finally:
        for h in hooks:
            h.remove()
    return caps, rec.table, logits


def fp8_kernel_check(model, prompt: int, dev, tokens: int = 8) -> list[dict]:
    """Per MoE layer, on `tokens` of the slice's own MoE inputs and eager routing, the layer's used
    experts only: (1) the Triton fp8_block kernels (moe_grouped, moe_fp8_prefill) vs moe_grouped_ref on
    identical quantised inputs (CUDA only); (2) the format's own error: that reference vs the same
    experts in fp32 math on unquantised activations, with ue8m0 scales (spec) and with fp32 scales, and
    with the weight conversion alone (activations unquantised)."""
    from dsv4c.compare import error_metrics
    from dsv4c.convert import ALIGN, padded, quantize_stack
    from dsv4c.kernels.moe_grouped import Bf16Experts, experts_from_tensors, moe_grouped_ref

    ids = torch.randint(0, model.config.vocab_size, (1, prompt), generator=torch.Generator().manual_seed(7)).to(dev)
    caps, table, _ = _layer_inputs(model, ids)
    entries = {e.name: e for e in table.entries}
    out = []
    for name, ffn in _moe_layers(model):
        e = entries[name]
        u = caps[name][:tokens]
        used, local = e.idx[:tokens].unique(return_inverse=True)
        local, w = local.to(dev), e.weight[:tokens].to(dev)
        ex, used = ffn.experts, used.to(dev)
        w1, w3, w2 = ex.w1[used], ex.w3[used], ex.w2[used]
        d, i, limit = u.shape[1], w1.shape[1], ffn.limit
        ip, dp = padded(i, ALIGN["fp8_block"]), padded(d, ALIGN["fp8_block"])
        fp8 = experts_from_tensors("fp8_block", **quantize_stack("fp8_block", w1, w3, w2, ip, dp))
        xp = torch.nn.functional.pad(u.to(torch.bfloat16), (0, dp - d))
        ref = moe_grouped_ref(xp, local, w, fp8, limit)[:, :d]                          # fp32
        exact = moe_grouped_ref(u.to(torch.bfloat16), local, w, Bf16Experts.from_float(w1, w3, w2), limit)
        q1, q3, q2 = fp8.dequantize()
        wonly = moe_grouped_ref(xp, local, w, Bf16Experts.from_float(q1, q3, q2), limit)[:, :d]
        del q1, q3, q2
        row = {"layer": name, "tokens": int(u.shape[0]), "experts": int(used.numel()),
               "emulated_vs_ref": error_metrics(fp8_moe_emulated(u.to(torch.bfloat16), local, w, w1, w3, w2, limit).float(), ref),
               "fp8_ue8m0_vs_exact": error_metrics(ref, exact),
               "fp8_fp32_scales_vs_exact": error_metrics(
                   fp8_moe_emulated(u.float(), local, w, w1, w3, w2, limit, ue8m0=False), exact),
               "weights_only_vs_exact": error_metrics(wonly, exact),
               "eager_bf16_vs_exact": error_metrics(
                   torch.ops.dsv4c.moe_experts(u, local, w, w1, w3, w2, limit).float(), exact)}
        if dev.type == "cuda":
            from dsv4c.kernels.moe_fp8_prefill import moe_fp8_prefill
            from dsv4c.kernels.moe_grouped import moe_grouped

            row["kernel_vs_ref"] = error_metrics(moe_grouped(xp, local, w, fp8, limit)[:, :d].float(), ref)
            row["prefill_kernel_vs_ref"] = error_metrics(moe_fp8_prefill(xp, local, w, fp8, limit)[:, :d].float(), ref)
        out.append(row)
        del fp8, w1, w3, w2
        _free(dev)
    return out


def _fp8_forward(ue8m0: bool, lossless: dict):
    """A MoE.forward (dsv4c/model/v4.py) whose routed experts are `fp8_moe_emulated`."""
    from dsv4c.model.common import swiglu

    def forward(self, u, ids):
        shape = u.shape
        u = u.reshape(-1, shape[-1])
        idx, w = self.gate(u, ids.reshape(-1))
        ex, se = self.experts, self.shared_experts
        y = fp8_moe_emulated(u, idx, w, ex.w1, ex.w3, ex.w2, self.limit, ue8m0, lossless)
        y = y + swiglu(u, se.w1.weight, se.w3.weight, se.w2.weight, self.limit)
        return y.reshape(shape)
    return forward


def fp8_compounding(model, prompt: int, dev) -> dict:
    """Eager, on the per-pass/per-format part's prompts (2 rows), routing pinned to the unquantised run's:
    the logits (and each MoE layer's output) with fp8_block experts (emulated, ue8m0) in every layer, in
    one layer at a time, and with fp32 scales. `predicted_all_db` adds the single-layer noise powers
    (independent errors). The all-layer figure is the one the graph's pinned fp8_block row should match."""
    import types

    from dsv4c.compare import _cases, error_metrics
    from dsv4c.routing import record_routing

    (case,) = _cases(model, ["prefill"], 0, seed=0, prompt_len=prompt)
    ids = case.args[0]
    layers = _moe_layers(model)
    lossless: dict = {}

    def run(fp8_layers, ue8m0=True, table=None):
        outs = {}
        hooks = [ffn.register_forward_hook(lambda m, a, o, n=name: outs.__setitem__(n, o.float()))
                 for name, ffn in layers]
        for name, ffn in layers:
            if name in fp8_layers:
                ffn.forward = types.MethodType(_fp8_forward(ue8m0, lossless), ffn)
        try:
            with record_routing(model, pin=table) as rec:
                logits = model(ids)
        finally:
            for h in hooks:
                h.remove()
            for _, ffn in layers:
                ffn.__dict__.pop("forward", None)
        return logits.float(), outs, rec.table

    ref, ref_outs, table = run(())
    names = [n for n, _ in layers]

    def measured(fp8_layers, ue8m0=True):
        logits, outs, _ = run(fp8_layers, ue8m0, table)
        return {"logits": error_metrics(logits, ref),
                "moe_out_db": {n: error_metrics(outs[n], ref_outs[n])["snr_db"] for n in names}}

    res = {"prompt": prompt, "all_ue8m0": measured(names), "all_fp32_scales": measured(names, ue8m0=False),
           "single": {n: measured((n,))["logits"]["snr_db"] for n in names}}
    noise = sum(10 ** (-s / 10) for s in res["single"].values() if not math.isinf(s))
    res["predicted_all_db"] = math.inf if noise == 0 else -10 * math.log10(noise)
    res["experts_converted_exactly"] = f"{sum(lossless.values())}/{len(lossless)}"
    return res


# ---- report -----------------------------------------------------------------------------------------
def _db(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, str) or math.isinf(v):
        return "inf"
    return f"{v:.1f}"


def _met(snr, bar) -> str:
    if snr is None:
        return "-"
    return "yes" if (snr == "inf" or snr == math.inf or snr >= bar) else "**no**"


def _flipmax(fl) -> str:
    return "-" if not fl else f"{max(f['share'] for f in fl):.1%}"


def _snr(m) -> float | None:
    """An SNR in dB from a metrics dict (JSON keeps "inf" as a string)."""
    if not isinstance(m, dict) or "snr_db" not in m:
        return None
    v = m["snr_db"]
    return math.inf if v == "inf" else float(v)


def fusion_cause(res: dict) -> list[str]:
    """The bf16 floor and what it says about the fusion passes' pinned prefill figures (from the numbers)."""
    fl = res.get("floor") or {}
    if "chunked_vs_one" not in fl:
        return [f"bf16 floor: {fl['skipped']}", ""] if "skipped" in fl else []
    floor, batch = _snr(fl["chunked_vs_one"]), _snr(fl["batch1_vs_batch2_row0"])
    L = ["### bf16 floor: two valid bf16 evaluations of the eager model", "",
         f"One prompt of {fl['prompt']} tokens in one forward vs in {fl['chunks']} chunks through the cache, routing "
         f"pinned: SNR **{_db(floor)} dB** (max abs {fl['chunked_vs_one']['max_abs_err']:.3g}); row 0 alone vs in a "
         f"batch of 2, routing free (so near-tie flips count): {_db(batch)} dB.", ""]
    rows = res.get("passes", {}).get("prefill")
    if isinstance(rows, list):
        fused = [(r["name"], _snr(r.get("pinned"))) for r in rows if r["name"] not in LOSSY and r["name"] != "export"
                 and _snr(r.get("pinned")) is not None]
        if fused:
            name, worst = min(fused, key=lambda x: x[1])
            spread = floor  # the pinned spread: the batch figure's routing is free
            verdict = ("within the spread of two valid bf16 evaluations of the eager model itself: the passes "
                       "change where bf16 rounds, not what is computed" if worst >= spread - 1.0 else
                       "below the spread of two valid bf16 evaluations of the eager model: more than rounding")
            L += [f"Cause (fusion passes, prefill): the lowest pinned figure is {_db(worst)} dB ({name}), "
                  f"{verdict} (floor {_db(spread)} dB, the chunked evaluation, pinned). On the CPU the fused ops run "
                  "the model's own functions and these passes are bit-exact in bf16 (tests/test_fuse_hc.py, "
                  "tests/test_fuse_rmsnorm.py); on the GPU their Triton kernels follow PyTorch's CUDA summation orders "
                  "in launches of at least 128 rows (prefill chunks: rms_norm, Sinkhorn, hc_post, hc_pre's dot products "
                  "from eager's GEMM; decode batches keep the faster kernels); an order that still differs moves single "
                  "bf16 roundings, and the random slice amplifies any "
                  "such change (the prefill graph's later tokens attend to keys it computed itself; the decode "
                  "graph starts from eager's cache).", ""]
    return L


def _rng(vals) -> str:
    vals = [v for v in vals if v is not None]
    if not vals:
        return "-"
    lo, hi = min(vals), max(vals)
    return _db(lo) if _db(lo) == _db(hi) else f"{_db(lo)}–{_db(hi)}"


def fp8_cause(res: dict) -> list[str]:
    """The fp8_block kernel-vs-format table and the cause paragraph (from the numbers)."""
    f = res.get("fp8") or {}
    if not f:
        return []
    if "skipped" in f:
        return [f"fp8_block check: {f['skipped']}", ""]
    rows = f["kernel"]
    L = ["### fp8_block W8A8 experts: kernel vs format, per MoE layer", "",
         "SNR dB on the slice's own MoE inputs (a few tokens, eager routing, the layer's used experts). exact: the "
         "same experts in fp32 math on unquantised activations.", "",
         "| layer | tokens | experts | kernel vs ref | prefill kernel vs ref | fp8 ue8m0 vs exact | fp8 fp32 scales vs "
         "exact | weights only vs exact | eager bf16 vs exact |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        L.append(f"| {r['layer']} | {r['tokens']} | {r['experts']} | {_db(_snr(r.get('kernel_vs_ref')))} | "
                 f"{_db(_snr(r.get('prefill_kernel_vs_ref')))} | {_db(_snr(r['fp8_ue8m0_vs_exact']))} | "
                 f"{_db(_snr(r['fp8_fp32_scales_vs_exact']))} | {_db(_snr(r['weights_only_vs_exact']))} | "
                 f"{_db(_snr(r['eager_bf16_vs_exact']))} |")
    L.append("")
    c = f.get("compounding") or {}
    if c:
        names = list(c["single"])
        L += ["Compounding (eager, routing pinned, fp8_block experts emulated; SNR dB):", "",
              "| | " + " | ".join(names) + " | logits |", "|---|" + "---:|" * (len(names) + 1)]
        for key, label in (("all_ue8m0", "MoE output, every layer fp8 (ue8m0)"),
                           ("all_fp32_scales", "MoE output, every layer fp8 (fp32 scales)")):
            L.append(f"| {label} | " + " | ".join(_db(c[key]["moe_out_db"][n]) for n in names) +
                     f" | {_db(_snr(c[key]['logits']))} |")
        L.append("| logits, this layer alone fp8 | " + " | ".join(_db(c["single"][n]) for n in names) +
                 f" | predicted {_db(c['predicted_all_db'])} |")
        L.append("")
    kern = [_snr(r.get(k)) for r in rows for k in ("kernel_vs_ref", "prefill_kernel_vs_ref") if r.get(k)]
    if kern:
        # The kernels are right when their own error is negligible next to the format's: 20 dB under it
        # (1% of its power, < 0.05 dB on the total), and never under 40 dB (their bf16 output rounds at
        # ~50 dB; two right fp32 implementations also differ where h sits on an e4m3 rounding boundary).
        fmt = max(_snr(r["fp8_ue8m0_vs_exact"]) for r in rows)
        kmin, bar = min(kern), max(40.0, fmt + 20.0)
        kv = (f"the Triton kernels match their reference to >= {_db(kmin)} dB on identical quantised inputs (bar "
              f"{_db(bar)} dB: 20 dB under the format's own {_db(fmt)} dB, so their share of the error is under 1%), "
              "so they are right" if kmin >= bar else f"the Triton kernels match their reference only to "
              f"{_db(kmin)} dB on identical quantised inputs (bar {_db(bar)} dB): a kernel defect")
    else:
        kv = "the Triton kernels were not run (CPU)"
    fmt = [_snr(r["fp8_ue8m0_vs_exact"]) for r in rows]
    f32 = [_snr(r["fp8_fp32_scales_vs_exact"]) for r in rows]
    wo = [_snr(r["weights_only_vs_exact"]) for r in rows]
    txt = (f"Cause (fp8_block): {kv}. The format alone costs each MoE layer's output {_rng(fmt)} dB (weight "
           f"conversion alone {_rng(wo)} dB; the rest is e4m3 activations per 1x128 with ue8m0 power-of-two scales, "
           f"which deepseek_v4.md specifies for V4); fp32 scales would give {_rng(f32)} dB.")
    if c:
        allv, pred = _snr(c["all_ue8m0"]["logits"]), c["predicted_all_db"]
        txt += (f" In the eager model with routing pinned, fp8 experts in every layer give logits {_db(allv)} dB "
                f"(independent per-layer errors predict {_db(pred)} dB; one layer alone {_rng(list(c['single'].values()))}"
                f" dB); with fp32 scales {_db(_snr(c['all_fp32_scales']['logits']))} dB.")
        got = next((_snr(r.get("pinned")) for r in res.get("formats", []) if r.get("format") == "fp8_block"
                    and "pinned" in r), None)
        if got is not None:
            same = abs(got - allv) <= 2.0
            txt += (f" The compiled graph's {_db(got)} dB is {'that figure: the format' if same else 'not that figure'}"
                    f"{', not the kernels, sets it' if same else ' (a difference beyond the format: look further)'}.")
    return L + [txt, ""]


def render(res: dict) -> str:
    L = [f"## Accuracy of the compiled {res['preset']} ({res['target']}), {res['device']}", "",
         f"{res['date']}, commit {res['commit']}, torch {res['torch']}, {res['dtype']}, prompts of {res['prompt']} "
         f"tokens; {res['seconds']:.0f} s. SNR of the logits against the eager model on the same tokens; pinned: "
         "the graph's experts get eager's routing decisions and its sparse attention eager's indexer selections.",
         ""]
    for kind, rows in res.get("passes", {}).items():
        if isinstance(rows, dict):
            L += [f"{kind}: {rows.get('skipped')}", ""]
            continue
        L += [f"### Per pass, {kind} graph", "", "| pass | SNR free | SNR pinned | max abs pinned | cosine pinned | "
              "max layer flips (free) | max indexer flips (free) | target met (pinned) |",
              "|---|---:|---:|---:|---:|---:|---:|---|"]
        for r in rows:
            p = r.get("pinned") or {}
            bar = TARGET_DB["fp8_block"] if r["name"] in LOSSY else TARGET_DB["fusion"]
            L.append(f"| {r['name']} | {_db(r.get('snr_db'))} | {_db(p.get('snr_db'))} | "
                     f"{p.get('max_abs_err', float('nan')):.3g} | {p.get('cosine', float('nan')):.6f} | "
                     f"{_flipmax(r.get('flips'))} | {_flipmax(r.get('index_flips'))} | {_met(p.get('snr_db'), bar)} |")
        L.append("")
    if res.get("formats"):
        L += ["### Per expert format (prefill graph, fused pipeline)", "",
              "| format | SNR free | SNR pinned | max abs pinned | cosine pinned | target | met |",
              "|---|---:|---:|---:|---:|---:|---|"]
        for r in res["formats"]:
            if "skipped" in r:
                L.append(f"| {r['format']} | {r['skipped']} | | | | | |")
                continue
            p = r["pinned"]
            L.append(f"| {r['format']} | {_db(r['snr_db'])} | {_db(p['snr_db'])} | {p['max_abs_err']:.3g} | "
                     f"{p['cosine']:.6f} | {TARGET_DB[r['format']]:.0f} dB | {_met(p['snr_db'], TARGET_DB[r['format']])} |")
        L.append("")
        L += ["Per MoE layer, share of tokens whose top-k expert set differs from eager's (free / pinned-local):", "",
              "| format | " + " | ".join(f["layer"] for f in next((r["flips"] for r in res["formats"]
                                                                       if "flips" in r), [])) + " |"]
        L.append("|---|" + "---:|" * len(next((r["flips"] for r in res["formats"] if "flips" in r), [])))
        for r in res["formats"]:
            if "flips" in r:
                L.append(f"| {r['format']} | " + " | ".join(f"{a['share']:.1%} / {b['share']:.1%}" for a, b in
                                                           zip(r["flips"], r["pinned_flips"])) + " |")
        L.append("")
    L += fusion_cause(res)
    L += fp8_cause(res)
    a = res.get("artifact")
    if a:
        L += ["### The whole artifact through Session.logits", ""]
        if "skipped" in a or "failed" in a:
            L += [f"{a.get('skipped') or a.get('failed')}", ""]
        else:
            bar = TARGET_DB.get(a["expert_format"], TARGET_DB["fp8_block"])
            L += [f"{a['expert_format']} experts, one prompt of {a['prompt']} tokens (compile {a['compile_s']:.0f} s): "
                  f"SNR free {_db(a['free']['snr_db'])} dB, pinned **{_db(a['pinned']['snr_db'])} dB** (max abs "
                  f"{a['pinned']['max_abs_err']:.3g}, cosine {a['pinned']['cosine']:.6f}; target {bar:.0f} dB: "
                  f"{_met(a['pinned']['snr_db'], bar)}); argmax agreement free {a['argmax_agree_free']:.1%}, pinned "
                  f"{a['argmax_agree_pinned']:.1%}; max layer flips free {_flipmax(a['flips'])}, max indexer flips "
                  f"free {_flipmax(a.get('index_flips'))}.", ""]
    marg = res.get("margins", {})
    if marg:
        L += ["### Top-k margins (eager, unpinned): k-th minus (k+1)-th selection score", "",
              "| model | layer | tokens | min | p1 | p10 | p50 | share < 1e-3 | share < 1e-2 |",
              "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
        for name, ms in marg.items():
            for m in ms:
                if "quantiles" not in m:
                    L.append(f"| {name} | {m['layer']} (hash) | {m['tokens']} | - | - | - | - | - | - |")
                    continue
                q, b = m["quantiles"], m["below"]
                L.append(f"| {name} | {m['layer']} | {m['tokens']} | {q['p0']:.2e} | {q['p1']:.2e} | {q['p10']:.2e} | "
                         f"{q['p50']:.2e} | {b['0.001']:.1%} | {b['0.01']:.1%} |")
    return "\n".join(L) + "\n"


def write(res: dict, out: Path, t0: float) -> None:
    from dsv4c.compare import json_rows

    res["seconds"] = time.perf_counter() - t0
    clean = json_rows([{k: v for k, v in res.items()}])[0]
    (out / "accuracy.json").write_text(json.dumps(clean, indent=1, default=str) + "\n")
    (out / "accuracy.md").write_text(render(res))


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out-dir", type=Path, required=True)
    ap.add_argument("--preset", default="v4-flash-slice")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--target", default="h200")
    ap.add_argument("--prompt", type=int, default=256, help="prompt tokens per row (>= 256 for the issue's table)")
    ap.add_argument("--budget-s", type=float, default=330.0, help="wall-clock budget; later parts are skipped")
    ap.add_argument("--work", type=Path, default=None, help="checkpoint + artifact folder (default: a temp dir)")
    ap.add_argument("--graphs", default="prefill,decode,mtp", help="graph kinds of the per-pass part")
    ap.add_argument("--formats", default=",".join(FORMATS), help="expert formats of the per-format part")
    ap.add_argument("--no-artifact", action="store_true")
    ap.add_argument("--parts", default=",".join(PARTS),
                    help=f"parts to run, comma-separated, of {','.join(PARTS)} (module docstring)")
    ap.add_argument("--quick", action="store_true", help="v4-tiny-a, 40-token prompts (a smoke run)")
    a = ap.parse_args(argv)
    if a.quick:
        a.preset, a.prompt = "v4-tiny-a", 40
    t0 = time.perf_counter()
    budget = Budget(a.budget_s)
    dev = torch.device(a.device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    a.out_dir.mkdir(parents=True, exist_ok=True)
    res = {"preset": a.preset, "target": a.target, "prompt": a.prompt, "dtype": str(dtype).replace("torch.", ""),
           "date": time.strftime("%Y-%m-%d"), "commit": _commit(), "torch": torch.__version__,
           "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
           "command": "python examples/accuracy_slice.py " + " ".join(sys.argv[1:] if argv is None else argv),
           "targets_db": TARGET_DB, "passes": {}, "formats": [], "margins": {}}
    torch.manual_seed(0)
    model = build(a.preset, dev, dtype)
    res["build_s"] = time.perf_counter() - t0
    print(f"[build] {res['build_s']:.0f} s", flush=True)
    parts = {p for p in a.parts.split(",") if p}
    if parts - set(PARTS):
        ap.error(f"--parts: unknown {sorted(parts - set(PARTS))}; choose from {','.join(PARTS)}")
    a.no_artifact = a.no_artifact or "artifact" not in parts
    kinds = [k for k in a.graphs.split(",") if k] if "passes" in parts else []
    reserve = 0 if a.no_artifact else ARTIFACT_S  # kept for the artifact part, which deletes the model
    with torch.no_grad():
        if "prefill" in kinds:
            run_kind(res, model, a, "prefill", dev, t0)
        t1 = time.perf_counter()
        formats = [f for f in a.formats.split(",") if f] if "formats" in parts else []
        res["formats"] = per_format(model, a.target, a.prompt, formats, budget, min_s=reserve + 30) if formats else []
        _free(dev)
        print(f"[formats] {time.perf_counter() - t1:.0f} s", flush=True)
        write(res, a.out_dir, t0)
        run_causes(res, model, a, parts, dev, budget, reserve, t0)
        try:
            if "margins" in parts:
                res["margins"][BUNDLE.name] = trained_margins(dev)["margins"]
        except Exception as e:  # the slice's figures stand without it
            res["margins_failed"] = f"{type(e).__name__}: {str(e)[:300]}"
        for kind in [k for k in kinds if k != "prefill"]:
            if budget.left() < reserve + KIND_S:
                res["passes"][kind] = {"skipped": f"time budget: {budget.left():.0f} s left, {reserve:.0f} s of it "
                                                  f"kept for the artifact"}
                continue
            run_kind(res, model, a, kind, dev, t0)
        write(res, a.out_dir, t0)
        if a.no_artifact:
            res["artifact"] = {"skipped": "--no-artifact"}
        elif budget.left() < ARTIFACT_S * 0.8:
            res["artifact"] = {"skipped": f"time budget: {budget.left():.0f} s left (the artifact part needs "
                                          f"~{ARTIFACT_S:.0f} s)"}
        else:
            res["artifact"] = run_artifact(model, a, dev)
            model = None
        write(res, a.out_dir, t0)
    print(render(res))
    return res


def run_causes(res: dict, model, a, parts: set, dev, budget: Budget, reserve: float, t0: float) -> None:
    """The bf16-floor and fp8 parts (the causes of the fusion and fp8_block figures), within the budget."""
    if "floor" in parts:
        if budget.left() < reserve + FLOOR_S:
            res["floor"] = {"skipped": f"time budget: {budget.left():.0f} s left"}
        else:
            t1 = time.perf_counter()
            res["floor"] = bf16_floor(model, a.prompt)
            print(f"[floor] {time.perf_counter() - t1:.0f} s", flush=True)
        write(res, a.out_dir, t0)
    if "fp8" in parts:
        if budget.left() < reserve + FP8_S:
            res["fp8"] = {"skipped": f"time budget: {budget.left():.0f} s left"}
        else:
            t1 = time.perf_counter()
            res["fp8"] = {"kernel": fp8_kernel_check(model, a.prompt, dev)}
            _free(dev)
            res["fp8"]["compounding"] = fp8_compounding(model, a.prompt, dev)
            _free(dev)
            print(f"[fp8] {time.perf_counter() - t1:.0f} s", flush=True)
        write(res, a.out_dir, t0)


def run_kind(res: dict, model, a, kind: str, dev, t0: float) -> None:
    t1 = time.perf_counter()
    rows = per_pass(model, a.target, kind, a.prompt)
    res["passes"][kind] = rows
    if kind == "prefill" and rows[0].get("margins"):
        res["margins"][a.preset] = rows[0]["margins"]
    _free(dev)
    print(f"[{kind}] {time.perf_counter() - t1:.0f} s", flush=True)
    write(res, a.out_dir, t0)


def run_artifact(model, a, dev) -> dict:
    from dsv4c.runtime import Session

    tmp = None
    work = a.work
    if work is None:
        tmp = tempfile.TemporaryDirectory(prefix="dsv4c-acc-")
        work = Path(tmp.name)
    try:
        t1 = time.perf_counter()
        prep = artifact(model, work, a.target, a.prompt, dev)
        del model
        _free(dev)
        sess = Session.load(prep["art"], device=dev, graphs="off", emulate=dev.type != "cuda")
        out = {"expert_format": prep["expert_format"], "checkpoint_s": prep["checkpoint_s"],
               "compile_s": prep["compile_s"], **prep["measure"](sess)}
        del sess
        _free(dev)
        print(f"[artifact] {time.perf_counter() - t1:.0f} s", flush=True)
        return out
    except Exception as e:  # report it: the other parts stand
        import traceback

        traceback.print_exc()
        return {"failed": f"{type(e).__name__}: {str(e)[:500]}"}
    finally:
        if tmp is not None:
            tmp.cleanup()


if __name__ == "__main__":
    main()
