"""The lowering ladder on one model: what each pass buys in speed, and what it costs in accuracy.

    python examples/compare_passes.py                                   # CPU: accuracy ladder, a few minutes
    python examples/compare_passes.py --quick                           # CPU smoke run
    python examples/compare_passes.py --device cuda --out-dir $OUT/ladder   # H200: + v4-flash-slice speed

Rungs, each on top of the previous one (examples/README.md explains them):
  eager       the dsv4c eager reference model (dsv4c/model), no compile
  fusion      + MLA projection fusion: `compile_checkpoint` with the pass pipeline, graphs run op by op
  piecewise   + router split, piecewise CUDA graphs (CPU: "emulate", the same bucketed data flow)
  full        + full graphs: compiled with kernels={"moe_experts": "gathered"}, the step is one graph
  fp8         + FP8 experts      } the quantize_experts pass; a rung whose format cannot be compiled
  fp4         + FP4 experts      } or run here gets a "not available: <reason>" row (detected by trying)
  mtp1..3     + MTP speculative decoding with k drafts, on the last available artifact
Peer row (not a rung): `hf`, HF transformers' DeepseekV4ForCausalLM holding the same weights
(examples/hf_peer.py), bf16 on CUDA / fp32 on CPU, greedy `generate`; "not available: <reason>" where
the installed transformers has no DeepseekV4 or the weights do not load. Its held-out perplexity and
logits SNR against our fp32 eager model on the same windows double as an oracle cross-check.

Per rung: prefill and decode throughput / latency per batch, compile and load time, memory, logits SNR
against the fp32 eager model on the same tokens, held-out perplexity and MTP acceptance on the bundled
trained model (examples/models/v4-tiny-pystdlib). The held-out windows are those of
tests/test_bundled_model.py (train_tiny.stdlib_files / encode_files / non-overlapping windows); each
window is prefilled through the prefill graph except its last `--tail` tokens, which are teacher-forced
through the decode graph in one batch, so the graph rungs (which only change decode) are scored too.

On CUDA it also runs the v4-flash-slice speed columns by calling examples/bench_segments.py (eager
segments vs piecewise vs full graphs, roofline), and times the eager reference module against
`torch.compile` of it on the slice at batch 1 and 8 (bounded by --compile-limit; --no-compile skips it).

Output: a markdown table (stdout and OUT/results.md), OUT/results.json, OUT/throughput.png and
OUT/speed_vs_accuracy.png (matplotlib; skipped with a note when it is not installed); on CUDA also
OUT/bench_segments.json. results.md/.json are rewritten after every row, so a run killed by an outer
time limit still leaves the rows measured so far (their `status` says where it stopped).
--budget-s bounds the whole run (default 480 s on CUDA, none on a CPU): compiles still running at
45% of it are stopped, rungs that would not fit are skipped with the reason, and the slice and
torch.compile parts get only what is left.
Legend: B batch rows, W window tokens, V vocab.
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import dataclasses
import gc
import inspect
import json
import math
import multiprocessing
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
BUNDLE = EXAMPLES / "models" / "v4-tiny-pystdlib"
if str(EXAMPLES) not in sys.path:
    sys.path.insert(0, str(EXAMPLES))

FP8_FORMATS = ("fp8_block",)
FP4_FORMATS = ("mxfp4_w4a16", "nvfp4_w4a16", "nvfp4_w4a4")
FORMAT_OPTION_NAMES = ("expert_format", "experts", "expert_quant", "quant")  # a compile option, if one appears


# ---- configuration --------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Settings:
    device: str
    batches: tuple[int, ...]
    prompt_len: int  # tokens per prompt for the speed columns
    new_tokens: int  # decode tokens per request for the speed columns
    windows: int  # held-out windows (<= max batch: they decode together)
    window: int  # W tokens per window
    tail: int  # the last `tail` tokens of each window go through the decode graph
    mtp_max: int
    jobs: int  # parallel compile workers
    warmup: int  # warm-up decode tokens before each timed run (CUDA-graph capture, first-call costs)
    quick: bool = False

    @property
    def max_batch(self) -> int:
        return max(max(self.batches), self.windows, 2)

    @property
    def max_tokens(self) -> int:
        return max(self.window, self.prompt_len + self.new_tokens + self.mtp_max) + 8


@dataclasses.dataclass(frozen=True)
class ArtSpec:
    """One compile: which target, kernel overrides, passes skipped and expert format requested."""

    name: str
    target: str
    kernels: tuple[tuple[str, str], ...] = ()
    skip: tuple[str, ...] = ()
    expert_formats: tuple[str, ...] = ()  # quantised rungs: acceptable formats, first preferred
    mtp_k: int = 0
    emulate: bool = False


@dataclasses.dataclass(frozen=True)
class Rung:
    key: str
    label: str
    art: str | None  # None: the eager model
    graphs: str = "off"
    mtp: int = 0
    what: str = ""


class Budget:
    """Wall-clock budget of the whole run (`total` None: unlimited)."""

    def __init__(self, total: float | None, t0: float | None = None):
        self.total, self.t0 = total, time.perf_counter() if t0 is None else t0

    def left(self) -> float:
        return math.inf if self.total is None else self.total - (time.perf_counter() - self.t0)

    def reason(self, what: str) -> str:
        return f"skipped: time budget ({max(self.left(), 0):.0f} s of --budget-s {self.total or 0:.0f} left {what})"


def settings_for(device: str, quick: bool, a) -> Settings:
    cuda = device.startswith("cuda")
    if cuda:
        base = {"batches": (1, 8, 64), "prompt_len": 256, "new_tokens": 32, "windows": 8, "window": 512, "tail": 32,
                "jobs": 4, "warmup": 4}
    elif quick:
        base = {"batches": (1, 2), "prompt_len": 16, "new_tokens": 4, "windows": 2, "window": 48, "tail": 4, "jobs": 1,
                "warmup": 2}
    else:
        base = {"batches": (1, 4), "prompt_len": 48, "new_tokens": 8, "windows": 4, "window": 128, "tail": 8, "jobs": 2,
                "warmup": 2}
    for k in ("batches", "prompt_len", "new_tokens", "windows", "window", "tail", "jobs"):
        v = getattr(a, k, None)
        if v is not None:
            base[k] = tuple(v) if k == "batches" else v
    return Settings(device=device, mtp_max=a.mtp_max, quick=quick, **base)


def pipeline_names() -> list[str]:
    from dsv4c.passes import default_pipeline

    return [n for n, _ in default_pipeline()]


def ladder_specs(device: str, mtp_max: int, quick: bool = False) -> tuple[dict[str, ArtSpec], list[Rung]]:
    """The artifacts and the rungs. On a CPU every artifact is compiled for the GPU target and run with
    emulate=True in fp32, so the CPU ladder has the GPU's lowering (capture-safe cache ops, buckets).
    `quick`: one artifact (the full-graph one) serves the fusion and piecewise rungs too, and the FP8/FP4
    compiles are skipped: each compile + load of the bundled model takes 1-2 minutes on a 2-core CPU (and
    compile_one leaves out the fused verify_mtp graph)."""
    from dsv4c.targets import get_target

    cuda = device.startswith("cuda")
    target = "h200"
    no_quant = tuple(n for n in pipeline_names() if n == "quantize_experts")  # unquantised rungs skip it
    gathered = (("moe_experts", "gathered"),)
    specs = {
        "base": ArtSpec("base", target, skip=no_quant, emulate=not cuda),
        "full": ArtSpec("full", target, kernels=gathered, skip=no_quant, emulate=not cuda),
        "fp8": ArtSpec("fp8", target, expert_formats=FP8_FORMATS, emulate=not cuda),
        "fp4": ArtSpec("fp4", target, expert_formats=FP4_FORMATS, emulate=not cuda),
    }
    _ = get_target(target)
    g_pw, g_full = ("piecewise", "full") if cuda else ("emulate", "full-emulate")
    rungs = [
        Rung("eager", "eager reference", None, what="dsv4c eager model, op by op"),
        Rung("fusion", "+ MLA projection fusion", "base", "off", what="pass pipeline; graphs run whole, op by op"),
        Rung("piecewise", "+ router split, piecewise graphs", "base", g_pw,
             what="segments between MoE routers captured per batch bucket; experts eager in between"),
        Rung("full", "+ full graphs", "full", g_full, what="capture-safe gathered experts; one graph per step"),
        Rung("fp8", "+ FP8 experts", "fp8", g_full, what="routed experts in FP8 (quantize_experts)"),
        Rung("fp4", "+ FP4 experts", "fp4", g_full, what="routed experts in MXFP4/NVFP4 (quantize_experts)"),
    ]
    if quick:
        specs = {"full": specs["full"]}
        rungs = [dataclasses.replace(r, art="full", what=r.what + " [--quick: on the full-graph artifact]")
                 if r.art == "base" else r for r in rungs]
    rungs += [Rung(f"mtp{k}", f"+ MTP k={k}", None, g_full, mtp=k, what=f"{k} MTP drafts per round, exact "
                   f"verification") for k in range(1, mtp_max + 1)]
    return specs, rungs


# ---- compiling --------------------------------------------------------------------------------------
def format_option() -> str | None:
    """The compile_checkpoint keyword that picks the expert format, if the signature has one."""
    from dsv4c.compile import compile_checkpoint

    params = inspect.signature(compile_checkpoint).parameters
    return next((n for n in FORMAT_OPTION_NAMES if n in params), None)


def quant_target(spec: ArtSpec, device: str) -> tuple[str, dict]:
    """(target, extra compile kwargs) that give `spec.expert_formats`: the compile option when it exists,
    else a declared target whose expert_format is one of them. Raises LookupError with the reason."""
    from dsv4c.targets import TARGETS

    opt = format_option()
    if opt is not None:
        return spec.target, {opt: spec.expert_formats[0]}
    base = TARGETS[spec.target]
    for fmt in spec.expert_formats:
        if base.expert_format == fmt:
            return base.name, {}
    for fmt in spec.expert_formats:
        for t in TARGETS.values():
            if t.expert_format == fmt and t.device == "cuda":
                return t.name, {}
    raise LookupError(f"no compile option ({'/'.join(FORMAT_OPTION_NAMES)}) and no target lowers routed experts to "
                      f"{' or '.join(spec.expert_formats)}")


def compile_one(spec: ArtSpec, out: str, s: Settings) -> dict:
    """Compile the bundled model per `spec` into `out`; -> {ok, seconds, reason, target, quant_formats}."""
    torch.set_num_threads(1)
    from dsv4c.compile import compile_checkpoint

    t0 = time.perf_counter()
    try:
        kw: dict = {}
        target = spec.target
        if spec.expert_formats:
            target, kw = quant_target(spec, s.device)
        params = inspect.signature(compile_checkpoint).parameters
        if "verify_boundaries" in params:
            kw["verify_boundaries"] = False  # the padding check is compile's own test, not what this measures
        if s.quick and spec.mtp_k and "fused_mtp" in params:
            # --quick: no verify_mtp graph (about 15 of the 90 s compile on a 2-core CPU); the MTP rungs then
            # refresh the draft with separate mtp calls, still exact (tests/test_speculative.py and test_speculative_compiled.py cover fused)
            kw["fused_mtp"] = False
        buckets = tuple(b for b in (1, 2, 4, 8, 16, 24, 32, 48, 64) if b <= s.max_batch)
        dtype = torch.bfloat16 if s.device.startswith("cuda") else torch.float32
        m = compile_checkpoint(BUNDLE, out, target=target, skip=spec.skip, max_tokens=s.max_tokens,
                               max_batch=s.max_batch, buckets=buckets, mtp_k=spec.mtp_k, dtype=dtype, force=True,
                               kernels=dict(spec.kernels) or None, **kw)
    except Exception as e:  # noqa: BLE001 - a format this tree cannot compile: the rung says why
        return {"ok": False, "seconds": time.perf_counter() - t0, "reason": f"{type(e).__name__}: {_short(e)}",
                "path": out}
    formats = sorted(_formats(m.get("quant_map") or {}))
    res = {"ok": True, "seconds": time.perf_counter() - t0, "path": out, "target": target, "quant_formats": formats,
           "size_bytes": sum(f["size"] for f in m["files"].values()), "mtp_k": m.get("mtp_k", 0)}
    if spec.expert_formats and not formats:
        res.update(ok=False, reason=f"compiled for {target}, but the manifest's quant_map is empty: no pass "
                                    f"lowered the routed experts")
    elif spec.expert_formats and not set(formats) & set(spec.expert_formats):
        res.update(ok=False, reason=f"compiled for {target}, experts came out as {formats}, not "
                                    f"{'/'.join(spec.expert_formats)}")
    return res


def _formats(o) -> set[str]:
    """Every expert format named in a manifest quant_map (keys "expert_format" / "format")."""
    if isinstance(o, dict):
        out = {v for k, v in o.items() if k in ("expert_format", "format") and isinstance(v, str)}
        return out.union(*(_formats(v) for v in o.values())) - {"reference"}
    if isinstance(o, list):
        return set().union(*(_formats(v) for v in o)) if o else set()
    return set()


def compile_all(specs: dict[str, ArtSpec], work: Path, s: Settings, limit_s: float = math.inf) -> dict[str, dict]:
    """Compile every artifact, `s.jobs` at a time in fresh *spawned* processes (compiles are single-threaded;
    the parent may already hold a CUDA context, so no fork). Compiles not done within `limit_s` are stopped
    (their workers terminated) and get a "skipped: time budget" record; none starts with less than
    MIN_COMPILE_S of the limit. Only an unlimited jobs-1 run compiles in this process."""
    out = {}
    t0 = time.perf_counter()
    late = {"ok": False, "seconds": 0.0, "reason": f"skipped: time budget (compiles limited to {limit_s:.0f} s "
                                                    f"of --budget-s)"}
    if limit_s < MIN_COMPILE_S:
        print(f"compiles skipped: {late['reason']}", flush=True)
        return {name: dict(late) for name in specs}
    if s.jobs <= 1 and math.isinf(limit_s):  # in-process (a limited compile runs in a worker: it can be stopped)
        for name, spec in specs.items():
            out[name] = compile_one(spec, str(work / name), s)
            print(f"compiled {name}: ok={out[name]['ok']} {out[name]['seconds']:.0f}s "
                  f"{out[name].get('reason', '')}", flush=True)
        return out
    ctx = multiprocessing.get_context("spawn")
    pool = cf.ProcessPoolExecutor(max_workers=max(s.jobs, 1), mp_context=ctx)
    futs = {pool.submit(compile_one, spec, str(work / name), s): name for name, spec in specs.items()}
    try:
        for f in cf.as_completed(futs, timeout=None if math.isinf(limit_s) else max(limit_s, 1.0)):
            name = futs[f]
            try:
                out[name] = f.result()
            except Exception as e:  # noqa: BLE001 - a worker that died
                out[name] = {"ok": False, "seconds": time.perf_counter() - t0,
                             "reason": f"compile worker failed: {_short(e)}"}
            print(f"compiled {name}: ok={out[name]['ok']} {out[name]['seconds']:.0f}s "
                  f"{out[name].get('reason', '')}", flush=True)
    except cf.TimeoutError:
        for f, name in futs.items():
            if name not in out:
                out[name] = dict(late, seconds=time.perf_counter() - t0)
                print(f"compiled {name}: stopped, {out[name]['reason']}", flush=True)
        procs = list((getattr(pool, "_processes", None) or {}).values())  # the workers this run started
        pool.shutdown(wait=False, cancel_futures=True)
        for p in procs:
            if p.is_alive():
                p.terminate()
        for p in procs:
            p.join(timeout=10)
        return out
    pool.shutdown(wait=True)
    return out


# ---- the held-out data -------------------------------------------------------------------------------
def held_out(s: Settings):
    """(tokenizer, stream, windows [n, W+1]) from the held-out stdlib files, as tests/test_bundled_model.py."""
    import train_tiny as tt
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(BUNDLE / "tokenizer.json"))
    _, held = tt.stdlib_files()
    if not held:
        raise RuntimeError("no held-out stdlib files found (train_tiny.HELD_OUT) in this Python's stdlib")
    stream = tt.encode_files(tok, held)
    W = s.window
    n = min(s.windows, (stream.numel() - 1) // W)
    windows = torch.stack([stream[i * W : i * W + W + 1] for i in range(n)])
    return tok, stream, windows


def prompts_for(stream: torch.Tensor, B: int, L: int) -> list[list[int]]:
    """B prompts of L held-out tokens, from the end of the stream (away from the accuracy windows)."""
    end = stream.numel()
    return [stream[end - (i + 1) * L : end - i * L].tolist() for i in range(B)]


def nll_and_snr(logits: torch.Tensor, windows: torch.Tensor, ref: torch.Tensor | None) -> dict:
    """Mean next-token CE over the windows' W positions, perplexity, and SNR against `ref` logits."""
    from dsv4c.compare import error_metrics

    tgt = windows[:, 1:]
    loss = torch.nn.functional.cross_entropy(logits.double().flatten(0, 1), tgt.flatten()).item()
    out = {"loss": loss, "ppl": math.exp(loss)}
    if ref is not None:
        out.update(error_metrics(logits, ref))
    return out


