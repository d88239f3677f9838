"""Issue 26's load benchmark: `dsv4c serve` under Poisson arrivals, and `Session.generate` on the same
requests for the saturation comparison.

    # H200: the v4-flash-slice (seeded random weights in the release formats, token-id prompts), built
    # on the GPU as bench_artifact.py builds it, compiled for h200 (--build-slice; skipped if ART exists)
    python examples/bench_serve.py --build-slice --artifact /tmp/slice.h200 --launch --rates 4,16,64,inf \
        --num-prompts 256 --input-len 256 --output-len 128 --baseline --out $OUT/serve
    # CPU smoke run with the bundled model
    python examples/bench_serve.py --artifact ART --launch --rates 2,inf --num-prompts 16 --input-len 16 \
        --output-len 8 --baseline --out /tmp/serve_smoke

For each rate (requests/s; `inf` sends all at t=0, i.e. saturation) the client sends `--num-prompts`
streaming /v1/completions requests with token-id prompts, arrival gaps drawn from an exponential
distribution (a Poisson process, seeded), and records per request the time to first token (TTFT), the
time per output token after the first (TPOT), the end-to-end latency and the tokens (`return_token_ids`,
so counts are exact). It reports request and output-token throughput, TTFT/TPOT/e2e p50/p90/p99 and
goodput (requests/s meeting --slo-ttft and --slo-tpot), writes JSON and a plot.

Workloads: prompt lengths uniform in input_len·[1-r, 1+r] (`--input-range r`; 0: fixed), output lengths
likewise (`--output-range`); `--shared-prefix P --prefix-groups G`: every prompt starts with one of G
random P-token prefixes (the prefix-caching workload). Prompts are random token ids (the slice has no
tokenizer) from a seeded generator; eos may end a request early (counted as generated).

`--baseline` then runs `Session.generate` in this process on the same prompts, all at once, with the
server stopped first (one GPU): output tokens/s at saturation, and the server's `inf` rate against it
(issue 26: >= 90%). With varying output lengths, generate runs once per distinct length (all at once
each) and the times add up.

Legend: P prompt tokens, S output tokens, r relative range.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx


@dataclass
class Req:
    prompt: list[int]
    max_tokens: int


@dataclass
class Result:
    ok: bool
    status: int = 0
    ttft: float | None = None
    e2e: float | None = None
    tokens: int = 0
    token_times: list[float] = field(default_factory=list)
    error: str | None = None

    @property
    def tpot(self) -> float | None:
        if self.tokens < 2 or self.ttft is None:
            return None
        return (self.e2e - self.ttft) / (self.tokens - 1)


def make_requests(n: int, vocab: int, input_len: int, input_range: float, output_len: int, output_range: float,
                  shared_prefix: int, prefix_groups: int, seed: int, lo_id: int = 3) -> list[Req]:
    rng = random.Random(seed)

    def length(mean: int, r: float) -> int:
        return max(1, rng.randint(int(mean * (1 - r)), int(mean * (1 + r)))) if r else mean

    prefixes = [[rng.randrange(lo_id, vocab) for _ in range(shared_prefix)] for _ in range(max(prefix_groups, 1))]
    reqs = []
    for i in range(n):
        body = [rng.randrange(lo_id, vocab) for _ in range(length(input_len, input_range))]
        pre = prefixes[i % len(prefixes)] if shared_prefix else []
        reqs.append(Req(pre + body, length(output_len, output_range)))
    return reqs


def percentiles(xs: list[float]) -> dict:
    if not xs:
        return {"p50": None, "p90": None, "p99": None, "mean": None}
    s = sorted(xs)

    def q(p):
        return s[min(len(s) - 1, max(0, math.ceil(p / 100 * len(s)) - 1))]

    return {"p50": q(50), "p90": q(90), "p99": q(99), "mean": statistics.fmean(s)}


async def one(client: httpx.AsyncClient, model: str, req: Req, temperature: float, seed: int) -> Result:
    body = {"model": model, "prompt": req.prompt, "max_tokens": req.max_tokens, "temperature": temperature,
            "seed": seed, "stream": True, "return_token_ids": True}
    t0 = time.perf_counter()
    res = Result(ok=False)
    try:
        async with client.stream("POST", "/v1/completions", json=body) as r:
            res.status = r.status_code
            if r.status_code != 200:
                res.error = (await r.aread()).decode()[:300]
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    res.error = chunk["error"]["message"]
                    return res
                n = sum(len(c.get("token_ids") or []) for c in chunk.get("choices", []))
                if n:
                    now = time.perf_counter() - t0
                    res.ttft = res.ttft if res.ttft is not None else now
                    res.token_times += [now] * n
                    res.tokens += n
        res.e2e = time.perf_counter() - t0
        res.ok = True
    except httpx.HTTPError as e:
        res.error = f"{type(e).__name__}: {e}"
    return res


async def run_rate(url: str, model: str, reqs: list[Req], rate: float, temperature: float, seed: int,
                   api_key: str | None) -> tuple[list[Result], float]:
    rng = random.Random(seed + 1)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=httpx.Timeout(3600), limits=limits) as c:
        tasks = []
        t0 = time.perf_counter()
        for i, req in enumerate(reqs):
            tasks.append(asyncio.create_task(one(c, model, req, temperature, seed + i)))
            if math.isfinite(rate):
                await asyncio.sleep(rng.expovariate(rate))
        results = await asyncio.gather(*tasks)
        return list(results), time.perf_counter() - t0


def summarize(results: list[Result], seconds: float, rate: float, slo_ttft: float, slo_tpot: float) -> dict:
    ok = [r for r in results if r.ok]
    good = [r for r in ok if r.ttft <= slo_ttft and (r.tpot is None or r.tpot <= slo_tpot)]
    out_tokens = sum(r.tokens for r in ok)
    return {"rate": "inf" if not math.isfinite(rate) else rate, "requests": len(results), "ok": len(ok),
            "failed": len(results) - len(ok), "errors": sorted({r.error for r in results if r.error})[:5],
            "seconds": seconds, "request_throughput": len(ok) / seconds, "output_tokens": out_tokens,
            "output_throughput": out_tokens / seconds, "goodput": len(good) / seconds,
            "ttft_s": percentiles([r.ttft for r in ok]), "tpot_s": percentiles([r.tpot for r in ok if r.tpot]),
            "e2e_s": percentiles([r.e2e for r in ok])}


def baseline(art: str, reqs: list[Req], temperature: float, seed: int, device: str | None) -> dict:
    """Session.generate on the same prompts, all at once (one call per distinct output length)."""
    import torch

    from dsv4c.runtime import Session

    sess = Session.load(art, device=device or ("cuda" if torch.cuda.is_available() else "cpu"))
    sess.generate([reqs[0].prompt], max_new_tokens=2)  # warm-up: graph capture
    by_len: dict[int, list[list[int]]] = {}
    for r in reqs:
        by_len.setdefault(r.max_tokens, []).append(r.prompt)
    tokens, seconds = 0, 0.0
    for n, prompts in sorted(by_len.items()):
        sync = torch.cuda.synchronize if sess.device.type == "cuda" else (lambda: None)
        sync()
        t0 = time.perf_counter()
        out = sess.generate(prompts, max_new_tokens=n, temperature=temperature, seed=seed)
        sync()
        seconds += time.perf_counter() - t0
        tokens += sum(len(r.tokens) for r in out)
    return {"output_tokens": tokens, "seconds": seconds, "output_throughput": tokens / seconds,
            "request_throughput": len(reqs) / seconds}


def build_slice(art: Path, preset: str, max_batch: int, max_tokens: int, out: Path) -> dict:
    """The preset built on the GPU with seeded random weights rounded to the release formats, written as
    a release checkpoint next to ART, then `dsv4c compile --target h200` (bench_artifact.py's recipe)."""
    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_artifact import round_to_release_
    from bench_segments import build

    from dsv4c.checkpoint import save_checkpoint

    t0 = time.perf_counter()
    ckpt = art.with_name(art.name + ".ckpt")
    model = build(preset, torch.device("cuda"), torch.bfloat16)
    round_to_release_(model)
    save_checkpoint(model, ckpt, quant="release", overwrite=True)
    del model
    torch.cuda.empty_cache()
    t1 = time.perf_counter()
    cmd = [sys.executable, "-m", "dsv4c", "compile", str(ckpt), "--target", "h200", "-o", str(art), "--force",
           "--max-batch", str(max_batch), "--max-tokens", str(max_tokens)]
    with open(out / "compile.log", "w") as f:
        if subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT).returncode:
            raise SystemExit(f"{' '.join(cmd)} failed: see {out / 'compile.log'}")
    return {"build_and_write_s": t1 - t0, "compile_s": time.perf_counter() - t1, "compile_command": " ".join(cmd[2:])}


