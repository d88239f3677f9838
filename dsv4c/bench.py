"""`dsv4c bench ART`: throughput and latency of a compiled artifact in a `Session`.

For each batch size B it generates from B seeded random prompts of `prompt_len` tokens, greedy,
`output_len` new tokens each, and times every graph call the Session makes (prefill chunks, decode
steps; verify/MTP rounds with --mtp). Decode step latency percentiles come from those timings;
throughput is generated tokens per second of decode time. With CUDA, prefill calls are timed one by one
with CUDA events from an idle GPU, and a decode step is the interval between consecutive decode steps'
ends on the GPU (greedy steps are queued back to back; see _Timer).
"""
from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import torch


def _percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    if not xs:
        return float("nan")
    i = min(len(xs) - 1, max(0, round(q / 100 * (len(xs) - 1))))
    return xs[i]


class _Timer:
    """Wraps Session._run: records (graph kind, rows, seconds) per call.

    Prefill calls (and every call on a CPU) are timed one at a time, from an idle GPU (CUDA events: the
    call's host work before its first kernel counts, the host's wait for the result does not). Decode
    calls are not synchronised, since greedy decoding keeps the next step queued behind the current
    one (session._Scheduler._decode_step): a decode step's time is the interval between its end and the
    previous decode step's end on the GPU (the first step after a prefill: from its own start). That is the
    time per step a steady decode loop achieves, host work included where the GPU waits for it."""

    def __init__(self, sess):
        self.sess, self.calls = sess, []
        self._run = sess._run
        self.cuda = sess.device.type == "cuda"
        self._decode: list = []  # (kind, rows, start event, end event) | None (a prefill broke the chain)

    def __call__(self, kind, ids, slots, n_real, **kw):
        if not self.cuda:
            t0 = time.perf_counter()
            out = self._run(kind, ids, slots, n_real, **kw)
            self.calls.append((kind, len(slots), time.perf_counter() - t0))
            return out
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        stream = torch.cuda.current_stream(self.sess.device)
        if kind == "prefill":
            torch.cuda.synchronize(self.sess.device)
            a.record(stream)
            out = self._run(kind, ids, slots, n_real, **kw)
            b.record(stream)
            b.synchronize()
            self.calls.append((kind, len(slots), a.elapsed_time(b) / 1e3))
            self._decode.append(None)
            return out
        a.record(stream)
        out = self._run(kind, ids, slots, n_real, **kw)
        b.record(stream)
        self._decode.append((kind, len(slots), a, b))
        return out

    def finish(self) -> None:
        """Turn the decode calls' events into times (after the generate call returned)."""
        if self.cuda:
            torch.cuda.synchronize(self.sess.device)
        prev = None
        for item in self._decode:
            if item is None:
                prev = None
                continue
            kind, rows, a, b = item
            self.calls.append((kind, rows, (a if prev is None else prev).elapsed_time(b) / 1e3))
            prev = b
        self._decode.clear()

    def clear(self) -> None:
        self.finish()
        self.calls.clear()


def side_streams(sess) -> dict[str, int]:
    """Per fixed-shape graph, the MoE layers whose shared expert runs on the side stream
    (passes/overlap_shared_experts.py)."""
    from dsv4c.passes.overlap_shared_experts import SideStream

    return {k: sum(isinstance(m, SideStream) for _, m in e.gm.named_modules())
            for k, e in getattr(sess, "executors", {}).items()}