@torch.no_grad()
def eager_window_logits(model, windows: torch.Tensor, tail: int) -> torch.Tensor:
    """Prefill W - tail tokens, then teacher-force the last `tail` one token at a time; -> [n, W, V] fp32."""
    n, W = windows.shape[0], windows.shape[1] - 1
    dev = next(model.parameters()).device
    ids = windows.to(dev)
    cache = model.new_cache(n, max_len=W + 8)
    outs = [model(ids[:, : W - tail], cache).float()]
    for t in range(W - tail, W):
        outs.append(model(ids[:, t : t + 1], cache).float())
    return torch.cat(outs, 1).cpu()


@torch.no_grad()
def session_window_logits(sess, windows: torch.Tensor, tail: int) -> torch.Tensor:
    """The same through a Session: prefill graph per window (one slot each), then the decode graph with all
    windows in one batch. Uses the Session's graph runner, as runtime/segments.py's boundary check does."""
    n, W = windows.shape[0], windows.shape[1] - 1
    slots = list(range(n))
    pre = []
    for i in slots:
        sess._reset_slot(i)
        pre.append(torch.cat(sess._prefill_chunks(windows[i, : W - tail].tolist(), i), 0).float().cpu())
    outs = [torch.stack(pre)]
    for t in range(W - tail, W):
        outs.append(sess._run("decode", windows[:, t : t + 1], slots, [1] * n).float().cpu())
    for i in slots:
        sess._reset_slot(i)
    return torch.cat(outs, 1)


