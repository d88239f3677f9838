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
OUT/speed_vs_accuracy.png (matplotlib; skipped with a note when it is not installed).
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
import subprocess
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
    compiles are skipped: each compile + load of the bundled model takes 1-2 minutes on a 2-core CPU."""
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


def compile_all(specs: dict[str, ArtSpec], work: Path, s: Settings) -> dict[str, dict]:
    """Compile every artifact, `s.jobs` at a time in fresh processes (compiles are single-threaded)."""
    out = {}
    if s.jobs <= 1:
        for name, spec in specs.items():
            out[name] = compile_one(spec, str(work / name), s)
            print(f"compiled {name}: {out[name]}", flush=True)
        return out
    ctx = multiprocessing.get_context("spawn")
    with cf.ProcessPoolExecutor(max_workers=s.jobs, mp_context=ctx) as pool:
        futs = {pool.submit(compile_one, spec, str(work / name), s): name for name, spec in specs.items()}
        for f in cf.as_completed(futs):
            name = futs[f]
            try:
                out[name] = f.result()
            except Exception as e:  # noqa: BLE001 - a worker that died
                out[name] = {"ok": False, "seconds": 0.0, "reason": f"compile worker failed: {_short(e)}"}
            print(f"compiled {name}: ok={out[name]['ok']} {out[name]['seconds']:.0f}s "
                  f"{out[name].get('reason', '')}", flush=True)
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
    tok = torch.stack(last)[:, None]
    _sync(dev)
    t1 = time.perf_counter()
    for _ in range(n_new - 1):
        tok = model(tok, cache)[:, -1].argmax(-1, keepdim=True)
    _sync(dev)
    t2 = time.perf_counter()
    return speed_row(B, L, t2 - t0, t2 - t1, B * (n_new - 1), n_new - 1)


def session_speed(sess, prompts: list[list[int]], n_new: int, mtp: int, warmup: int) -> dict:
    """bench_mtp.run_cell (continuous batching, greedy): prefill = until every request has its first token."""
    from bench_mtp import run_cell

    if warmup:
        run_cell(sess, prompts, warmup, 0.0, mtp)
    cell = run_cell(sess, prompts, n_new, 0.0, mtp)
    steps = max(len(o) for o in cell["outputs"].values()) - 1
    row = speed_row(len(prompts), len(prompts[0]), cell["total_s"], cell["decode_s"], cell["decode_tokens"], steps)
    row["outputs"] = cell["outputs"]
    return row


def mtp_acceptance(sess, prompts: list[list[int]], n_new: int, k: int) -> dict:
    """Acceptance per draft position and mean accepted length over `prompts` (generate stats)."""
    from bench_mtp import spec_stats

    st = spec_stats(sess, prompts, n_new, 0.0, k)
    return {"alpha": st.get("alpha"), "mean_accepted_length": st.get("mean_accepted_length"),
            "histogram": st.get("histogram")}


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
def run_ladder(s: Settings, work: Path) -> dict:
    from dsv4c import load_model

    specs, rungs = ladder_specs(s.device, s.mtp_max, s.quick)
    _, stream, windows = held_out(s)
    cuda = s.device.startswith("cuda")
    dtype = torch.bfloat16 if cuda else torch.float32
    # the quantised artifacts also carry the MTP graphs: MTP rungs sit on the last available one
    specs = {n: dataclasses.replace(sp, mtp_k=s.mtp_max) if n in ("full", "fp8", "fp4") else sp
             for n, sp in specs.items()}
    t0 = time.perf_counter()
    compiled = compile_all(specs, work, s)
    compile_wall = time.perf_counter() - t0
    results = {"rows": [], "compile": compiled, "compile_wall_s": compile_wall}

    # eager reference: fp32 logits are the SNR reference everywhere; speed in the artifacts' dtype
    t0 = time.perf_counter()
    ref_model = load_model(BUNDLE, dtype=torch.float32).to(s.device).eval()
    load_s = time.perf_counter() - t0
    ref_logits = eager_window_logits(ref_model, windows, s.tail)
    import train_tiny as tt

    # the test's own computation over the same windows (train_forward, one pass per window): a cross-check
    ev = tt.evaluate(ref_model, stream, s.window, torch.device(s.device), max_windows=windows.shape[0])
    speed_model = ref_model if dtype == torch.float32 else load_model(BUNDLE, dtype=dtype).to(s.device).eval()
    row = {"rung": "eager", "label": rungs[0].label, "what": rungs[0].what, "available": True,
           "compile_s": 0.0, "load_s": load_s, **nll_and_snr(ref_logits, windows, ref_logits),
           "evaluate_loss": ev["loss"], "speed": []}
    reset_peak(s.device)
    for B in s.batches:
        if s.warmup:
            eager_speed(speed_model, prompts_for(stream, B, s.prompt_len), s.warmup)
        row["speed"].append(eager_speed(speed_model, prompts_for(stream, B, s.prompt_len), s.new_tokens))
    row["memory"] = memory(s.device)
    results["rows"].append(row)
    print(summary_line(row), flush=True)
    del speed_model

    sessions: dict[str, object] = {}
    last_art = "full"
    base_tokens: dict[int, dict] = {}
    for rung in rungs[1:]:
        art = rung.art or last_art
        info = compiled.get(art) or {"ok": False, "reason": "skipped in --quick (an FP8/FP4 compile + load takes 1-2 "
                                                            "min on a 2-core CPU); run without --quick"}
        row = {"rung": rung.key, "label": rung.label, "what": rung.what, "artifact": art, "graphs": rung.graphs,
               "mtp": rung.mtp, "available": False}
        if not info["ok"]:
            row["reason"] = info["reason"] if info["reason"].startswith("skipped") else f"not available: {info['reason']}"
            results["rows"].append(row)
            print(f"{rung.key:10} {row['reason']}", flush=True)
            continue
        try:
            _measure_rung(rung, art, info, row, sessions, specs, s, stream, windows, ref_logits, base_tokens)
        except Exception as e:  # noqa: BLE001 - compiled, but cannot run here (e.g. a kernel needing another GPU)
            row = {k: v for k, v in row.items() if k in ("rung", "label", "what", "artifact", "graphs", "mtp")}
            row.update(available=False, reason=f"not available: {type(e).__name__}: {_short(e)}")
        if row["available"] and art in ("fp8", "fp4"):
            last_art = art
        results["rows"].append(row)
        print(summary_line(row), flush=True)
    sessions.clear()
    return results


def _measure_rung(rung: Rung, art: str, info: dict, row: dict, sessions: dict, specs: dict, s: Settings,
                  stream, windows, ref_logits, base_tokens: dict) -> None:
    from dsv4c.runtime import Session

    reset_peak(s.device)
    t0 = time.perf_counter()
    if art not in sessions:
        sessions.clear()
        gc.collect()
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
    row["speed"] = []
    for B in s.batches:
        sp = session_speed(sess, prompts_for(stream, B, s.prompt_len), s.new_tokens, rung.mtp, s.warmup)
        outs = sp.pop("outputs")
        if rung.mtp == 0:
            base_tokens[(art, B)] = outs
        elif (art, B) in base_tokens:
            sp["greedy_equal_k0"] = outs == base_tokens[(art, B)]
        row["speed"].append(sp)
    if rung.mtp:
        B = max(s.batches)
        row["acceptance"] = mtp_acceptance(sess, prompts_for(stream, B, s.prompt_len), s.new_tokens, rung.mtp)
        row["acceptance_note"] = f"greedy, batch {B}, {s.new_tokens} new tokens per held-out prompt"
    row["memory"] = memory(s.device)


def sess_mode(sess) -> str:
    ex = next(iter(sess.executors.values()), None)
    return "off" if ex is None else {"graphs": "piecewise"}.get(ex.mode, ex.mode)


# ---- the slice (GPU) ------------------------------------------------------------------------------
def run_slice(a, out_dir: Path) -> dict:
    """bench_segments on the v4-flash-slice (its own JSON), then eager module vs torch.compile."""
    import bench_segments

    res: dict = {}
    path = out_dir / "bench_segments.json"
    t0 = time.perf_counter()
    try:
        bench_segments.main(["--out", str(path), "--steps", str(a.steps), "--batches", *map(str, a.slice_batches),
                             "--prompt", str(a.slice_prompt)])
        res["segments"] = json.loads(path.read_text())
    except Exception as e:  # noqa: BLE001 - the ladder's results still count
        res["segments_error"] = f"{type(e).__name__}: {_short(e)}"
    res["segments_s"] = time.perf_counter() - t0
    gc.collect()
    torch.cuda.empty_cache()
    if a.no_compile:
        res["torch_compile"] = {"skipped": "--no-compile"}
    else:
        res["torch_compile"] = slice_torch_compile(a)
    return res


class _Timeout(Exception):
    pass


def slice_torch_compile(a) -> dict:
    """Eager reference module vs torch.compile of it, decode step on the slice at batch 1 and 8."""
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
        old = signal.signal(signal.SIGALRM, lambda *_: (_ for _ in ()).throw(_Timeout()))
        signal.alarm(int(a.compile_limit))
        t0 = time.perf_counter()
        try:
            for B in out["batches"]:
                out[f"compile_ms_b{B}"] = timed(compiled, B)
                out[f"compile_speedup_b{B}"] = out[f"eager_ms_b{B}"] / out[f"compile_ms_b{B}"]
            out["compile_s"] = time.perf_counter() - t0
        except _Timeout:
            out["failed"] = f"time limit {a.compile_limit}s reached (compile + {a.steps} steps per batch)"
        except Exception as e:  # noqa: BLE001 - "failed: reason" is the result
            out["failed"] = f"{type(e).__name__}: {_short(e)}"
        finally:
            signal.alarm(0)
            signal.signal(signal.SIGALRM, old)
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
    try:
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT,
                             check=False).stdout
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                               text=True, cwd=ROOT, check=False).stdout.strip()
        return (sha.strip() or "unknown") + ("+dirty" if dirty else "")
    except OSError:
        return "unknown"


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
    ap.add_argument("--no-compile", action="store_true", help="CUDA: skip torch.compile of the eager reference")
    ap.add_argument("--compile-limit", type=float, default=90, help="seconds for torch.compile + its timed steps")
    ap.add_argument("--budget-s", type=float, default=480,
                    help="CUDA: wall-clock budget; the slice and torch.compile parts are skipped when it runs out")
    ap.add_argument("--steps", type=int, default=10, help="slice decode steps per batch (first 3 warm-up)")
    ap.add_argument("--slice-batches", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--slice-prompt", type=int, default=1024)
    return ap.parse_args(argv)


def main(argv=None) -> dict:
    a = parse(argv)
    s = settings_for(a.device, a.quick, a)
    if s.windows > s.max_batch or s.tail >= s.window:
        raise SystemExit("--windows must be <= the largest batch and --tail < --window")
    a.out_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    res = {"date": time.strftime("%Y-%m-%d"), "commit": _commit(), "torch": torch.__version__,
           "device": torch.cuda.get_device_name() if s.device.startswith("cuda") else f"cpu ({os.cpu_count()} cores)",
           "settings": dataclasses.asdict(s), "pipeline": pipeline_names(), "format_option": format_option(),
           "command": "python examples/compare_passes.py " + " ".join(sys.argv[1:] if argv is None else argv)}
    tmp = None
    work = a.work_dir
    if work is None:
        tmp = tempfile.TemporaryDirectory(prefix="dsv4c-ladder-")
        work = Path(tmp.name)
    try:
        res["ladder"] = run_ladder(s, work)
    finally:
        if tmp is not None:
            tmp.cleanup()
    write(res, a.out_dir, t0, quiet=s.device.startswith("cuda") and not a.no_slice)  # kept if the slice overruns
    if s.device.startswith("cuda") and not a.no_slice:
        left = a.budget_s - (time.perf_counter() - t0)
        if left < 150:
            res["slice"] = {"skipped": f"time budget: {left:.0f} s of --budget-s {a.budget_s:.0f} left"}
        else:
            reason = None
            if not a.no_compile and left < 150 + a.compile_limit + 60:
                a.no_compile, reason = True, f"time budget ({left:.0f} s left before the slice)"
            res["slice"] = run_slice(a, a.out_dir)
            if reason:
                res["slice"]["torch_compile"] = {"skipped": reason}
        write(res, a.out_dir, t0)
    return res


def write(res: dict, out_dir: Path, t0: float, quiet: bool = False) -> None:
    """results.md / results.json / plots from what has been measured so far."""
    res["seconds"] = time.perf_counter() - t0
    res["plots"] = plots(res, out_dir)
    md = render(res)
    if not quiet:
        print(md)
    (out_dir / "results.md").write_text(md + "\n")
    (out_dir / "results.json").write_text(json.dumps(_strip(res), indent=1, default=str) + "\n")


def render(res: dict) -> str:
    s = res["settings"]
    head = [f"## Lowering ladder: {BUNDLE.name}, {res['device']}", "",
            (f"{res['date']}, commit {res['commit']}, torch {res['torch']}; total {res['seconds']:.0f} s "
             f"(compiles {res['ladder']['compile_wall_s']:.0f} s wall, {s['jobs']} in parallel)."),
            (f"Held-out: {s['windows']} windows x {s['window']} tokens (last {s['tail']} through the decode graph). "
             f"Speed: prompts of {s['prompt_len']} held-out tokens, {s['new_tokens']} greedy tokens each."), ""]
    notes = ["", "Ratios in parentheses are against the eager reference at the same batch."]
    if res.get("plots_skipped"):
        notes.append(f"Plots: {res['plots_skipped']}.")
    return "\n".join(head) + table(res) + "\n" + "\n".join(notes) + slice_table(res.get("slice", {}))


if __name__ == "__main__":
    main()
