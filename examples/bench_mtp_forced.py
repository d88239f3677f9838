"""MTP with teacher-forced drafts: the end-to-end speedup over pipelined k = 0 at a controlled
acceptance α, beside the bound the byte roofline allows at that α (issue 23).

Random weights accept no MTP drafts, so on the slice MTP could only ever show its cost. Here the drafts
come from a known continuation: each request's k = 0 greedy output (generated first, in the same run),
each draft kept with probability α and otherwise replaced by a wrong token
(`dsv4c.runtime.speculative.ForcedDrafts`). The greedy target equals the continuation, so draft j is
accepted exactly when it was kept: α_j = α at every position, τ = (1 - α^(k+1)) / (1 - α) tokens per
round. The MTP draft calls still run (their cost is part of a round); only their tokens are replaced.
In bf16 the verify's argmax can differ from the decode's at a near tie; the continuation then
diverges and the drafts stop matching. The measured acceptance is reported beside the requested α
(and `equal_to_k0`), so such a cell shows itself.

Byte roofline of a round (memory-bound decode: time ∝ the bytes a step must read), from the config
and the artifact's formats (h200: FP8 routed experts and dense linears, 1 byte a parameter; the head
and embedding bf16):

  decode(B)      = dense + head + Σ_layers U(B) · expert + kv(B)
  verify(B, T)   = dense + head + Σ_layers U(B·T) · expert + kv(B)          (T = 1 + k tokens a row)
  mtp(B, T)      = mtp_dense + head + U(B·T) · mtp_expert + mtp_kv(B)
  round(B, k)    = verify(B, 1+k) + mtp(B, 1+k) + (k - 1) · mtp(B, 1)       (fused verify+refresh, k-1 drafts)
  bound(α, k, B) = τ(α, k) · decode(B) / round(B, k)

U(N) = E · (1 - (1 - top_k/E)^N) is the expected number of unique routed experts N tokens touch under
uniform routing (hash layers route by token id: uniform too for these tokens). kv(B) reads each
sequence's window and compressed entries once per step: the 1 + k query rows of a sequence share
them. Weights read once per graph call whatever the batch. `bound_compiled` is the same bound with
the verify and draft graphs as compiled: T = 1 + K rows per sequence in every call (k < K rows pad).

    # bundled trained model: compile once (about 2 min: five torch.exports), then the grid (reuses WORK/art)
    python examples/bench_mtp_forced.py --bundled --work build/forced_bundled --compile-batches 1,8,32,64 --compile-only
    python examples/bench_mtp_forced.py --bundled --work build/forced_bundled --compile-batches 1,8,32,64 \
        --batches 1,8 --budget-s 200 --out $OUT/forced_bundled_1_8.json
    # the v4-flash-slice: built on the GPU, written (release formats), compiled for h200 with --mtp 3
    python examples/bench_mtp_forced.py --slice build/forced_slice --compile-batches 1,8,32,64 --compile-only
    python examples/bench_mtp_forced.py --slice build/forced_slice --compile-batches 1,8,32,64 \
        --batches 1,8 --budget-s 200 --out $OUT/forced_slice_1_8.json
    # the same with the verify's argmax equal to the decode's (bf16 near-ties otherwise end the forced drafts)
    python examples/bench_mtp_forced.py --bundled --deterministic --work build/forced_bundled --batches 1,8
    python examples/bench_mtp_forced.py --slice build/forced_slice --deterministic --expert-format mxfp4_w4a16 \
        --batches 1,8,32,64
    python examples/bench_mtp_forced.py --bundled --device cpu --quick          # CPU smoke run
    python examples/bench_mtp_forced.py --roofline-only v4-flash                # the bound grid only

Where a run's time goes (the JSON's `timings`): the compile is five torch.exports (prefill, decode,
verify, mtp, verify_mtp: ~110 s for the bundled model on the H200 host), so an artifact is compiled
once under WORK and reused by every later run whose batches its buckets cover. A graph's first call
captures every bucket of the artifact (and compiles the Triton specialisations of each), so a run
captures only the buckets it measures (`only_buckets`): compile with all the batches, measure any
subset. The JSON is rewritten after every cell (`complete` false until the grid ends), and with
`--budget-s` no cell starts after that many seconds, so a device-call timeout keeps every measured cell.

Decode throughput counts generated tokens after each request's first one, from the moment every
request of the batch has its first token to the end (prefill and the MTP fill excluded), as
examples/bench_mtp.py does.

Legend: B batch, k drafts per round, K the artifact's --mtp, E routed experts, U unique experts.
"""
from __future__ import annotations