# ---- speed ------------------------------------------------------------------------------------------
def _sync(dev) -> None:
    if torch.device(dev).type == "cuda":
        torch.cuda.synchronize()


def speed_row(B: int, L: int, total_s: float, decode_s: float, decode_tokens: int, steps: int) -> dict:
    prefill_s = max(total_s - decode_s, 1e-9)
    return {"batch": B, "prefill_tokens_per_s": B * L / prefill_s, "prefill_ms": prefill_s * 1e3,
            "decode_tokens_per_s": decode_tokens / max(decode_s, 1e-9),
            "decode_ms_per_step": decode_s / max(steps, 1) * 1e3}


@torch.no_grad()
def eager_speed(model, prompts: list[list[int]], n_new: int) -> dict:
    """Prefill each prompt into its cache slot, then greedy-decode all rows together (eager model)."""
    dev = next(model.parameters()).device
    B, L = len(prompts), len(prompts[0])
    cache = model.new_cache(B, max_len=L + n_new + 8)
    _sync(dev)
    t0 = time.perf_counter()
    last = []
    for i, p in enumerate(prompts):
        lg = model(torch.tensor([p], device=dev), cache, slots=torch.tensor([i], device=dev))
        last.append(lg[0, -1].argmax())
    tok = torch.stack(last)[:, None]  # [B, 1]
    toks = [tok]
    _sync(dev)
    t1 = time.perf_counter()
    for _ in range(n_new - 1):
        tok = model(tok, cache)[:, -1].argmax(-1, keepdim=True)
        toks.append(tok)
    _sync(dev)
    t2 = time.perf_counter()
    row = speed_row(B, L, t2 - t0, t2 - t1, B * (n_new - 1), n_new - 1)
    row["outputs"] = torch.cat(toks, 1).tolist()  # [B, n_new] greedy tokens
    return row


