"""Issue 28 item 1: the v4-flash-slice's decode step with its FP8-stored dense linears widened to bf16
(as before), on W8A8 FP8 GEMMs and on W8A16 FP8 GEMMs (passes/quantize_dense.py), one run.

    python examples/bench_dense_formats.py --work /tmp/dense --out $OUT/dense_formats.json    # H200
    python examples/bench_dense_formats.py --quick --device cpu --work /tmp/q --out q.json     # a smoke run

One format per call (each fits in about 2.5 minutes on the H200 once the checkpoint exists):
    python examples/bench_dense_formats.py --work /tmp/dense --out $OUT/d.json --formats fp8_block_w8a16 --reuse
`--reuse` keeps stages 1-2 from an earlier call on the same machine (the checkpoint and `prep.pt` in
--work: roofline, eager's logits and routing), takes an artifact already in --work instead of
compiling it (the kernels are not in the artifact; recompile after changing a pass: drop `--reuse`
or delete `art_<format>`), and merges the formats measured by earlier calls (`results.json` in --work). `--keep-artifacts` leaves the
artifacts in --work for the next call (one slice artifact plus the checkpoint fit the disk; three do
not). `--skip-accuracy` times only.

Stages (the JSON is rewritten after each, so a timeout keeps what was measured):
  1. copy bandwidth; the slice built on the GPU (seeded random), rounded to the release formats in
     place (bench_artifact.round_to_release_) and written as a release checkpoint (FP8 128x128
     attention / shared expert, MXFP4 experts);
  2. one eager decode step per batch counts the unique routed experts (the roofline's expert bytes);
     eager's routing and logits of one prompt are kept for the accuracy check;
  3. per dense format: `dsv4c compile --target h200 --dense-format F` (the artifact is deleted after its
     stage unless --keep-artifacts: three slice artifacts do not fit the disk), `dsv4c bench --graphs full`,
     the pinned-routing SNR of the artifact's logits against eager (bench_artifact.artifact_accuracy),
     and with --prefill N the prefill of an N-token prompt at batch 1 (`dsv4c bench --prompt-len N
     --output-len 2`, its prefill calls timed one by one; the FP8 formats' prefill-sized linears run
     other kernels than their decode ones, kernels/fp8_gemm.py).
Rooflines (bench_segments.step_bytes, over the measured copy bandwidth): `bf16_counted` counts every
non-expert weight in bf16 (the figure issue 28 starts from); `stored` counts the weights the release
stores in FP8 at 1 byte + one ue8m0 byte per 128x128 tile (V4's grouped wo_a included: `fp8_grouped_linear`
reads it as stored; `stored_wo_a_bf16` is the bound of the trees before it, which read wo_a in bf16).

Legend: B batch rows, P prompt tokens, S decode steps.
"""
from __future__ import annotations

import argparse
import gc
import json
import shutil
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_artifact import _cache_tensors, _run, artifact_accuracy, dsv4c, round_to_release_, time_steps  # noqa: E402
from bench_segments import _commit, build, copy_bandwidth, prefill, step_bytes, stored_bytes_saved  # noqa: E402

from dsv4c.checkpoint import save_checkpoint  # noqa: E402
from dsv4c.model.generate import greedy  # noqa: E402
from dsv4c.routing import IndexEntry, RoutingEntry, RoutingTable  # noqa: E402

FORMATS = ("bf16", "fp8_block", "fp8_block_w8a16")


def build_and_prep(a, dev, dtype, ckpt: Path, res: dict, stage) -> tuple:
    """Stages 1-2: the model, its release rounding and checkpoint; the roofline per batch (unique experts
    of one eager decode step); eager's logits and routing of one prompt (the accuracy check)."""
    t0 = time.perf_counter()
    bw = copy_bandwidth(dev) if dev.type == "cuda" else None
    res["copy_bandwidth_GBps"] = bw / 1e9 if bw else None
    model = build(a.preset, dev, dtype)
    res["rounded"] = round_to_release_(model)
    save_checkpoint(model, ckpt, quant="release", overwrite=True, progress=False)
    stage("build_and_checkpoint", t0)

    t0 = time.perf_counter()
    n_slots, max_len = max(a.batches), a.prompt + a.steps + 8
    cache = prefill(model, n_slots + 1, a.prompt, max_len, chunk_rows=8, seed=0)
    snapshot = [t.clone() for t in _cache_tensors(cache)]
    saved = stored_bytes_saved(model)
    res["roofline"] = {}
    for B in a.batches:
        r = time_steps(model.step, model, cache, snapshot, B, 2, count_experts=True)
        by = step_bytes(model, B, a.prompt, r["unique_experts"])
        bf16 = by["total_fp8_experts"]  # FP8 routed experts as the artifact stores them, bf16 elsewhere
        stored = bf16 - saved["saved"]
        res["roofline"][B] = {**by, "dense_fp8_saved_bytes": saved["saved"], "wo_a_saved_bytes": saved["wo_a_saved"],
                              "bf16_counted_ms": bf16 / bw * 1e3 if bw else None,
                              "stored_ms": stored / bw * 1e3 if bw else None,
                              "stored_wo_a_bf16_ms": (stored + saved["wo_a_saved"]) / bw * 1e3 if bw else None}
    chk = torch.randint(0, model.config.vocab_size, (min(64, a.prompt),), generator=torch.Generator().manual_seed(11))
    from dsv4c.compare import eager_routing

    with torch.no_grad():
        full, routing = eager_routing(model, chk.tolist())
        check = (chk.tolist(), full[-1].cpu(), greedy(model, chk[None].to(dev), 4)[0].tolist(), full.cpu(), routing)
    del model, cache, snapshot
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    stage("eager_experts", t0)
    return check