import argparse
import gc
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_mtp import BUNDLE, PROMPTS  # noqa: E402

from dsv4c.config import ModelConfig  # noqa: E402
from dsv4c.runtime.speculative import ForcedDrafts, merge_spec_stats, speculator  # noqa: E402


# ------------------------------------------------------------------------------------------------
# the byte roofline
# ------------------------------------------------------------------------------------------------
def param_groups(cfg: ModelConfig) -> dict[str, int]:
    """Parameter counts: main dense, main routed experts, MTP dense, MTP routed experts, head, embed."""
    from dsv4c.model import build_model

    out = dict.fromkeys(("dense", "experts", "mtp_dense", "mtp_experts", "head", "embed"), 0)
    for name, p in build_model(cfg, device="meta").named_parameters():
        mtp = name.startswith("mtp.")
        if ".ffn.experts." in name:
            out["mtp_experts" if mtp else "experts"] += p.numel()
        elif name.startswith("head."):
            out["head"] += p.numel()
        elif name.startswith("embed."):
            out["embed"] += p.numel()
        else:
            out["mtp_dense" if mtp else "dense"] += p.numel()
    return out


def _bytes_per_param(fmt: str) -> float:
    return {"fp8_block": 1.0, "mxfp4_w4a16": 17 / 32, "nvfp4_w4a16": 9 / 16, "nvfp4_w4a4": 9 / 16}.get(fmt, 2.0)


def unique_experts(E: int, top: int, n_tokens: int) -> float:
    return E * (1 - (1 - top / E) ** n_tokens)