def session_speed(sess, prompts: list[list[int]], n_new: int, mtp: int, warmup: int) -> dict:
    """bench_mtp.run_cell (continuous batching, greedy): prefill = until every request has its first token."""
    from bench_mtp import run_cell

    if warmup:
        run_cell(sess, prompts, warmup, 0.0, mtp)
    cell = run_cell(sess, prompts, n_new, 0.0, mtp)
    steps = max(len(o) for o in cell["outputs"].values()) - 1
    row = speed_row(len(prompts), len(prompts[0]), cell["total_s"], cell["decode_s"], cell["decode_tokens"], steps)
    row["outputs"], row["stats"] = cell["outputs"], cell["stats"]
    return row


def mtp_acceptance(stats: list[dict]) -> dict:
    """Acceptance per draft position, mean accepted length and histogram: the requests' speculation stats
    (GenerationResult.stats of a greedy `session_speed` cell) merged."""
    from dsv4c.runtime.speculative import merge_spec_stats

    st = merge_spec_stats(stats) or {}
    return {"alpha": st.get("acceptance_per_position"), "mean_accepted_length": st.get("mean_accepted_length"),
            "histogram": st.get("accept_histogram")}


# ---- memory -------------------------------------------------------------------------------------------
def rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0


def reset_peak(dev: str) -> None:
    if dev.startswith("cuda"):
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def memory(dev: str) -> dict:
    if dev.startswith("cuda"):
        return {"gpu_peak_bytes": torch.cuda.max_memory_allocated()}
    return {"rss_bytes": rss_bytes()}


# ---- the ladder -----------------------------------------------------------------------------------
def run_ladder(s: Settings, work: Path, budget: Budget | None = None, on_row=None) -> dict:
    """Compile, then measure the eager row, the HF peer row and every rung in turn. `on_row(results)` is
    called after each row (compare_passes writes the partial tables there)."""
    from dsv4c import load_model

    budget = budget or Budget(None)
    on_row = on_row or (lambda _res: None)
    specs, rungs = ladder_specs(s.device, s.mtp_max, s.quick)
    _, stream, windows = held_out(s)
    cuda = s.device.startswith("cuda")
    dtype = torch.bfloat16 if cuda else torch.float32
    # the quantised artifacts also carry the MTP graphs: MTP rungs sit on the last available one
    specs = {n: dataclasses.replace(sp, mtp_k=s.mtp_max) if n in ("full", "fp8", "fp4") else sp
             for n, sp in specs.items()}
    t0 = time.perf_counter()
    compiled = compile_all(specs, work, s, limit_s=COMPILE_SHARE * budget.left())
    compile_wall = time.perf_counter() - t0
    results = {"rows": [], "compile": compiled, "compile_wall_s": compile_wall}

    # eager reference: fp32 logits are the SNR reference everywhere; speed in the artifacts' dtype.
    # It always runs (every other row is judged against it), whatever the budget says.
    t0 = time.perf_counter()
    ref_model = load_model(BUNDLE, dtype=torch.float32).to(s.device).eval()
    load_s = time.perf_counter() - t0
    ref_logits = eager_window_logits(ref_model, windows, s.tail)
    import train_tiny as tt

    # the test's own computation over the same windows (train_forward, one pass per window): a cross-check
    # (on CUDA train_tiny.evaluate runs under bf16 autocast, so there it is not expected to equal `loss`)
    ev = tt.evaluate(ref_model, stream, s.window, torch.device(s.device), max_windows=windows.shape[0])
    ref_model = ref_model.cpu()  # off the GPU: later rows' peak memory is their own
    row = {"rung": "eager", "label": rungs[0].label, "what": rungs[0].what, "available": True,
           "compile_s": 0.0, "load_s": load_s, **nll_and_snr(ref_logits, windows, ref_logits),
           "evaluate_loss": ev["loss"], "evaluate_autocast": "bf16" if cuda else None, "speed": []}
    reset_peak(s.device)
    speed_model = ref_model if dtype == torch.float32 else load_model(BUNDLE, dtype=dtype).to(s.device).eval()
    eager_tokens: dict[int, list] = {}
    for B in s.batches:
        if s.warmup:
            eager_speed(speed_model, prompts_for(stream, B, s.prompt_len), s.warmup)
        sp = eager_speed(speed_model, prompts_for(stream, B, s.prompt_len), s.new_tokens)
        eager_tokens[B] = sp.pop("outputs")
        row["speed"].append(sp)
    row["memory"] = memory(s.device)
    results["rows"].append(row)
    print(summary_line(row), flush=True)
    del speed_model
    on_row(results)

    timings: list[float] = []  # seconds per measured row: the estimate for the next one
    t_row = time.perf_counter()
    results["rows"].append(hf_row(s, ref_model, stream, windows, ref_logits, eager_tokens, budget))
    timings.append(time.perf_counter() - t_row)
    print(summary_line(results["rows"][-1]), flush=True)
    on_row(results)

    sessions: dict[str, object] = {}
    last_art = "full"
    base_tokens: dict[int, dict] = {}
    for rung in rungs[1:]:
        art = rung.art or last_art
        info = compiled.get(art) or {"ok": False, "reason": "skipped in --quick (an FP8/FP4 compile + load takes 1-2 "
                                                            "min on a 2-core CPU); run without --quick"}
        row = {"rung": rung.key, "label": rung.label, "what": rung.what, "artifact": art, "graphs": rung.graphs,
               "mtp": rung.mtp, "available": False}
        need = max(timings[-1:] or [0.0]) + ROW_MARGIN_S
        if info["ok"] and budget.left() < need:
            info = {"ok": False, "reason": budget.reason(f"; the last row took {timings[-1]:.0f} s")}
        if not info["ok"]:
            row["reason"] = info["reason"] if info["reason"].startswith("skipped") else f"not available: {info['reason']}"
            results["rows"].append(row)
            print(f"{rung.key:10} {row['reason']}", flush=True)
            on_row(results)
            continue
        t_row = time.perf_counter()
        try:
            _measure_rung(rung, art, info, row, sessions, specs, s, stream, windows, ref_logits, base_tokens)
        except Exception as e:  # noqa: BLE001 - compiled, but cannot run here (e.g. a kernel needing another GPU)
            row = {k: v for k, v in row.items() if k in ("rung", "label", "what", "artifact", "graphs", "mtp")}
            row.update(available=False, reason=f"not available: {type(e).__name__}: {_short(e)}")
        timings.append(time.perf_counter() - t_row)
        row["row_s"] = timings[-1]
        if row["available"] and art in ("fp8", "fp4"):
            last_art = art
        results["rows"].append(row)
        print(summary_line(row), flush=True)
        on_row(results)
    sessions.clear()
    gc.collect()
    return results


