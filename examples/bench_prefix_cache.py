"""Issue 27's benchmark: prefix caching on the v4-flash-slice. R requests share an S-token system prompt
and each adds its own U-token suffix (default 64 x 4096 + 128); all are submitted at once to one Session.

    python examples/bench_prefix_cache.py --work /tmp/dsv4c_pc --out $OUT/prefix_cache.json      # H200
    python examples/bench_prefix_cache.py --quick --device cpu --work /tmp/pcq --out pcq.json     # smoke run

Stages (each timed; the JSON is rewritten after every stage):
  1. the slice built on the device, rounded to the release formats, its checkpoint written, and
     `dsv4c compile --target h200 --max-batch R --buckets R` (as examples/bench_artifact.py does);
  2. one Session (graphs=full; `Session.load(warm_up=True)`: the kernels' JIT compiles and the prefill CUDA
     graphs' captures at load, `--prefill-graphs off` runs prefill op by op), a warm-up
     request, then the same R requests
       off   prefix caching off (`sess.prefix = None`): every request prefills S + U tokens;
       on    an empty prefix cache: the first request prefills everything and stores its blocks,
             the others resume at the system prompt's last block and prefill U tokens;
       warm  the same requests again: every request resumes from cached blocks.
With --profile-prefill, once the slot runs are done, the prefill paths behind those TTFTs are timed and
profiled (torch.profiler, kernels grouped by name): one request resuming from the cached system prompt
(1 x U tokens), 16 such requests in one prefill call (16 x U), one request without the cache (S + U tokens,
chunks of max_num_batched_tokens) and one 2048-token prompt (one chunk); each is `generate(..., max_new_tokens=1)`,
so admission, the prefix restore and the first token are in it. Where the Session replays prefill calls as
CUDA graphs (runtime/prefill_graphs.py, `Session.load(prefill_graphs="auto")`), each scenario is timed op by op
too (`ms_op_by_op`); with --paged the paged Session's scenarios are profiled as well (`paged_prefill_profile`).
`--runs on,warm` skips the cache-off run (a profiling pass needs no baseline; the summary then has no speedups).

With --paged, a second artifact compiled with `--paged` (the growing caches in blocks of a shared pool,
runtime/block_pool.py: blocks grown as requests decode; CUDA graphs capture the paged graphs) runs after the
first Session is freed: `paged_on`, `paged_warm` (prompts share the system prompt's blocks without copies)
and, with --paged-off, `paged_off` (no sharing: ~45 s more on the H200). The summary compares its decode
speed with the slot caches' (same prefix-cache state: paged_on vs on, paged_warm vs warm; issue 27: within
3 %), its TTFT with the slot caches' without prefix caching, and its greedy tokens with the slot runs'
(printed as "tokens identical" lines), and records the pool's peak blocks in use.

    python examples/bench_prefix_cache.py --paged --work /tmp/dsv4c_pc --out $OUT/prefix_cache_paged.json

Prefill is batched across requests (runtime/session.py `_prefill_rows`): admitted requests' chunks share prefill
calls of at most max_num_batched_tokens tokens (rows x the longest chunk), so with the prefix cache the R - 1
requests resuming at the system prompt's last block prefill their U tokens together, 2048 // U rows per call;
each run records its prefill calls and the mean rows per call (`prefill_calls`).

With --turn2 (after the slot runs), a second chat turn: each request sends its prompt, its `warm` answer and
U2 new tokens (--turn2-suffix), with the prefix cache (`turn2_on`: the answer's completed blocks are cached,
runtime/prefix_cache.py "Generated blocks", so it resumes past them) and without (`turn2_off`). The answer
completes a block only when N reaches past the prompt's last block end: use N > the block size (the slice:
128), e.g. `--new 160 --turn2`.

Per run: TTFT per request from the submission of all R (`ttft_submit`, what a client waits, queueing
included) and from its admission (`ttft_admit`, the Session's own ttft_s), the time until every request has
its first token, and decode tokens/s after that (all rows decoding together through the same slot caches:
prefix caching must leave it unchanged), the greedy tokens' agreement with the `off` run (bf16 with a
different chunking may round differently), and the prefix cache's stats.

With --mtp K the artifacts are compiled with --mtp K and every run decodes in MTP rounds of K drafts: the
prefix cache then resumes each V4 request at least W tokens before its prompt's end (its first draft needs those
positions' streams), and with --turn2 the answers' blocks come from the rounds (runtime/speculative.py
`keep_block`). On random weights the drafts are rarely accepted: the runs measure the caches under MTP, not
MTP's speedup.

Legend: R requests, S system-prompt tokens, U suffix tokens, N new tokens per request.
"""
from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_artifact import _run, dsv4c, round_to_release_  # noqa: E402
from bench_segments import _commit, build  # noqa: E402
from profile_step import JitCompiles, kernel_table  # noqa: E402

