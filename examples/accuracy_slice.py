"""Issue 22's accuracy table: is the compiled v4-flash-slice faithful to the eager model? (H200, bf16)

    python examples/accuracy_slice.py --out-dir $OUT/acc                    # H200, <= 6 minutes
    python examples/accuracy_slice.py --quick --device cpu --out-dir /tmp/acc   # v4-tiny-a smoke run

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

FORMATS = ("fp8_block", "mxfp4_w4a16", "nvfp4_w4a16")
TARGET_DB = {"fusion": 38.0, "fp8_block": 25.0, "mxfp4_w4a16": 35.0, "nvfp4_w4a16": 35.0}
BUNDLE = ROOT / "examples" / "models" / "v4-tiny-pystdlib"
LOSSY = ("quantize_experts", "select_kernels")  # rows after the lossy pass carry its error
ARTIFACT_S = 140.0  # the artifact part on the H200: checkpoint ~20 s, compile ~65 s, load + two prefills
KIND_S = 40.0  # one more graph kind's per-pass rows (export, passes, two runs per row)


class Budget:
    def __init__(self, total: float):
        self.total, self.t0 = total, time.perf_counter()

    def left(self) -> float:
        return self.total - (time.perf_counter() - self.t0)


def _free(dev) -> None:
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()


def _commit() -> str:
    import subprocess

    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              timeout=10).stdout.strip() or "unknown"
    except OSError:
        return "unknown"


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
    from dsv4c.routing import routing_flips
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
                                                      routing_flips)}


def _measure_artifact(sess, ids, ref, table, artifact_logits, error_metrics, routing_flips) -> dict:
    free, ftap = artifact_logits(sess, ids)
    pinned, ptap = artifact_logits(sess, ids, table)
    return {"prompt": len(ids), "free": error_metrics(free, ref), "pinned": error_metrics(pinned, ref),
            "argmax_agree_free": float((free.argmax(-1) == ref.argmax(-1)).float().mean()),
            "argmax_agree_pinned": float((pinned.argmax(-1) == ref.argmax(-1)).float().mean()),
            "flips": routing_flips(table, ftap.seen), "pinned_flips": routing_flips(table, ptap.seen)}


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


def render(res: dict) -> str:
    L = [f"## Accuracy of the compiled {res['preset']} ({res['target']}), {res['device']}", "",
         f"{res['date']}, commit {res['commit']}, torch {res['torch']}, {res['dtype']}, prompts of {res['prompt']} "
         f"tokens; {res['seconds']:.0f} s. SNR of the logits against the eager model on the same tokens; pinned: "
         "the graph's experts get eager's routing decisions.", ""]
    for kind, rows in res.get("passes", {}).items():
        if isinstance(rows, dict):
            L += [f"{kind}: {rows.get('skipped')}", ""]
            continue
        L += [f"### Per pass, {kind} graph", "", "| pass | SNR free | SNR pinned | max abs pinned | cosine pinned | "
              "max layer flips (free) | target met (pinned) |", "|---|---:|---:|---:|---:|---:|---|"]
        for r in rows:
            p = r.get("pinned") or {}
            bar = TARGET_DB["fp8_block"] if r["name"] in LOSSY else TARGET_DB["fusion"]
            L.append(f"| {r['name']} | {_db(r.get('snr_db'))} | {_db(p.get('snr_db'))} | "
                     f"{p.get('max_abs_err', float('nan')):.3g} | {p.get('cosine', float('nan')):.6f} | "
                     f"{_flipmax(r.get('flips'))} | {_met(p.get('snr_db'), bar)} |")
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
                  f"{a['argmax_agree_pinned']:.1%}; max layer flips free {_flipmax(a['flips'])}.", ""]
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
    kinds = [k for k in a.graphs.split(",") if k]
    reserve = 0 if a.no_artifact else ARTIFACT_S  # kept for the artifact part, which deletes the model
    with torch.no_grad():
        if "prefill" in kinds:
            run_kind(res, model, a, "prefill", dev, t0)
        t1 = time.perf_counter()
        formats = [f for f in a.formats.split(",") if f]
        res["formats"] = per_format(model, a.target, a.prompt, formats, budget, min_s=reserve + 30) if formats else []
        _free(dev)
        print(f"[formats] {time.perf_counter() - t1:.0f} s", flush=True)
        write(res, a.out_dir, t0)
        try:
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