MIN_COMPILE_S = 5.0  # compiles are not started with less of their share left
COMPILE_SHARE = 0.45  # compiles still running at this share of --budget-s are stopped
ROW_MARGIN_S = 20.0  # a row starts only if (the last row's time + this) is left


def hf_row(s: Settings, ref_model, stream, windows, ref_logits, eager_tokens: dict, budget: Budget) -> dict:
    """The HF transformers peer: DeepseekV4ForCausalLM with the bundled weights, bf16 on CUDA (fp32 on a
    CPU). Held-out windows in one full forward each (no decode-graph tail: HF has one path), greedy
    `generate` at the rung batch sizes. Never raises: a failure is the row's "not available: reason"."""
    import hf_peer

    row = {"rung": "hf", "label": "peer: HF transformers DeepseekV4", "peer": True, "available": False}
    why = hf_peer.unavailable_reason()
    if why is None and budget.left() < 2 * ROW_MARGIN_S:
        row["reason"] = budget.reason("before the HF row")
        return row
    if why is not None:
        row["reason"] = f"not available: {why}"
        return row
    cuda = s.device.startswith("cuda")
    dtype = torch.bfloat16 if cuda else torch.float32
    hf = None
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()  # generate()'s per-call notes about flags would flood the log
        reset_peak(s.device)
        t0 = time.perf_counter()
        hf, info = hf_peer.build(ref_model, s.device, dtype)
        row.update(available=True, load_s=time.perf_counter() - t0, compile_s=None, hf=info,
                   transformers=hf_peer.transformers_version(),
                   what=f"transformers {hf_peer.transformers_version()}, eager attention, {info['cast']}; "
                        f"greedy generate(); windows in one forward")
        row.update(nll_and_snr(hf_peer.window_logits(hf, windows), windows, ref_logits))
        row["speed"] = []
        for B in s.batches:
            prompts = prompts_for(stream, B, s.prompt_len)
            if s.warmup:
                hf_peer.generate_speed(hf, prompts, s.warmup)
            sp = hf_peer.generate_speed(hf, prompts, s.new_tokens)
            sp["greedy_equal_eager"] = sp.pop("outputs") == eager_tokens.get(B)
            row["speed"].append(sp)
        row["memory"] = memory(s.device)
    except Exception as e:  # noqa: BLE001 - "where it loads": the reason is the result
        row = {k: row[k] for k in ("rung", "label", "peer")}
        row.update(available=False, reason=f"not available: {type(e).__name__}: {_short(e)}")
    finally:
        hf = None
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
    return row


def _measure_rung(rung: Rung, art: str, info: dict, row: dict, sessions: dict, specs: dict, s: Settings,
                  stream, windows, ref_logits, base_tokens: dict) -> None:
    from dsv4c.runtime import Session

    if art not in sessions:  # free the previous artifact before the peak is reset: the peak is this rung's
        sessions.clear()
        gc.collect()
    reset_peak(s.device)
    t0 = time.perf_counter()
    if art not in sessions:
        try:
            sessions[art] = Session.load(Path(info["path"]), device=s.device, emulate=specs[art].emulate,
                                         graphs=rung.graphs)
        except ValueError as e:  # e.g. an expert op that is not capture-safe: the full step cannot be one graph
            if not rung.graphs.startswith("full"):
                raise
            fallback = "piecewise" if rung.graphs == "full" else "emulate"
            row.update(graphs=fallback, graphs_note=f"{rung.graphs} refused ({_short(e, 160)}); ran {fallback}")
            sessions[art] = Session.load(Path(info["path"]), device=s.device, emulate=specs[art].emulate,
                                         graphs=fallback)
        row["load_s"] = time.perf_counter() - t0
        row["load_note"] = "Session.load"
    else:  # same artifact: rebuild the executors only when the graph mode changes
        sess = sessions[art]
        if sess_mode(sess) != rung.graphs:
            try:
                sess.executors = sess._executors(rung.graphs)
            except ValueError as e:
                if not rung.graphs.startswith("full"):
                    raise
                row.update(graphs=sess_mode(sess), graphs_note=f"{rung.graphs} refused ({_short(e, 160)})")
        row["load_s"] = time.perf_counter() - t0
        row["load_note"] = "executors rebuilt (artifact already loaded)"
    sess = sessions[art]
    row.update(available=True, compile_s=info["seconds"], target=info.get("target"),
               expert_formats=info.get("quant_formats") or [], artifact_bytes=info.get("size_bytes"))
    if rung.mtp == 0:
        row.update(nll_and_snr(session_window_logits(sess, windows, s.tail), windows, ref_logits))
    row["speed"], stats = [], {}
    for B in s.batches:
        sp = session_speed(sess, prompts_for(stream, B, s.prompt_len), s.new_tokens, rung.mtp, s.warmup)
        outs, stats[B] = sp.pop("outputs"), sp.pop("stats")
        if rung.mtp == 0:
            base_tokens[(art, B)] = outs
        elif (art, B) in base_tokens:
            sp["greedy_equal_k0"] = outs == base_tokens[(art, B)]
        row["speed"].append(sp)
    if rung.mtp:
        B = max(s.batches)
        row["acceptance"] = mtp_acceptance(stats[B])  # the timed batch-B cell's requests
        row["acceptance_note"] = f"greedy, batch {B}, {s.new_tokens} new tokens per held-out prompt"
    row["memory"] = memory(s.device)


def sess_mode(sess) -> str:
    ex = next(iter(sess.executors.values()), None)
    return "off" if ex is None else {"graphs": "piecewise"}.get(ex.mode, ex.mode)


# ---- the slice (GPU) ------------------------------------------------------------------------------
SLICE_MIN_S = 150.0  # the slice starts only with this much of --budget-s left
TAIL_S = 15.0  # kept back at the end of the budget for the last write