def _prep_key(a) -> dict:
    return {"preset": a.preset, "prompt": a.prompt, "steps": a.steps, "batches": a.batches, "device": a.device}


def save_prep(path: Path, key: dict, res: dict, check: tuple) -> None:
    """Stages 1-2's results for a later --reuse call: plain tensors, lists and strings (torch.load
    with weights_only=True reads them back; no pickled objects)."""
    ids, last, greedy_ids, full, routing = check
    entries = [{"name": e.name, "idx": e.idx, "weight": e.weight, "hashed": e.hashed, "margins": e.margins}
               for e in routing.entries]
    index = [{"name": e.name, "idx": e.idx} for e in routing.index]  # the CSA indexers' selections
    torch.save({"key": key, "res": json.dumps({k: res[k] for k in ("copy_bandwidth_GBps", "rounded", "roofline")},
                                                default=str),
                "ids": ids, "last": last, "greedy": greedy_ids, "full": full, "routing": entries, "index": index}, path)


def load_prep(path: Path, key: dict) -> tuple[dict, tuple] | None:
    """(res fields, check) saved by `save_prep` for the same key, else None."""
    if not path.exists():
        return None
    d = torch.load(path, weights_only=True)
    if d["key"] != key or "index" not in d:
        print(f"{path}: saved for {d['key']} (indexer selections: {'index' in d}), not {key}: rebuilding", flush=True)
        return None
    routing = RoutingTable([RoutingEntry(e["name"], e["idx"], e["weight"], e["hashed"], e["margins"])
                            for e in d["routing"]], [IndexEntry(e["name"], e["idx"]) for e in d["index"]])
    fields = json.loads(d["res"])
    fields["roofline"] = {int(b): v for b, v in fields["roofline"].items()}
    return fields, (d["ids"], d["last"], d["greedy"], d["full"], routing)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="v4-flash-slice")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--target", default="h200")
    ap.add_argument("--formats", nargs="+", default=list(FORMATS), choices=FORMATS)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--steps", type=int, default=20, help="decode steps per batch; the first are warm-up")
    ap.add_argument("--work", type=Path, required=True, help="folder for the checkpoint and the artifacts")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--quick", action="store_true", help="tiny model, short prompt (a smoke run)")
    ap.add_argument("--reuse", action="store_true",
                    help="reuse the checkpoint, prep.pt and artifacts in --work, merge earlier calls' formats")
    ap.add_argument("--keep-artifacts", action="store_true", help="leave each artifact in --work")
    ap.add_argument("--skip-accuracy", action="store_true", help="time only (no pinned-routing SNR)")
    ap.add_argument("--prefill", type=int, nargs="*", default=[], help="prompt lengths whose prefill is timed")
    a = ap.parse_args(argv)
    if a.quick:
        a.preset, a.batches, a.prompt, a.steps = "v4-tiny-b", [1, 3], 40, 6
        a.prefill = [48] if a.prefill else []  # within the tiny model's compile limits
    dev = torch.device(a.device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    a.work.mkdir(parents=True, exist_ok=True)
    ckpt = a.work / "ckpt"
    res: dict = {"preset": a.preset, "target": a.target, "batches": a.batches, "prompt": a.prompt, "steps": a.steps,
                 "commit": _commit(), "torch": torch.__version__, "stages_s": {}, "formats": {},
                 "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"}

    last = a.work / "results.json"  # every call's results, for --reuse's merge ($OUT may be a fresh folder)

    def stage(name: str, t0: float) -> None:
        res["stages_s"][name] = round(time.perf_counter() - t0, 1)
        a.out.write_text(json.dumps(res, indent=1, default=str))
        last.write_text(json.dumps(res, indent=1, default=str))
        print(f"[{name}] {res['stages_s'][name]}s", flush=True)

    prep_path = a.work / "prep.pt"
    prep = load_prep(prep_path, _prep_key(a)) if a.reuse and (ckpt / "config.json").exists() else None
    if prep is not None:
        res.update(prep[0])
        check = prep[1]
        res["reused_prep"] = str(prep_path)
        for prev in (last, a.out):
            if prev.exists():
                res["formats"] = json.loads(prev.read_text()).get("formats", {})
                res["merged_from"] = str(prev)
                break
        stage("reused_prep", time.perf_counter())
    else:
        check = build_and_prep(a, dev, dtype, ckpt, res, stage)
        save_prep(prep_path, _prep_key(a), res, check)

    # 3. per format: compile, bench, accuracy; then free the disk
    graphs = "full" if dev.type == "cuda" else "off"
    target = a.target if dev.type == "cuda" else "cpu"
    for fmt in a.formats:
        t0 = time.perf_counter()
        art, rec = a.work / f"art_{fmt}", {}
        res["formats"][fmt] = rec
        try:
            if a.reuse and (art / "manifest.json").exists():
                rec["compile_s"], rec["reused_artifact"] = 0.0, str(art)
            else:
                cmd = dsv4c("compile", str(ckpt), "--target", target, "--dense-format", fmt, "-o", str(art), "--force",
                            "--max-batch", str(max(a.batches)),
                            "--max-tokens", str(max([a.prompt, *a.prefill]) + a.steps + 8),
                            "--buckets", ",".join(map(str, sorted(set(a.batches)))))
                rec["compile_s"] = round(_run(cmd, a.work / f"compile_{fmt}.log"), 1)
            m = json.loads((art / "manifest.json").read_text())
            dense = m["quant_map"].get("dense", {}).get("modules", {})
            rec["artifact_bytes"] = sum(f["size"] for f in m["files"].values())
            rec["dense_weights"] = len(dense)
            rec["dense_kernels"] = sorted({d["kernel"] for d in dense.values()})
            js = a.work / f"bench_{fmt}.json"
            cmd = dsv4c("bench", str(art), "--batch", *map(str, a.batches), "--prompt-len", str(a.prompt),
                        "--output-len", str(a.steps), "--graphs", graphs, "--device", str(dev), "--json", str(js))
            _run(cmd, a.work / f"bench_{fmt}.log")
            rec["bench"] = json.loads(js.read_text())
            stage(f"format_{fmt}_bench", t0)
            if not a.skip_accuracy:
                rec["accuracy"] = artifact_accuracy(art, dev, check)
            for P in a.prefill:
                js = a.work / f"prefill_{fmt}_{P}.json"
                cmd = dsv4c("bench", str(art), "--batch", "1", "--prompt-len", str(P), "--output-len", "2",
                            "--graphs", graphs, "--device", str(dev), "--json", str(js))
                _run(cmd, a.work / f"prefill_{fmt}_{P}.log")
                r = json.loads(js.read_text())["rows"][0]
                rec.setdefault("prefill", []).append({"prompt": P, "prefill_ms": r["prefill_s"] * 1e3,
                                                      "calls": r.get("prefill_calls"),
                                                      "tokens_per_s": r["prefill_tokens_per_s"]})
                stage(f"format_{fmt}_prefill_{P}", t0)
        except Exception as e:  # the other formats still get measured
            rec["failed"] = f"{type(e).__name__}: {str(e)[:600]}"
            print(f"{fmt} failed: {rec['failed']}", flush=True)
        if not a.keep_artifacts:
            shutil.rmtree(art, ignore_errors=True)
        stage(f"format_{fmt}", t0)
    res["summary"] = summarize(res)
    print(table(res["summary"]))
    for fmt, rec in res["formats"].items():
        for p in rec.get("prefill", []):
            print(f"prefill {fmt} {p['prompt']} tokens: {p['prefill_ms']:.1f} ms ({p['calls']} calls, "
                  f"{p['tokens_per_s']:.0f} tok/s)")
    a.out.write_text(json.dumps(res, indent=1, default=str))
    last.write_text(json.dumps(res, indent=1, default=str))
    return 0


def summarize(res: dict) -> list[dict]:
    rows = []
    for fmt, rec in res["formats"].items():
        snr = (rec.get("accuracy") or {}).get("pinned_snr_db")
        for r in (rec.get("bench") or {}).get("rows", []):
            roof = res["roofline"].get(r["batch"]) or res["roofline"].get(str(r["batch"])) or {}
            ms = r["step_ms_p50"]
            rows.append({"format": fmt, "batch": r["batch"], "step_ms_p50": ms,
                         "bf16_counted_roofline_ms": roof.get("bf16_counted_ms"),
                         "stored_roofline_ms": roof.get("stored_ms"),
                         "vs_bf16_counted": roof["bf16_counted_ms"] / ms if roof.get("bf16_counted_ms") else None,
                         "vs_stored": roof["stored_ms"] / ms if roof.get("stored_ms") else None,
                         "pinned_snr_db": snr})
    return rows


def table(rows: list[dict]) -> str:
    def f(v, spec):
        return "–" if v is None else format(v, spec)

    out = ["| dense format | batch | ms/step | roofline bf16-counted | vs it | roofline stored | vs it | pinned SNR dB |",
           "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['format']} | {r['batch']} | {f(r['step_ms_p50'], '.3f')} | "
                   f"{f(r['bf16_counted_roofline_ms'], '.3f')} | {f(r['vs_bf16_counted'], '.1%')} | "
                   f"{f(r['stored_roofline_ms'], '.3f')} | {f(r['vs_stored'], '.1%')} | {f(r['pinned_snr_db'], '.1f')} |")
    return "\n".join(out)


if __name__ == "__main__":
    raise SystemExit(main())