from dsv4c.checkpoint import save_checkpoint  # noqa: E402


def mtp_flags(a) -> list[str]:
    """The compile flags of --mtp K (none for 0)."""
    return ["--mtp", str(a.mtp)] if a.mtp else []


def max_tokens_of(a) -> int:
    """The artifacts' max_tokens: prompt + answer (+ the second turn's message and answer with --turn2)."""
    return a.system + a.suffix + a.new + 8 + ((a.turn2_suffix + a.new) if a.turn2 else 0)


def prompts(V: int, R: int, S: int, U: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    system = torch.randint(2, V, (S,), generator=g).tolist()
    return [system + torch.randint(2, V, (U,), generator=g).tolist() for _ in range(R)]


def _sync(dev) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


@torch.no_grad()
def serve(sess, ps: list[list[int]], new: int, dev, mtp: int = 0) -> dict:
    """Submit every prompt at once (greedy; `mtp` drafts per round); TTFT from submission and from admission,
    decode tokens/s."""
    _sync(dev)
    before = dict(sess.prefill_stats)
    t0 = time.perf_counter()
    first: dict[int, float] = {}
    tokens: dict[int, list[int]] = {i: [] for i in range(len(ps))}
    for i, tok in sess.stream(ps, max_new_tokens=new, mtp=mtp):
        if i not in first:
            _sync(dev)
            first[i] = time.perf_counter() - t0
        tokens[i].append(tok)
    _sync(dev)
    total = time.perf_counter() - t0
    calls = {k: v - before[k] for k, v in sess.prefill_stats.items()}
    all_first = max(first.values())
    ttft = sorted(first.values())
    return {"ttft_submit_ms_mean": 1e3 * statistics.mean(ttft), "ttft_submit_ms_p50": 1e3 * statistics.median(ttft),
            "ttft_submit_ms_max": 1e3 * ttft[-1], "all_first_tokens_s": all_first,
            "decode_s": total - all_first,
            "decode_tokens_per_s": len(ps) * (new - 1) / max(total - all_first, 1e-9), "total_s": total,
            "tokens": [tokens[i] for i in range(len(ps))],
            "prefill_calls": {**calls, "mean_rows_per_call": calls["rows"] / max(calls["calls"], 1)}}


@torch.no_grad()
def admit_ttft(sess, ps: list[list[int]], new: int) -> list[float]:
    """The Session's own per-request ttft_s (admission to first token) of a generate() over ps."""
    return [r.stats["ttft_s"] for r in sess.generate(ps, max_new_tokens=new)]


def run_paged(sess, ps, new, dev, share: bool, mtp: int = 0) -> dict:
    """A run on a paged Session: its block pool stays (it allocates the blocks); `share` turns prefix sharing."""
    pool = sess.prefix
    pool.share = share
    before = dict(pool.counters)
    res = serve(sess, ps, new, dev, mtp)
    res["prefix_stats"] = {**pool.stats(), "this_run": {k: v - before[k] for k, v in pool.counters.items()}}
    return res


def run(sess, ps, new, dev, prefix, mtp: int = 0) -> dict:
    sess.prefix = prefix
    before = dict(prefix.counters) if prefix is not None else None
    res = serve(sess, ps, new, dev, mtp)
    if prefix is not None:
        res["prefix_stats"] = {**prefix.stats(), "this_run": {k: v - before[k] for k, v in prefix.counters.items()}}
    return res


PROFILE_SCENARIOS = ("hit_1", "hit_16", "cold_full", "cold_2048")


def _scenario(name: str, ps: list[list[int]], U: int) -> tuple[list[list[int]], bool]:
    """-> (prompts, use the prefix cache) of a profiled prefill scenario."""
    return {"hit_1": (ps[1:2], True), "hit_16": (ps[1:17], True), "cold_full": (ps[:1], False),
            "cold_2048": ([ps[0][:2048]], False)}[name]


def _timed(sess, batch, dev, reps: int) -> list[float]:
    """ms of each of `reps` synchronised `generate(batch, max_new_tokens=1)` calls."""
    ms = []
    for _ in range(reps):
        _sync(dev)
        t0 = time.perf_counter()
        sess.generate(batch, max_new_tokens=1)
        _sync(dev)
        ms.append(1e3 * (time.perf_counter() - t0))
    return ms


@torch.no_grad()
def prefill_profile(sess, use_cache, ps: list[list[int]], U: int, dev, top: int = 25, reps: int = 3) -> dict:
    """Time (median of `reps`, synchronised) and profile each scenario's `generate(max_new_tokens=1)`; with
    prefill CUDA graphs (runtime/prefill_graphs.py) on, each is also timed op by op (`ms_op_by_op`, the graphs
    set aside meanwhile). `use_cache(bool)` turns the prefix cache (slot caches) or block sharing (paged) on
    or off."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    out = {}
    graphs = sess.prefill_graphs
    for name in PROFILE_SCENARIOS:
        batch, cached = _scenario(name, ps, U)
        use_cache(cached)
        sess.generate(batch, max_new_tokens=1)  # warm-up: this shape's kernels (and its prefill graph's capture)
        before = sess.prefill_stats["replays"]
        ms = _timed(sess, batch, dev, reps)
        replayed = sess.prefill_stats["replays"] > before
        with profile(activities=acts) as prof:
            sess.generate(batch, max_new_tokens=1)
            _sync(dev)
        kern, n_kern, kern_us = kernel_table(prof, top)
        tokens = sum(U if cached else len(p) for p in batch)  # a hit resumes at the system prompt's end
        out[name] = {"rows": len(batch), "prefilled_tokens": tokens, "ms": statistics.median(ms), "ms_all": ms,
                     "replayed": replayed, "kernels": n_kern, "kernel_ms": kern_us / 1e3, "top_kernels": kern}
        if graphs is not None:
            sess.prefill_graphs = None
            try:
                sess.generate(batch, max_new_tokens=1)
                out[name]["ms_op_by_op"] = statistics.median(_timed(sess, batch, dev, reps))
            finally:
                sess.prefill_graphs = graphs
        extra = f", op by op {out[name]['ms_op_by_op']:.1f} ms" if graphs is not None else ""
        print(f"[profile {name}] {len(batch)} rows, {tokens} tokens prefilled: {out[name]['ms']:.1f} ms "
              f"({'replayed' if replayed else 'op by op'}; {n_kern} kernels, {kern_us / 1e3:.1f} ms of kernel time"
              f"{extra})", flush=True)
        for r in kern[:12]:
            print(f"  {r['us'] / 1e3:8.2f} ms  x{r['count']:<5d} {r['name'][:100]}", flush=True)
    use_cache(True)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="v4-flash-slice")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--target", default="h200")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--system", type=int, default=4096)
    ap.add_argument("--suffix", type=int, default=128)
    ap.add_argument("--new", type=int, default=128,
                    help="new tokens per request (N): 128 decode for about 1 s at batch 64 on an H100; run20's 32 "
                         "gave 0.25 s windows in which two runs on the same caches differed by 4%%, too short to "
                         "judge paged vs slot within 3%%")
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--quick", action="store_true", help="tiny model, cpu target, 4 x (64 + 8) (a smoke run)")
    ap.add_argument("--paged", action="store_true", help="also compile and run paged caches (module docstring)")
    ap.add_argument("--pool-blocks", type=int, default=None, help="--paged: pool blocks (default: the slot capacity)")
    ap.add_argument("--paged-off", action="store_true", help="--paged: also the paged run without prefix sharing")
    ap.add_argument("--runs", default="off,on,warm", help="slot-cache runs, comma list of off,on,warm (default all)")
    ap.add_argument("--profile-prefill", action="store_true", help="time and profile the prefill paths (docstring)")
    ap.add_argument("--prefill-graphs", default="auto", choices=["auto", "off"],
                    help="Session.load(prefill_graphs=): prefill calls replayed as CUDA graphs (auto) or op by op")
    ap.add_argument("--turn2", action="store_true", help="a second chat turn after the slot runs (docstring)")
    ap.add_argument("--turn2-suffix", type=int, default=64, help="--turn2: new tokens of the second turn's message")
    ap.add_argument("--mtp", type=int, default=0, help="compile with --mtp K and decode every run with k = K drafts "
                    "per round (docstring)")
    a = ap.parse_args(argv)
    runs = a.runs.split(",")
    if not runs or set(runs) - {"off", "on", "warm"}:
        ap.error(f"--runs: a comma list of off, on, warm; got {a.runs!r}")
    if (a.paged or a.turn2) and runs != ["off", "on", "warm"]:
        ap.error("--paged and --turn2 need every slot run: leave --runs at off,on,warm")
    if a.quick:
        a.preset, a.target, a.requests, a.system, a.suffix = "v4-tiny-a", "cpu", 4, 64, 8
        a.new = 40 if a.turn2 else 4  # --turn2: answers that complete blocks
    dev = torch.device(a.device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    a.work.mkdir(parents=True, exist_ok=True)
    ckpt, art = a.work / "ckpt", a.work / "art"
    res: dict = {"preset": a.preset, "target": a.target, "requests": a.requests, "system": a.system,
                 "suffix": a.suffix, "new": a.new, "commit": _commit(), "torch": torch.__version__, "stages_s": {},
                 "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"}

    jit = JitCompiles()  # Triton compiles per stage: a timed run that compiles measures the JIT, not the cache

    def stage(name: str, t0: float) -> None:
        res["stages_s"][name] = round(time.perf_counter() - t0, 1)
        res.setdefault("jit_compiles", {})[name] = jit.take() if jit.available else None
        a.out.write_text(json.dumps(res, indent=1, default=str))
        jc = res["jit_compiles"][name]
        print(f"[{name}] {res['stages_s'][name]}s" + (f", {jc['total']} Triton compiles" if jc else ""), flush=True)

    # 1. model, checkpoint, artifact
    t0 = time.perf_counter()
    model = build(a.preset, dev, dtype)
    round_to_release_(model)
    save_checkpoint(model, ckpt, quant="release", overwrite=True, progress=False)
    V = model.config.vocab_size
    del model
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    stage("build_and_checkpoint", t0)
    t0 = time.perf_counter()
    max_tokens = max_tokens_of(a)
    cmd = dsv4c("compile", str(ckpt), "--target", a.target, "-o", str(art), "--force", "--max-batch", str(a.requests),
                "--max-tokens", str(max_tokens), "--buckets", str(a.requests), *mtp_flags(a))
    res["compile_command"] = " ".join(cmd[2:])
    _run(cmd, a.work / "compile.log")
    stage("compile", t0)

    # 2. one Session; off / on / warm
    from dsv4c.runtime import Session

    t0 = time.perf_counter()
    sess = Session.load(art, device=dev, graphs="full" if dev.type == "cuda" else "off", warm_up=True,
                        prefill_graphs=a.prefill_graphs)
    prefix = sess.prefix
    res["slot_cache_bytes"] = sess.cache_info["main"]["bytes"]
    res["load_warm_up_s"] = sess.warmup_s  # Session.warm_up at load: the kernels' JIT compiles
    res["prefix_pool"] = {"blocks": prefix.n_blocks, "block_size": prefix.block_size,
                          "bytes_per_block": prefix.bytes_per_block,
                          "pool_GiB": prefix.n_blocks * prefix.bytes_per_block / 2**30}
    res["prefill_graphs"] = _prefill_graphs_info(sess)
    sess.prefix = None
    sess.generate(prompts(V, 2, a.suffix, 3, seed=99), max_new_tokens=3)  # warm-up: kernels, graph replay
    stage("load_and_warmup", t0)
    ps = prompts(V, a.requests, a.system, a.suffix)
    for name, pc in (("off", None), ("on", prefix), ("warm", prefix)):
        if name not in runs:
            continue
        t0 = time.perf_counter()
        res[name] = run(sess, ps, a.new, dev, pc, a.mtp)
        r = res[name]
        print(f"{name}: TTFT mean {r['ttft_submit_ms_mean']:.1f} ms, all first tokens {r['all_first_tokens_s']:.2f} s, "
              f"decode {r['decode_tokens_per_s']:.0f} tok/s, {r['prefill_calls']['calls']} prefill calls "
              f"({r['prefill_calls']['mean_rows_per_call']:.1f} rows each)", flush=True)
        stage(name, t0)
    t0 = time.perf_counter()
    sess.prefix = None
    res["ttft_admit_ms_off"] = 1e3 * statistics.median(admit_ttft(sess, ps[:4], 2))
    sess.prefix = prefix
    res["ttft_admit_ms_on"] = 1e3 * statistics.median(admit_ttft(sess, ps[:4], 2))  # all hits by now
    stage("admission_ttft", t0)
    if a.profile_prefill:
        t0 = time.perf_counter()
        res["prefill_profile"] = prefill_profile(sess, lambda c: setattr(sess, "prefix", prefix if c else None),
                                                 ps, a.suffix, dev)
        stage("prefill_profile", t0)
    if runs != ["off", "on", "warm"]:
        a.out.write_text(json.dumps(res, indent=1, default=str))
        return 0
    off = res["off"]
    res["summary"] = {
        f"{k}_ttft_speedup": off["ttft_submit_ms_mean"] / res[k]["ttft_submit_ms_mean"] for k in ("on", "warm")}
    res["summary"].update({
        "all_first_tokens_speedup_on": off["all_first_tokens_s"] / res["on"]["all_first_tokens_s"],
        "admission_ttft_speedup": res["ttft_admit_ms_off"] / res["ttft_admit_ms_on"],
        "decode_on_vs_off": res["on"]["decode_tokens_per_s"] / off["decode_tokens_per_s"],
        "decode_warm_vs_off": res["warm"]["decode_tokens_per_s"] / off["decode_tokens_per_s"],
        "hit_rate_on": res["on"]["prefix_stats"]["this_run"]["hit_tokens"]
        / max(res["on"]["prefix_stats"]["this_run"]["prompt_tokens"], 1),
        "tokens_equal_on": sum(x == y for x, y in zip(off["tokens"], res["on"]["tokens"])),
        "tokens_equal_warm": sum(x == y for x, y in zip(off["tokens"], res["warm"]["tokens"])), "of": a.requests,
        "prefill_calls": {k: res[k]["prefill_calls"]["calls"] for k in ("off", "on", "warm")},
        "prefill_mean_rows_per_call": {k: round(res[k]["prefill_calls"]["mean_rows_per_call"], 2)
                                       for k in ("off", "on", "warm")}})
    if a.turn2:
        t0 = time.perf_counter()
        turn2_runs(a, res, sess, prefix, ps, dev, V)
        stage("turn2", t0)
    if a.paged:
        del sess, prefix
        if dev.type == "cuda":
            torch.cuda.empty_cache()
        shutil.rmtree(art)  # the slot artifact's results are in; checkpoint + two slice artifacts overfill a 64 GB disk
        paged_runs(a, res, ckpt, ps, dev, V, stage)
    print(json.dumps(res["summary"], indent=1))
    a.out.write_text(json.dumps(res, indent=1, default=str))
    return 0


def _prefill_graphs_info(sess) -> dict:
    """The Session's prefill CUDA graphs (runtime/prefill_graphs.py): shapes and capture stats, or why off."""
    pg = sess.prefill_graphs
    if pg is None:
        return {"on": False, "why_off": getattr(sess, "prefill_graphs_off", None)}
    return {"on": True, "shapes": len(pg.shapes), **pg.stats}


def turn2_runs(a, res: dict, sess, prefix, ps, dev, V: int) -> None:
    """The second turn (module docstring): prompt + its `warm` answer + U2 new tokens, cache on then off."""
    g = torch.Generator().manual_seed(7)
    ps2 = [p + t + torch.randint(2, V, (a.turn2_suffix,), generator=g).tolist()
           for p, t in zip(ps, res["warm"]["tokens"])]
    res["turn2_on"] = run(sess, ps2, a.new, dev, prefix, a.mtp)
    res["turn2_off"] = run(sess, ps2, a.new, dev, None, a.mtp)
    sess.prefix = prefix
    on, off = res["turn2_on"], res["turn2_off"]
    this = on["prefix_stats"]["this_run"]
    res["summary"].update({
        "turn2_ttft_speedup": off["ttft_submit_ms_mean"] / on["ttft_submit_ms_mean"],
        "turn2_hit_tokens_per_request": this["hit_tokens"] / a.requests,
        "turn2_prompt_tokens_per_request": this["prompt_tokens"] / a.requests,
        "turn2_tokens_equal": sum(x == y for x, y in zip(off["tokens"], on["tokens"]))})
    print(f"turn2: TTFT {off['ttft_submit_ms_mean']:.1f} -> {on['ttft_submit_ms_mean']:.1f} ms, "
          f"{res['summary']['turn2_hit_tokens_per_request']:.0f} of "
          f"{res['summary']['turn2_prompt_tokens_per_request']:.0f} prompt tokens from the cache", flush=True)


def paged_runs(a, res: dict, ckpt: Path, ps, dev, V: int, stage) -> None:
    """Compile with --paged (same limits and buckets), then paged_off / paged_on / paged_warm."""
    from dsv4c.runtime import Session

    t0 = time.perf_counter()
    art = a.work / "art_paged"
    max_tokens = max_tokens_of(a)
    cmd = dsv4c("compile", str(ckpt), "--target", a.target, "-o", str(art), "--force", "--max-batch", str(a.requests),
                "--max-tokens", str(max_tokens), "--buckets", str(a.requests), *mtp_flags(a), "--paged",
                *(["--pool-blocks", str(a.pool_blocks)] if a.pool_blocks else []))
    res["compile_command_paged"] = " ".join(cmd[2:])
    _run(cmd, a.work / "compile_paged.log")
    stage("compile_paged", t0)
    t0 = time.perf_counter()
    sess = Session.load(art, device=dev, graphs="full" if dev.type == "cuda" else "off", warm_up=True,
                        prefill_graphs=a.prefill_graphs)
    res["paged_pool"] = sess.cache_info["paged"]
    res["paged_cache_bytes"] = sess.cache_info["main"]["bytes"]
    res["paged_load_warm_up_s"] = sess.warmup_s
    res["paged_executor_modes"] = {k: getattr(ex, "mode", None) for k, ex in sess.executors.items()}
    res["paged_prefill_graphs"] = _prefill_graphs_info(sess)
    sess.prefix.share = False
    sess.generate(prompts(V, 2, a.suffix, 3, seed=99), max_new_tokens=3)  # warm-up: kernels, graph capture
    stage("load_and_warmup_paged", t0)
    runs = (("paged_off", False),) * a.paged_off + (("paged_on", True), ("paged_warm", True))
    for name, share in runs:
        t0 = time.perf_counter()
        res[name] = run_paged(sess, ps, a.new, dev, share, a.mtp)
        r = res[name]
        print(f"{name}: TTFT mean {r['ttft_submit_ms_mean']:.1f} ms, all first tokens {r['all_first_tokens_s']:.2f} s, "
              f"decode {r['decode_tokens_per_s']:.0f} tok/s, {r['prefill_calls']['calls']} prefill calls "
              f"({r['prefill_calls']['mean_rows_per_call']:.1f} rows each)", flush=True)
        stage(name, t0)
    if a.profile_prefill:
        t0 = time.perf_counter()
        pool = sess.prefix
        res["paged_prefill_profile"] = prefill_profile(sess, lambda c: setattr(pool, "share", c), ps, a.suffix, dev)
        stage("paged_prefill_profile", t0)
    off, summ = res["off"], res["summary"]
    summ.update({
        "paged_on_decode_vs_slot_on": res["paged_on"]["decode_tokens_per_s"] / res["on"]["decode_tokens_per_s"],
        "paged_warm_decode_vs_slot_warm": res["paged_warm"]["decode_tokens_per_s"] / res["warm"]["decode_tokens_per_s"],
        "paged_on_ttft_speedup_vs_slot_off": off["ttft_submit_ms_mean"] / res["paged_on"]["ttft_submit_ms_mean"],
        "paged_warm_ttft_speedup_vs_slot_off": off["ttft_submit_ms_mean"] / res["paged_warm"]["ttft_submit_ms_mean"],
        "paged_peak_blocks_in_use": sess.prefix.stats()["peak_blocks_in_use"],
        "paged_pool_blocks": sess.prefix.n_blocks,
        "paged_cache_bytes_vs_slot": res["paged_cache_bytes"] / res["slot_cache_bytes"]})
    for name, _ in runs:
        summ["prefill_calls"][name] = res[name]["prefill_calls"]["calls"]
        summ["prefill_mean_rows_per_call"][name] = round(res[name]["prefill_calls"]["mean_rows_per_call"], 2)
    checks = [("paged_on", "off"), ("paged_on", "on"), ("paged_warm", "off")]
    if a.paged_off:
        summ["paged_off_decode_vs_slot_off"] = res["paged_off"]["decode_tokens_per_s"] / off["decode_tokens_per_s"]
        summ["paged_off_ttft_speedup_vs_paged_on"] = (res["paged_off"]["ttft_submit_ms_mean"]
                                                      / res["paged_on"]["ttft_submit_ms_mean"])
        checks.insert(0, ("paged_off", "off"))
    for x, y in checks:
        same = sum(p == q for p, q in zip(res[x]["tokens"], res[y]["tokens"]))
        summ[f"tokens_equal_{x}_vs_{y}"] = same
        print(f"tokens identical, {x} vs slot {y}: {same}/{len(ps)}", flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