def run_slice(a, out_dir: Path, budget: Budget | None = None) -> dict:
    """bench_segments on the v4-flash-slice (its own JSON), then eager module vs torch.compile; each part
    is stopped (SIGALRM) when the budget runs out, and what is left decides whether torch.compile runs."""
    import bench_segments

    budget = budget or Budget(None)
    res: dict = {}
    path = out_dir / "bench_segments.json"
    t0 = time.perf_counter()
    try:
        with _alarm(budget.left() - TAIL_S):
            bench_segments.main(["--out", str(path), "--steps", str(a.steps), "--batches",
                                 *map(str, a.slice_batches), "--prompt", str(a.slice_prompt)])
        res["segments"] = json.loads(path.read_text())
    except _Timeout:
        res["segments_error"] = f"stopped by --budget-s {budget.total:.0f} after {time.perf_counter() - t0:.0f} s"
    except Exception as e:  # noqa: BLE001 - the ladder's results still count
        res["segments_error"] = f"{type(e).__name__}: {_short(e)}"
    res["segments_s"] = time.perf_counter() - t0
    gc.collect()
    try:
        torch.cuda.empty_cache()
    except RuntimeError as e:  # e.g. a capture left open by the budget's stop: the table is still written
        res["segments_error"] = res.get("segments_error", "") + f"; then {_short(e, 120)}"
    limit = min(a.compile_limit, budget.left() - TAIL_S - 30)  # 30 s: building the slice + its prefill
    if a.no_compile:
        res["torch_compile"] = {"skipped": "--no-compile"}
    elif "segments_error" in res and res["segments_error"].startswith("stopped"):
        res["torch_compile"] = {"skipped": "time budget (the segments part was stopped)"}
    elif limit < 30:
        res["torch_compile"] = {"skipped": f"time budget ({max(budget.left(), 0):.0f} s left after the segments)"}
    else:
        try:
            with _alarm(budget.left() - TAIL_S):  # building the slice and eager timing are bounded too
                res["torch_compile"] = slice_torch_compile(a, limit)
        except _Timeout:
            res["torch_compile"] = {"failed": f"stopped by --budget-s {budget.total:.0f} (building the slice, "
                                              f"its eager timing or torch.compile)"}
    return res


class _Timeout(BaseException):
    """Raised by SIGALRM; a BaseException so that `except Exception` inside the timed code cannot eat it."""


class _alarm:
    """`with _alarm(seconds):` raises _Timeout in the block after `seconds` (no limit when infinite).
    Nests: an inner alarm never outlives the outer one, and the outer one is re-armed on exit."""

    def __init__(self, seconds: float):
        self.seconds = seconds

    def __enter__(self):
        self.old = None
        if math.isfinite(self.seconds):
            self.outer = signal.getitimer(signal.ITIMER_REAL)[0]  # 0.0: none armed
            self.start = time.perf_counter()
            self.old = signal.signal(signal.SIGALRM, _raise_timeout)
            t = max(self.seconds, 0.5)
            signal.setitimer(signal.ITIMER_REAL, min(t, self.outer) if self.outer > 0 else t)
        return self

    def __exit__(self, *exc):
        if self.old is not None:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, self.old)
            if self.outer > 0:
                signal.setitimer(signal.ITIMER_REAL, max(self.outer - (time.perf_counter() - self.start), 0.01))
        return False


def _raise_timeout(*_):
    raise _Timeout()


def slice_torch_compile(a, limit: float) -> dict:
    """Eager reference module vs torch.compile of it, decode step on the slice at batch 1 and 8; building
    the slice and timing eager come first, then `limit` seconds for compile + its timed steps."""
    import bench_segments

    dev = torch.device("cuda")
    out: dict = {"batches": [b for b in (1, 8) if b <= max(a.slice_batches)]}
    model = bench_segments.build("v4-flash-slice", dev, torch.bfloat16)
    n = max(out["batches"]) + 1
    max_len = a.slice_prompt + a.steps + 64
    cache = bench_segments.prefill(model, n, a.slice_prompt, max_len, chunk_rows=8, seed=0)
    snap = [(t, t.clone()) for t in _cache_tensors(cache)]
    pos0 = cache.pos.clone()

    def timed(fn, B: int) -> float:
        for t, c in snap:
            t.copy_(c)
        cache.pos.copy_(pos0)
        ids = torch.zeros(B, 1, dtype=torch.int64, device=dev)
        slots = torch.arange(B, device=dev)
        ms = []
        for i in range(a.steps):
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            ids = fn(ids, cache, None, slots)[:, -1].argmax(-1, keepdim=True)
            e1.record()
            e1.synchronize()
            ms.append(e0.elapsed_time(e1))
        return statistics.median(ms[3:])

    with torch.no_grad():
        for B in out["batches"]:
            out[f"eager_ms_b{B}"] = timed(model, B)
        compiled = torch.compile(model)
        t0 = time.perf_counter()
        try:
            with _alarm(limit):
                for B in out["batches"]:
                    out[f"compile_ms_b{B}"] = timed(compiled, B)
                    out[f"compile_speedup_b{B}"] = out[f"eager_ms_b{B}"] / out[f"compile_ms_b{B}"]
            out["compile_s"] = time.perf_counter() - t0
        except _Timeout:
            out["failed"] = f"time limit {limit:.0f} s reached (compile + {a.steps} steps per batch)"
        except Exception as e:  # noqa: BLE001 - "failed: reason" is the result
            out["failed"] = f"{type(e).__name__}: {_short(e)}"
    model = cache = snap = compiled = None  # free the slice before returning
    gc.collect()
    torch.cuda.empty_cache()
    return out


def _cache_tensors(cache) -> list[torch.Tensor]:
    from dsv4c.export import flat_caches

    return list(flat_caches(cache.layers).values())


# ---- reporting -----------------------------------------------------------------------------------
def _short(e: Exception, n: int = 240) -> str:
    s = " ".join(str(e).split())
    return s if len(s) <= n else s[: n - 3] + "..."


def _f(x, fmt: str = "{:.2f}") -> str:
    if x is None:
        return "–"
    if isinstance(x, float) and math.isinf(x):
        return "exact (inf)"
    return fmt.format(x)


def summary_line(r: dict) -> str:
    if not r.get("available"):
        return f"{r['rung']:10} {r.get('reason')}"
    sp = ", ".join(f"B{x['batch']} {x['decode_tokens_per_s']:.1f} tok/s" for x in r["speed"])
    return f"{r['rung']:10} SNR {_f(r.get('snr_db'), '{:.1f}')} dB  ppl {_f(r.get('ppl'), '{:.3f}')}  decode {sp}"