def bench_artifact(art: str | Path, batches: list[int], prompt_len: int, output_len: int, device: str = "cpu",
                   graphs: str | None = None, emulate: bool = False, mtp=0, seed: int = 0,
                   warmup: bool = True, deterministic: bool = False,
                   max_num_batched_tokens: int | None = None, side_stream: bool = True) -> dict:
    from dsv4c.runtime import Session
    from dsv4c.runtime.speculative import merge_spec_stats

    t0 = time.perf_counter()
    # prefix caching off: a warm-up prompt served again from cached blocks would not time its prefill
    sess = Session.load(art, device=device, emulate=emulate, graphs=graphs, prefix_cache=False,
                        deterministic=deterministic, max_num_batched_tokens=max_num_batched_tokens,
                        side_stream=side_stream)
    load_s = time.perf_counter() - t0
    V = sess.config.vocab_size
    if prompt_len + output_len > sess.max_tokens:
        raise ValueError(f"--prompt-len {prompt_len} + --output-len {output_len} exceeds the artifact's "
                         f"max_tokens={sess.max_tokens}")
    too_big = [b for b in batches if b > sess.max_batch]
    if too_big:
        raise ValueError(f"--batch {too_big}: the artifact serves at most max_batch={sess.max_batch} sequences")
    timer = _Timer(sess)
    sess._run = timer
    g = torch.Generator().manual_seed(seed)
    rows = []
    for B in batches:
        prompts = [torch.randint(0, V, (prompt_len,), generator=g).tolist() for _ in range(B)]
        if warmup:  # captures the graphs of this bucket, fills allocator caches
            sess.generate(prompts, max_new_tokens=2, mtp=mtp)
        timer.clear()
        t1 = time.perf_counter()
        res = sess.generate(prompts, max_new_tokens=output_len, mtp=mtp)
        wall = time.perf_counter() - t1
        timer.finish()
        steps = [s for k, _, s in timer.calls if k != "prefill"]
        prefill = [s for k, _, s in timer.calls if k == "prefill"]
        gen = sum(len(r.tokens) for r in res)
        decode_s = sum(steps)
        row = {"batch": B, "prompt_len": prompt_len, "output_len": output_len, "wall_s": wall,
               "prefill_s": sum(prefill), "prefill_tokens_per_s": B * prompt_len / max(sum(prefill), 1e-12),
               "prefill_calls": len(prefill), "max_num_batched_tokens": sess.max_num_batched_tokens,
               "decode_s": decode_s, "decode_steps": len(steps),
               "decode_tokens_per_s": (gen - B) / max(decode_s, 1e-12),  # the first token comes from prefill
               "step_ms_p50": _percentile(steps, 50) * 1e3, "step_ms_p90": _percentile(steps, 90) * 1e3,
               "step_ms_p99": _percentile(steps, 99) * 1e3,
               "ttft_ms_p50": statistics.median(r.stats["ttft_s"] for r in res) * 1e3,
               "accepted_draft_tokens": sum(r.stats.get("accepted_draft_tokens", 0) for r in res)}
        spec = merge_spec_stats([r.stats for r in res])
        if spec is not None:  # MTP: acceptance per draft position, mean accepted length, histogram
            row["speculation"] = spec
        rows.append(row)
    ex = {k: e.stats for k, e in getattr(sess, "executors", {}).items()}
    return {"artifact": str(art), "device": device, "graphs": graphs or "default", "mtp": mtp, "load_s": load_s,
            "target": sess.manifest["target"]["name"], "rows": rows, "side_stream": side_streams(sess),
            "executors": {k: {n: v for n, v in s.items() if n != "buckets"} for k, s in ex.items()}}


def format_table(res: dict) -> str:
    lines = [f"artifact {res['artifact']} (target {res['target']}) on {res['device']}, graphs {res['graphs']}, "
             f"mtp {res['mtp']}; load {res['load_s']:.1f}s; shared experts on a side stream: "
             f"{sum(res.get('side_stream', {}).values())} layer(s)",
             "| batch | prefill tok/s | decode tok/s | step p50 ms | p90 | p99 | TTFT p50 ms |",
             "|---:|---:|---:|---:|---:|---:|---:|"]
    for r in res["rows"]:
        lines.append(f"| {r['batch']} | {r['prefill_tokens_per_s']:.0f} | {r['decode_tokens_per_s']:.1f} | "
                     f"{r['step_ms_p50']:.2f} | {r['step_ms_p90']:.2f} | {r['step_ms_p99']:.2f} | "
                     f"{r['ttft_ms_p50']:.1f} |")
    spec = [(r["batch"], r["speculation"]) for r in res["rows"] if "speculation" in r]
    if spec:
        lines += ["", "| batch | k | acceptance per draft position | mean accepted length | histogram (rounds by "
                  "accepted drafts) |", "|---:|---:|---|---:|---|"]
        for b, st in spec:
            alpha = ", ".join("-" if a is None else f"{a:.2f}" for a in st["acceptance_per_position"])
            tau = st["mean_accepted_length"]
            lines.append(f"| {b} | {st['mtp_k']} | {alpha} | {'-' if tau is None else f'{tau:.2f}'} | "
                         f"{st['accept_histogram']} |")
    return "\n".join(lines)


def write_json(res: dict, path: str | Path) -> None:
    Path(path).write_text(json.dumps(res, indent=1, default=str) + "\n")