def launch(art: str, port: int, args) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "dsv4c", "serve", art, "--port", str(port), "--max-waiting",
           str(args.max_waiting), "--mtp", args.mtp, "--log-level", "warning"]
    if args.device:
        cmd += ["--device", args.device]
    log = open(Path(args.out) / "server.log", "w")
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)


def wait_healthy(url: str, proc: subprocess.Popen | None, timeout: float = 1800) -> None:
    t0 = time.time()
    while time.time() - t0 < timeout:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode} (see server.log)")
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise TimeoutError(f"{url}/health not 200 after {timeout:.0f} s")


def plot(runs: list[dict], base: dict | None, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    finite = [r for r in runs if r["rate"] != "inf"]
    xs = [r["rate"] for r in finite]
    fig, ax = plt.subplots(1, 3, figsize=(15, 4.2))
    ax[0].plot(xs, [r["output_throughput"] for r in finite], "o-", label="server")
    sat = [r for r in runs if r["rate"] == "inf"]
    if sat:
        ax[0].axhline(sat[0]["output_throughput"], ls="--", c="C0", label="server, all at once")
    if base:
        ax[0].axhline(base["output_throughput"], ls=":", c="k", label="Session.generate, all at once")
    ax[0].set(xlabel="request rate (req/s)", ylabel="output tokens/s", title="throughput")
    for i, key in ((1, "ttft_s"), (2, "tpot_s")):
        for p in ("p50", "p90", "p99"):
            ax[i].plot(xs, [(r[key][p] or 0) * 1e3 for r in finite], "o-", label=p)
        ax[i].set(xlabel="request rate (req/s)", ylabel="ms", title=key.split("_")[0].upper())
    for a in ax:
        if len(xs) > 1 and max(xs) / min(xs) >= 8:
            a.set_xscale("log")
        a.grid(alpha=0.3)
        a.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--artifact", required=True, help="the artifact (its manifest gives vocab and limits)")
    ap.add_argument("--url", default=None, help="a running server (default with --launch: start one)")
    ap.add_argument("--launch", action="store_true", help="start `dsv4c serve ART` on a free port")
    ap.add_argument("--model", default=None, help="served model name (default: the artifact folder's name)")
    ap.add_argument("--api-key", default=os.environ.get("DSV4C_API_KEY"))
    ap.add_argument("--rates", default="1,4,16,inf", help="requests/s, comma-separated; inf = all at once")
    ap.add_argument("--num-prompts", type=int, default=128)
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--input-range", type=float, default=0.0)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--output-range", type=float, default=0.0)
    ap.add_argument("--shared-prefix", type=int, default=0)
    ap.add_argument("--prefix-groups", type=int, default=1)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--slo-ttft", type=float, default=2.0, help="goodput: TTFT at most this (s)")
    ap.add_argument("--slo-tpot", type=float, default=0.05, help="goodput: TPOT at most this (s)")
    ap.add_argument("--baseline", action="store_true", help="then Session.generate on the same requests")
    ap.add_argument("--max-waiting", type=int, default=100000)
    ap.add_argument("--mtp", default="0")
    ap.add_argument("--device", default=None)
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--build-slice", action="store_true", help="build and compile --preset into --artifact first "
                    "(GPU; skipped when the artifact exists)")
    ap.add_argument("--preset", default="v4-flash-slice")
    ap.add_argument("--max-batch", type=int, default=64, help="--build-slice: the artifact's max_batch")
    ap.add_argument("--max-tokens", type=int, default=1024, help="--build-slice: the artifact's max_tokens")
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    built = None
    if a.build_slice and not (Path(a.artifact) / "manifest.json").is_file():
        built = build_slice(Path(a.artifact), a.preset, a.max_batch, a.max_tokens, a.out)
        print(f"built and compiled {a.preset}: {built}", flush=True)

    m = json.loads((Path(a.artifact) / "manifest.json").read_text())
    vocab, limit = m["model_config"]["vocab_size"], m["limits"]["max_tokens"]
    reqs = make_requests(a.num_prompts, vocab, a.input_len, a.input_range, a.output_len, a.output_range,
                         a.shared_prefix, a.prefix_groups, a.seed)
    too_long = [len(r.prompt) + r.max_tokens for r in reqs if len(r.prompt) + r.max_tokens > limit]
    if too_long:
        raise SystemExit(f"--input-len/--output-len: {len(too_long)} requests need up to {max(too_long)} tokens, "
                         f"over the artifact's max_tokens={limit}")
    model = a.model or Path(a.artifact).resolve().name
    rates = [float(x) for x in a.rates.split(",")]
    res = {"args": {k: str(v) for k, v in vars(a).items()}, "artifact_limits": m["limits"], "runs": [],
           "built": built}
    proc, url = None, a.url
    if a.launch:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        url = f"http://127.0.0.1:{port}"
        proc = launch(a.artifact, port, a)
    if url is None:
        raise SystemExit("give --url or --launch")
    try:
        t0 = time.time()
        wait_healthy(url, proc)
        res["server_ready_s"] = time.time() - t0
        # one warm-up request outside the measurement
        asyncio.run(run_rate(url, model, reqs[:1], math.inf, a.temperature, a.seed, a.api_key))
        for rate in rates:
            results, secs = asyncio.run(run_rate(url, model, reqs, rate, a.temperature, a.seed, a.api_key))
            s = summarize(results, secs, rate, a.slo_ttft, a.slo_tpot)
            res["runs"].append(s)
            print(f"rate {s['rate']}: {s['ok']}/{s['requests']} ok, {s['output_throughput']:.1f} tok/s, "
                  f"{s['request_throughput']:.2f} req/s, goodput {s['goodput']:.2f} req/s, TTFT p50/p99 "
                  f"{_ms(s['ttft_s']['p50'])}/{_ms(s['ttft_s']['p99'])} ms, TPOT p50/p99 "
                  f"{_ms(s['tpot_s']['p50'])}/{_ms(s['tpot_s']['p99'])} ms", flush=True)
            (a.out / "bench_serve.json").write_text(json.dumps(res, indent=1))
        res["server_metrics"] = httpx.get(f"{url}/metrics").text
    finally:
        if proc is not None:
            proc.terminate()
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
    base = None
    if a.baseline:
        base = res["baseline_session_generate"] = baseline(a.artifact, reqs, a.temperature, a.seed, a.device)
        sat = [r for r in res["runs"] if r["rate"] == "inf"]
        if sat:
            res["server_over_generate_at_saturation"] = sat[0]["output_throughput"] / base["output_throughput"]
        print(f"Session.generate, all at once: {base['output_throughput']:.1f} tok/s"
              + (f"; server at saturation: {res['server_over_generate_at_saturation']:.1%} of it" if sat else ""))
    (a.out / "bench_serve.json").write_text(json.dumps(res, indent=1))
    plot(res["runs"], base, a.out / "bench_serve.png")
    print(f"wrote {a.out / 'bench_serve.json'} and {a.out / 'bench_serve.png'}")
    return 0


def _ms(x) -> str:
    return "-" if x is None else f"{x * 1e3:.1f}"


if __name__ == "__main__":
    sys.exit(main())