def table(res: dict) -> str:
    rows = res["ladder"]["rows"]
    batches = [x["batch"] for x in rows[0]["speed"]]
    eager = {x["batch"]: x for x in rows[0]["speed"]}
    head = ["rung", "config"] + [f"decode tok/s B={b} (vs eager)" for b in batches] + \
           [f"decode ms/step B={b}" for b in batches] + [f"prefill tok/s B={batches[0]}", "compile s", "load s",
                                                         "memory MB", "SNR dB vs eager fp32", "held-out ppl",
                                                         "MTP acceptance / mean accepted length"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        if not r.get("available"):
            lines.append(f"| {r['label']} | **{r['reason']}** |" + " |" * (len(head) - 2))
            continue
        cfg = r.get("what", "")
        if r.get("artifact"):
            cfg = f"{r['artifact']} art. ({r.get('target')}), graphs={r['graphs']}" + \
                  (f", experts {'/'.join(r['expert_formats'])}" if r.get("expert_formats") else "")
        sp = {x["batch"]: x for x in r["speed"]}
        tps = [f"{sp[b]['decode_tokens_per_s']:.1f} ({sp[b]['decode_tokens_per_s'] / eager[b]['decode_tokens_per_s']:.2f}x)"
               for b in batches]
        ms = [f"{sp[b]['decode_ms_per_step']:.1f}" for b in batches]
        mem = r.get("memory", {})
        mem_s = f"{mem['gpu_peak_bytes'] / 2**20:.0f} GPU peak" if "gpu_peak_bytes" in mem else \
            f"{mem.get('rss_bytes', 0) / 2**20:.0f} RSS" + \
            (f", art. {r['artifact_bytes'] / 2**20:.1f}" if r.get("artifact_bytes") else "")
        acc = "–"
        if r.get("acceptance"):
            al = r["acceptance"]
            acc = "α " + "/".join(_f(x) for x in al.get("alpha") or []) + f", τ {_f(al.get('mean_accepted_length'))}"
            eq = [x.get("greedy_equal_k0") for x in r["speed"]]
            acc += f", greedy = k0: {all(eq) if None not in eq else '–'}"
        elif r.get("peer"):
            eq = [x.get("greedy_equal_eager") for x in r["speed"]]
            acc = "(peer) greedy tokens = eager's: " + ", ".join(f"B{x['batch']} {e}" for x, e in zip(r["speed"], eq))
        ppl = "= k=0 (exact)" if r.get("mtp") else _f(r.get("ppl"), "{:.3f}")
        lines.append("| " + " | ".join([r["label"], cfg, *tps, *ms, f"{sp[batches[0]]['prefill_tokens_per_s']:.0f}",
                                        _f(r.get("compile_s"), "{:.0f}"), _f(r.get("load_s"), "{:.1f}"), mem_s,
                                        _f(r.get("snr_db"), "{:.1f}"), ppl, acc]) + " |")
    return "\n".join(lines)


def slice_table(sl: dict) -> str:
    if not sl:
        return ""
    out = ["", "### v4-flash-slice decode step (examples/bench_segments.py, same run)", ""]
    if "skipped" in sl:
        return "\n".join([*out, f"skipped: {sl['skipped']}"])
    if "segments" in sl:
        import bench_segments

        seg = sl["segments"]
        out += [(f"copy bandwidth {_f(seg.get('copy_bandwidth_GBps'), '{:.0f}')} GB/s; prompt {seg['prompt']}; "
                 f"{seg['steps']} steps"), "", bench_segments.table(seg)]
    else:
        out.append(f"bench_segments failed: {sl.get('segments_error')}")
    tc = sl.get("torch_compile", {})
    out += ["", "### eager reference module vs torch.compile (slice decode step)", ""]
    if "skipped" in tc:
        out.append(f"torch.compile: skipped ({tc['skipped']})")
    else:
        for B in tc.get("batches", []):
            out.append(f"- batch {B}: eager {_f(tc.get(f'eager_ms_b{B}'))} ms, torch.compile "
                       f"{_f(tc.get(f'compile_ms_b{B}'))} ms ({_f(tc.get(f'compile_speedup_b{B}'))}x)")
        if "failed" in tc:
            out.append(f"- torch.compile failed: {tc['failed']}")
    return "\n".join(out)


def plots(res: dict, out_dir: Path) -> list[str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        res["plots_skipped"] = "matplotlib is not installed (pip install -e '.[plot]')"
        return []
    rows = [r for r in res["ladder"]["rows"] if r.get("available")]
    dev = res["device"]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in rows:
        b = [x["batch"] for x in r["speed"]]
        ax.plot(b, [x["decode_tokens_per_s"] for x in r["speed"]], marker="o", label=r["label"])
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("batch (sequences)")
    ax.set_ylabel("decode tokens/s")
    ax.set_title(f"Decode throughput per rung, bundled model, {dev}", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    p1 = out_dir / "throughput.png"
    fig.savefig(p1, dpi=120)
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in rows:
        snr = r.get("snr_db")
        if snr is None:
            continue
        y = 200.0 if math.isinf(snr) else snr
        x = r["speed"][0]["decode_tokens_per_s"]
        ax.scatter([x], [y])
        ax.annotate(r["rung"] + (" (exact)" if math.isinf(snr) else ""), (x, y), fontsize=7)
    ax.set_xlabel(f"decode tokens/s at batch {rows[0]['speed'][0]['batch']}")
    ax.set_ylabel("logits SNR vs fp32 eager (dB; exact plotted at 200)")
    ax.set_title(f"Speed vs accuracy, bundled model, {dev}", fontsize=9)
    fig.tight_layout()
    p2 = out_dir / "speed_vs_accuracy.png"
    fig.savefig(p2, dpi=120)
    plt.close(fig)
    return [str(p1), str(p2)]


def _commit() -> str:
    from bench_segments import _commit as commit  # HEAD's hash, "+dirty" when the tracked files differ

    return commit()


def _strip(o):
    if isinstance(o, dict):
        return {k: _strip(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [_strip(v) for v in o]
    return o


# ---- main -------------------------------------------------------------------------------------------
def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out-dir", type=Path, default=ROOT / "out" / "ladder")
    ap.add_argument("--quick", action="store_true", help="CPU smoke run: tiny windows and batches")
    ap.add_argument("--batches", type=int, nargs="+", default=None)
    ap.add_argument("--prompt-len", type=int, default=None)
    ap.add_argument("--new-tokens", type=int, default=None)
    ap.add_argument("--windows", type=int, default=None, help="held-out windows")
    ap.add_argument("--window", type=int, default=None, help="tokens per held-out window")
    ap.add_argument("--tail", type=int, default=None, help="window tokens teacher-forced through the decode graph")
    ap.add_argument("--mtp-max", type=int, default=3)
    ap.add_argument("--jobs", type=int, default=None, help="parallel compiles")
    ap.add_argument("--work-dir", type=Path, default=None, help="where artifacts go (default: a temporary folder)")
    # GPU: the slice
    ap.add_argument("--no-slice", action="store_true", help="CUDA: skip the v4-flash-slice speed columns")
    ap.add_argument("--slice-only", action="store_true",
                    help="CUDA: only the v4-flash-slice part (slice.md / slice.json in --out-dir), e.g. when a "
                         "ladder run's budget left no room for it")
    ap.add_argument("--no-compile", action="store_true", help="CUDA: skip torch.compile of the eager reference")
    ap.add_argument("--compile-limit", type=float, default=90, help="seconds for torch.compile + its timed steps")
    ap.add_argument("--budget-s", type=float, default=None,
                    help="wall-clock budget of the whole run (default: 480 on CUDA, none on a CPU): late compiles "
                         "are stopped, rungs that would not fit and the slice / torch.compile parts are skipped")
    ap.add_argument("--steps", type=int, default=10, help="slice decode steps per batch (first 3 warm-up)")
    ap.add_argument("--slice-batches", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--slice-prompt", type=int, default=1024)
    return ap.parse_args(argv)


def main(argv=None) -> dict:
    a = parse(argv)
    t0 = time.perf_counter()
    s = settings_for(a.device, a.quick, a)
    if s.windows > s.max_batch or s.tail >= s.window:
        raise SystemExit("--windows must be <= the largest batch and --tail < --window")
    cuda = s.device.startswith("cuda")
    budget = Budget(a.budget_s if a.budget_s is not None else (480.0 if cuda else None), t0)
    a.out_dir.mkdir(parents=True, exist_ok=True)
    head = run_header(cuda, budget, argv)
    if a.slice_only:
        return slice_only(a, head, budget, cuda)
    res = {**head, "settings": dataclasses.asdict(s), "pipeline": pipeline_names(),
           "format_option": format_option(), "status": "compiling"}
    tmp = None
    work = a.work_dir
    if work is None:
        tmp = tempfile.TemporaryDirectory(prefix="dsv4c-ladder-")
        work = Path(tmp.name)

    def partial(ladder: dict) -> None:
        res["ladder"] = ladder
        res["status"] = f"running: {len(ladder['rows'])} rows measured so far (the run was stopped here)"
        write(res, a.out_dir, t0, quiet=True, with_plots=False)

    try:
        res["ladder"] = run_ladder(s, work, budget, partial)
    finally:
        if tmp is not None:
            tmp.cleanup()
    do_slice = cuda and not a.no_slice
    res["status"] = "running: the v4-flash-slice part (the run was stopped here)" if do_slice else "complete"
    write(res, a.out_dir, t0, quiet=do_slice)  # kept if the slice overruns
    if do_slice:
        left = budget.left()
        if left < SLICE_MIN_S:
            res["slice"] = {"skipped": f"time budget: {left:.0f} s of --budget-s {budget.total:.0f} left "
                                       f"(the slice needs {SLICE_MIN_S:.0f} s)"}
        else:
            res["slice"] = run_slice(a, a.out_dir, budget)
        res["status"] = "complete"
        write(res, a.out_dir, t0)
    return res


def run_header(cuda: bool, budget: Budget, argv) -> dict:
    """Date, commit, versions, device, budget and command of one run (results.json / slice.json)."""
    return {"date": time.strftime("%Y-%m-%d"), "commit": _commit(), "torch": torch.__version__,
            "device": torch.cuda.get_device_name() if cuda else f"cpu ({os.cpu_count()} cores)",
            "budget_s": budget.total,
            "command": "python examples/compare_passes.py " + " ".join(sys.argv[1:] if argv is None else argv)}


def slice_only(a, head: dict, budget: Budget, cuda: bool) -> dict:
    """--slice-only: the slice part alone, written as slice.md / slice.json."""
    if not cuda:
        raise SystemExit("--slice-only needs a CUDA device (the v4-flash-slice is a GPU benchmark)")
    res = {**head, "slice": run_slice(a, a.out_dir, budget)}
    md = (f"## v4-flash-slice part of the ladder, {res['device']}\n\n{res['date']}, commit {res['commit']}, "
          f"torch {res['torch']}\n" + slice_table(res["slice"]))
    print(md)
    _write_atomic(a.out_dir / "slice.md", md + "\n")
    _write_atomic(a.out_dir / "slice.json", json.dumps(_strip(res), indent=1, default=str) + "\n")
    return res


def write(res: dict, out_dir: Path, t0: float, quiet: bool = False, with_plots: bool = True) -> None:
    """results.md / results.json (and the plots) from what has been measured so far."""
    res["seconds"] = time.perf_counter() - t0
    if with_plots:
        res["plots"] = plots(res, out_dir)
    md = render(res)
    if not quiet:
        print(md)
    _write_atomic(out_dir / "results.md", md + "\n")
    _write_atomic(out_dir / "results.json", json.dumps(_strip(res), indent=1, default=str) + "\n")


def _write_atomic(path: Path, text: str) -> None:
    """Write then rename: a kill mid-write leaves the previous complete file."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def peer_notes(rows: list[dict]) -> list[str]:
    """Decode tok/s of each measured ladder rung against the HF peer, and the peer's accuracy check."""
    hf = next((r for r in rows if r["rung"] == "hf"), None)
    if hf is None:
        return []
    if not hf.get("available"):
        return [f"HF transformers peer: {hf['reason']}."]
    ref = {x["batch"]: x["decode_tokens_per_s"] for x in hf["speed"]}
    out = [(f"HF transformers {hf['transformers']} peer: held-out loss {hf['loss']:.6f} vs eager "
           f"{rows[0]['loss']:.6f} (diff {hf['loss'] - rows[0]['loss']:+.2e} nats), logits SNR "
           f"{_f(hf.get('snr_db'), '{:.1f}')} dB vs the fp32 eager model on the same windows; weights: "
           f"{hf['hf']['tensors']} HF tensors mapped, {hf['hf']['dropped']} checkpoint tensors dropped "
           f"({'; '.join(hf['hf']['dropped_why'])})."), "",
           "Decode tokens/s against HF transformers' generate at the same batch (same run):", ""]
    for r in rows:
        if r["rung"] == "hf" or not r.get("available"):
            continue
        out.append(f"- {r['label']}: " + ", ".join(f"B={x['batch']} {x['decode_tokens_per_s'] / ref[x['batch']]:.2f}x"
                                                  for x in r["speed"] if ref.get(x["batch"])))
    return out


def render(res: dict) -> str:
    s = res["settings"]
    head = [f"## Lowering ladder: {BUNDLE.name}, {res['device']}", "",
            (f"{res['date']}, commit {res['commit']}, torch {res['torch']}; {res.get('status', 'complete')}; "
             f"total {res['seconds']:.0f} s of --budget-s {_f(res.get('budget_s'), '{:.0f}')} "
             f"(compiles {res['ladder']['compile_wall_s']:.0f} s wall, {s['jobs']} in parallel)."),
            (f"Held-out: {s['windows']} windows x {s['window']} tokens (last {s['tail']} through the decode graph). "
             f"Speed: prompts of {s['prompt_len']} held-out tokens, {s['new_tokens']} greedy tokens each."), "", ""]
    notes = ["", "Ratios in parentheses are against the eager reference at the same batch."]
    notes += peer_notes(res["ladder"]["rows"])
    if res.get("status", "complete") != "complete":
        notes.append(f"**Partial results, status: {res['status']}.**")
    if res.get("plots_skipped"):
        notes.append(f"Plots: {res['plots_skipped']}.")
    return "\n".join(head) + table(res) + "\n" + "\n".join(notes) + slice_table(res.get("slice", {}))


if __name__ == "__main__":
    main()