class Roofline:
    """Bytes of decode / verify / MTP calls (module docstring) for one config, formats and context."""

    def __init__(self, cfg: ModelConfig, expert_format: str, dense_format: str, ctx_len: int):
        self.cfg, self.ctx = cfg, ctx_len
        g = param_groups(cfg)
        eb, db = _bytes_per_param(expert_format), _bytes_per_param(dense_format)
        L, E = cfg.num_hidden_layers, cfg.n_routed_experts
        self.dense, self.mtp_dense = g["dense"] * db, g["mtp_dense"] * db
        self.expert = g["experts"] * eb / (L * E)  # one expert of one layer
        self.mtp_expert = g["mtp_experts"] * eb / E
        self.head = g["head"] * 2
        self.L, self.E, self.top = L, E, cfg.num_experts_per_tok

    def kv(self, B: int, mtp: bool = False) -> float:
        cfg, n, el = self.cfg, self.ctx, 2
        d = cfg.head_dim
        layers = [cfg.compress_ratios[cfg.num_hidden_layers]] if mtp else cfg.compress_ratios[:cfg.num_hidden_layers]
        total = 0
        for m in layers:
            total += min(n, cfg.sliding_window) * d * el
            if m == 4:
                total += min(n // 4, cfg.index_topk) * d * el + (n // 4) * cfg.index_head_dim * el
            elif m:
                total += (n // m) * d * el
        return B * total

    def decode(self, B: int) -> float:
        return self.verify(B, 1)

    def verify(self, B: int, T: int) -> float:
        return (self.dense + self.head + self.L * unique_experts(self.E, self.top, B * T) * self.expert
                + self.kv(B) + B * T * self.cfg.hidden_size * 2)

    def mtp(self, B: int, T: int) -> float:
        return (self.mtp_dense + self.head + unique_experts(self.E, self.top, B * T) * self.mtp_expert
                + self.kv(B, mtp=True) + B * T * self.cfg.hidden_size * 2)

    def round(self, B: int, k: int, T_graph: int | None = None) -> float:
        T = T_graph or 1 + k
        return self.verify(B, T) + self.mtp(B, T) + (k - 1) * self.mtp(B, T_graph or 1)

    def bound(self, alpha: float, k: int, B: int, T_graph: int | None = None) -> float:
        return tau(alpha, k) * self.decode(B) / self.round(B, k, T_graph)


def tau(alpha: float, k: int) -> float:
    """Expected tokens per round with i.i.d. acceptance α per draft."""
    return sum(alpha ** j for j in range(k + 1))


# ------------------------------------------------------------------------------------------------
# measuring
# ------------------------------------------------------------------------------------------------
def timed(sess, prompts: list, n_new: int, mtp: int) -> dict:
    """One batch through the Session; decode tokens/s (module docstring), outputs and merged stats."""
    reqs = sess._requests(prompts, n_new, 0.0, 1.0, 0, 1, [])
    firsts: set[int] = set()
    t_first = None
    t0 = time.perf_counter()
    for i, _ in sess._serve(reqs, mtp):
        if i not in firsts:
            firsts.add(i)
            if len(firsts) == len(prompts):
                _sync(sess.device)
                t_first = time.perf_counter()
    _sync(sess.device)
    t_end = time.perf_counter()
    n_tok = sum(len(r.out) - 1 for r in reqs)
    res = [sess._result(r) for r in reqs]
    return {"tokens_per_s": n_tok / max(t_end - (t_first or t0), 1e-9), "decode_s": t_end - (t_first or t0),
            "outputs": [r.out for r in reqs], "stats": merge_spec_stats([r.stats for r in res]) if mtp else None}


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def make_prompts(sess, B: int, prompt_len: int, bundled: bool) -> list:
    if bundled:
        return [PROMPTS[i % len(PROMPTS)] for i in range(B)]
    g = torch.Generator().manual_seed(B)
    return [torch.randint(2, sess.config.vocab_size, (prompt_len,), generator=g).tolist() for _ in range(B)]


def run_grid(sess, batches, alphas, ks, n_new: int, prompt_len: int, bundled: bool, log=print,
             on_row=None, deadline: float | None = None, timings: dict | None = None) -> list[dict]:
    """The grid, batch by batch (ascending), α then k within a batch. `on_row(rows)` after every cell
    (the caller writes its JSON there, so a timeout keeps what was measured); no cell starts after
    `deadline` (time.perf_counter()); `timings` gets each batch's warm-up seconds (its first calls:
    CUDA-graph captures and Triton compiles) and its measuring seconds."""
    spec = speculator(sess)
    m = sess.manifest
    K = int(m["mtp_k"])
    roof = Roofline(sess.config, m["target"]["expert_format"], m["target"]["dense_format"], prompt_len + n_new // 2)
    rows: list[dict] = []
    timings = {} if timings is None else timings

    def late() -> bool:
        return deadline is not None and time.perf_counter() > deadline

    for B in sorted(batches):
        if late():
            log(json.dumps({"skipped_batch": B, "reason": "time budget"}))
            continue
        prompts = make_prompts(sess, B, prompt_len, bundled)
        t0 = time.perf_counter()
        for k in [0] + list(ks):  # warm-up: every graph's first call at this bucket, as long as a timed call
            timed(sess, prompts, n_new, k)  # (a 4-token call ends in its first round: no pipelined round graph)
        ids = [sess._encode(p) for p in prompts]
        for k in ks:  # and the forced rounds' own round graphs (the truth here: the prompts alone)
            spec.forced = ForcedDrafts(dict(enumerate(ids)), 0.5, seed=17)
            try:
                timed(sess, prompts, n_new, k)
            finally:
                spec.forced = None
        t1 = time.perf_counter()
        timings[f"warmup_s_batch_{B}"] = round(t1 - t0, 2)
        base = timed(sess, prompts, n_new, 0)
        truth = {i: ids[i] + out for i, out in enumerate(base["outputs"])}
        log(json.dumps({"batch": B, "k": 0, "tokens_per_s": round(base["tokens_per_s"], 1)}))
        for alpha in alphas:
            for k in ks:
                if late():
                    log(json.dumps({"skipped": {"batch": B, "alpha": alpha, "k": k}, "reason": "time budget"}))
                    continue
                spec.forced = ForcedDrafts(truth, alpha, seed=17)
                try:
                    cell = timed(sess, prompts, n_new, k)
                finally:
                    spec.forced = None
                st = cell["stats"]
                acc = [a for a in st["acceptance_per_position"] if a is not None]
                speed = cell["tokens_per_s"] / base["tokens_per_s"]
                bound = roof.bound(alpha, k, B)
                row = {"batch": B, "alpha": alpha, "k": k, "tokens_per_s": round(cell["tokens_per_s"], 1),
                       "k0_tokens_per_s": round(base["tokens_per_s"], 1), "speedup": round(speed, 3),
                       "bound": round(bound, 3), "of_bound": round(speed / bound, 3),
                       "bound_compiled": round(roof.bound(alpha, k, B, T_graph=1 + K), 3),
                       "measured_alpha": [round(a, 3) for a in acc],
                       "tau_requested": round(tau(alpha, k), 3),
                       "tau_measured": round(st["mean_accepted_length"], 3) if st["mean_accepted_length"] else None,
                       "equal_to_k0": cell["outputs"] == base["outputs"]}
                rows.append(row)
                log(json.dumps(row))
                if on_row is not None:
                    on_row(rows)
        timings[f"measure_s_batch_{B}"] = round(time.perf_counter() - t1, 2)
    return rows


def table(rows: list[dict], title: str) -> str:
    out = [title, "", "| batch | α | k | tok/s (k=0) | speedup | roofline bound | of bound | bound as compiled (T=1+K) "
           "| α measured | τ req / meas | == k0 |", "|---:|---:|---:|---:|---:|---:|---:|---:|---|---|---|"]
    for r in rows:
        out.append(f"| {r['batch']} | {r['alpha']} | {r['k']} | {r['tokens_per_s']:.0f} ({r['k0_tokens_per_s']:.0f}) | "
                   f"{r['speedup']:.2f}x | {r['bound']:.2f}x | {100 * r['of_bound']:.0f}% | "
                   f"{r['bound_compiled']:.2f}x | "
                   f"{', '.join(f'{a:.2f}' for a in r['measured_alpha'])} | {r['tau_requested']:.2f} / "
                   f"{r['tau_measured']} | {r['equal_to_k0']} |")
    return "\n".join(out)


def bound_table(cfg: ModelConfig, batches, alphas, ks, K: int, ctx_len: int) -> str:
    """The roofline bound grid of a config with the h200 formats (FP8 experts and dense)."""
    roof = Roofline(cfg, "fp8_block", "fp8_block", ctx_len)
    out = [f"byte-roofline bound of MTP with teacher-forced drafts, {cfg.model_type} "
           f"({cfg.num_hidden_layers} layers), h200 formats; in brackets: graphs of T = 1 + {K} rows", "",
           "| batch | decode GB | " + " | ".join(f"α {a} k {k}" for a in alphas for k in ks) + " |",
           "|---:|---:|" + "---:|" * (len(alphas) * len(ks))]
    for B in batches:
        cells = [f"{roof.bound(a, k, B):.2f}x ({roof.bound(a, k, B, 1 + K):.2f}x)" for a in alphas for k in ks]
        out.append(f"| {B} | {roof.decode(B) / 1e9:.2f} | " + " | ".join(cells) + " |")
    return "\n".join(out)


# ------------------------------------------------------------------------------------------------
# artifacts
# ------------------------------------------------------------------------------------------------
def _art_dir(work: Path, deterministic: bool, expert_format: str | None) -> Path:
    return work / ("art" + ("_det" if deterministic else "") + (f"_{expert_format}" if expert_format else ""))


def compile_bundled(work: Path, device: str, K: int, batches: list[int], max_tokens: int, log=print,
                    deterministic: bool = False, expert_format: str | None = None) -> Path:
    """The bundled trained model compiled for the device's target with --mtp K and buckets = the
    batches (reused when `work/art` exists and covers them). Only the buckets the grid runs: every
    bucket of every graph is captured (and its Triton kernels compiled) at the graph's first call."""
    from dsv4c.compile import compile_checkpoint

    art = _art_dir(work, deterministic, expert_format)
    if _reusable(art, K, batches, max_tokens, log, deterministic, expert_format):
        return art
    t0 = time.perf_counter()
    compile_checkpoint(BUNDLE, art, target="h200" if device.startswith("cuda") else "cpu", max_tokens=max_tokens,
                       max_batch=max(max(batches), 2), buckets=tuple(sorted(batches)), mtp_k=K, progress=True,
                       verify_boundaries=False, force=True, deterministic=deterministic, expert_format=expert_format)
    log(f"bundled model compiled (--mtp {K}, buckets {sorted(batches)}) in {time.perf_counter() - t0:.0f}s")
    return art


def _reusable(art: Path, K: int, batches: list[int], max_tokens: int, log=print, deterministic: bool = False,
              expert_format: str | None = None) -> bool:
    """Whether the artifact at `art` was compiled with --mtp K, buckets covering `batches`, room for
    `max_tokens` (and `expert_format` when given); one that exists but does not fit is named and recompiled."""
    f = art / "manifest.json"
    if not f.is_file():
        return False
    m = json.loads(f.read_text())
    ok = (int(m.get("mtp_k", 0)) == K and set(batches) <= set(m.get("buckets") or ())
          and m["limits"]["max_tokens"] >= max_tokens and bool(m.get("deterministic")) == deterministic
          and expert_format in (None, m["target"]["expert_format"]))
    if not ok:
        log(f"{art}: compiled with --mtp {m.get('mtp_k')}, buckets {m.get('buckets')}, max_tokens "
            f"{m['limits']['max_tokens']}; this run needs --mtp {K}, buckets {sorted(batches)}, {max_tokens}: "
            f"recompiling")
    return ok


def compile_slice(work: Path, K: int, batches: list[int], max_tokens: int, log=print,
                  deterministic: bool = False, expert_format: str | None = None) -> Path:
    """The v4-flash-slice built on the GPU (seeded random), written in the release formats, compiled
    for h200 with --mtp K (and --deterministic, --expert-format), buckets = the batches (reused when
    `_art_dir` holds a fitting one)."""
    from dsv4c.checkpoint import save_checkpoint
    from dsv4c.compile import compile_checkpoint
    from dsv4c.model import build_model

    art = _art_dir(work, deterministic, expert_format)
    if _reusable(art, K, batches, max_tokens, log, deterministic, expert_format):
        return art
    ckpt, done = work / "ckpt", work / "ckpt.complete"
    if not done.is_file():  # a call that timed out after writing the checkpoint leaves the marker: reused
        t0 = time.perf_counter()
        model = build_model(ModelConfig.preset("v4-flash-slice"), "cuda", torch.bfloat16, on_device=True)
        save_checkpoint(model, ckpt, quant="release", overwrite=True, progress=False)
        del model
        gc.collect()
        torch.cuda.empty_cache()
        done.write_text("save_checkpoint finished\n")
        log(f"slice checkpoint written in {time.perf_counter() - t0:.0f}s")
    t0 = time.perf_counter()
    compile_checkpoint(ckpt, art, target="h200", max_tokens=max_tokens, max_batch=max(batches), buckets=tuple(batches),
                       mtp_k=K, progress=True, verify_boundaries=False, force=True, deterministic=deterministic,
                       expert_format=expert_format)
    log(f"slice compiled (h200, --mtp {K}{', deterministic' if deterministic else ''}) in "
        f"{time.perf_counter() - t0:.0f}s")
    shutil.rmtree(ckpt)  # 20 GB: the artifact (~35 GB) is all the run needs, and the device disk is 64 GiB
    done.unlink()
    return art


def only_buckets(sess, batches: list[int]) -> None:
    """Capture only the buckets the grid runs: every executor's first call captures all of its buckets
    (and compiles their Triton specialisations), so an artifact compiled for 1,8,32,64 run at 1,8
    would otherwise pay for 32 and 64 too. Called before any graph runs."""
    for ex in sess.executors.values():
        keep = tuple(b for b in ex.buckets if b in set(batches))
        if keep:
            ex.buckets = keep


def main(argv=None) -> int:
    t_start = time.perf_counter()
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--art", help="an artifact compiled with --mtp K")
    src.add_argument("--bundled", action="store_true", help="compile the bundled trained model (--mtp K)")
    src.add_argument("--slice", type=Path, metavar="WORK", help="build + compile the v4-flash-slice under WORK")
    src.add_argument("--roofline-only", metavar="PRESET", help="print the bound grid of a preset (no GPU) and exit")
    ap.add_argument("--work", type=Path, help="with --bundled: compile under WORK/art and reuse it (default: a "
                                              "temporary folder)")
    ap.add_argument("--compile-only", action="store_true", help="with --slice / --bundled --work: stop after compiling")
    ap.add_argument("--compile-batches", default=None,
                    help="buckets to compile (default --batches); later runs may measure any subset")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--k", type=int, default=3, help="K to compile with")
    ap.add_argument("--batches", default="1,8,32,64")
    ap.add_argument("--alphas", default="0.6,0.8,0.9")
    ap.add_argument("--ks", default="1,2,3")
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--prompt-len", type=int, default=16, help="random prompt tokens (slice / --art)")
    ap.add_argument("--budget-s", type=float, default=None,
                    help="start no cell after this many seconds from the start (the JSON says what was skipped)")
    ap.add_argument("--quick", action="store_true", help="CPU smoke run: batches 1,2, α 0.8, k 1,2, 8 tokens")
    ap.add_argument("--deterministic", action="store_true",
                    help="with --bundled or --slice: compile and load in deterministic mode, so the verify's argmax "
                         "equals the k = 0 decode's and the measured α is the requested one in bf16 too")
    ap.add_argument("--expert-format", default=None, choices=("fp8_block", "mxfp4_w4a16", "nvfp4_w4a16"),
                    help="with --bundled or --slice: compile --expert-format (with --deterministic: mxfp4_w4a16 or "
                         "nvfp4_w4a16 keep the experts' stored bytes, where the default widens them to bf16: the "
                         "slice's deterministic artifact then fits the device's disk)")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args(argv)
    if a.quick:
        a.batches, a.alphas, a.ks, a.new_tokens = "1,2", "0.8", "1,2", 8
    batches = [int(x) for x in a.batches.split(",")]
    compile_batches = sorted(set(int(x) for x in a.compile_batches.split(","))) if a.compile_batches else batches
    alphas = [float(x) for x in a.alphas.split(",")]
    ks = [int(x) for x in a.ks.split(",")]
    if a.roofline_only:
        ctx_len = a.prompt_len + a.new_tokens // 2
        print(bound_table(ModelConfig.resolve(a.roofline_only), batches, alphas, ks, a.k, ctx_len))
        return 0
    if a.expert_format and a.art:
        ap.error("--expert-format: with --bundled or --slice (an --art artifact's formats are fixed)")
    if a.deterministic and a.art:
        ap.error("--deterministic: with --bundled or --slice (an --art artifact's compile is fixed; the Session "
                 "loads it as compiled)")
    if not set(batches) <= set(compile_batches):
        ap.error(f"--batches {batches} must be among --compile-batches {compile_batches}")
    max_tokens = max(a.prompt_len, 64) + a.new_tokens + 4 * a.k + 8
    log = lambda s: print(s, file=sys.stderr, flush=True)  # noqa: E731
    from dsv4c.runtime import Session

    tmp, timings = None, {}
    t0 = time.perf_counter()
    if a.art:
        art = Path(a.art)
    elif a.bundled:
        if a.work is None:
            tmp = tempfile.TemporaryDirectory()
        art = compile_bundled(a.work or Path(tmp.name), a.device, a.k, compile_batches, max_tokens, log,
                              deterministic=a.deterministic, expert_format=a.expert_format)
    else:
        art = compile_slice(a.slice, a.k, compile_batches, max_tokens, log, deterministic=a.deterministic,
                            expert_format=a.expert_format)
    timings["compile_or_reuse_s"] = round(time.perf_counter() - t0, 2)
    if a.compile_only:
        return 0
    t0 = time.perf_counter()
    sess = Session.load(art, device=a.device, graphs="full" if torch.device(a.device).type == "cuda" else None,
                        deterministic=a.deterministic)
    only_buckets(sess, batches)
    timings["load_s"] = round(time.perf_counter() - t0, 2)
    m = sess.manifest
    timings["artifact_compile_s"] = m.get("compile_seconds")
    timings["artifact_export_s"] = {n: g.get("export_seconds") for n, g in m["graphs"].items()}
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    head = {"artifact": str(art), "gpu": gpu, "target": m["target"]["name"], "mtp_k": m["mtp_k"],
            "deterministic": a.deterministic, "expert_format": m["target"]["expert_format"],
            "buckets": m["buckets"], "new_tokens": a.new_tokens, "timings": timings}

    def write(rows: list[dict], complete: bool = False) -> None:
        if a.out:
            timings["elapsed_s"] = round(time.perf_counter() - t_start, 2)
            a.out.write_text(json.dumps({**head, "complete": complete, "rows": rows}, indent=1) + "\n")

    deadline = t_start + a.budget_s if a.budget_s else None
    with torch.no_grad():
        rows = run_grid(sess, batches, alphas, ks, a.new_tokens, a.prompt_len, a.bundled or "pystdlib" in str(art),
                        log, on_row=write, deadline=deadline, timings=timings)
    done = len(rows) == len(batches) * len(alphas) * len(ks)
    write(rows, complete=done)
    print(table(rows, f"MTP with teacher-forced drafts, {art} ({m['target']['name']}, "
                      f"{m['dtype']}) on {gpu or a.device}"))
    print(f"timings: {json.dumps(timings)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
