"""MTP speculative decoding on the bundled trained model: acceptance per draft position and end-to-end
decode speedup against k = 0, at batch 1 / 8 / 64 and temperature 0 / 0.7 / 1.0, plus the k that
`mtp="auto"` picks in each cell (issue 8).

The model is compiled with --mtp K (default 3) for the device's target unless --art names an artifact.
Decode throughput counts generated tokens after each request's first one, over the time from the end
of admission (every request prefilled, its first token sampled and its MTP cache filled; the device
synchronised) to the end. Each cell is `--repeats` generate calls (default 3), call i on the prompts
rotated by i·batch (batch 1 decodes three different prompts), and reports total tokens / total decode
time: one prompt's continuation at one k says more about that text than about k (greedy bf16 text
differs between k, and with it the acceptance). Acceptance statistics are those of the timed calls.
The calls of a (batch, temperature) group's cells are interleaved (`run_interleaved`): call i of every
k and of auto runs before call i + 1 of any, so a slow stretch of the machine falls on every cell alike
(`--no-interleave`: each cell's calls back to back, as before); each row lists its calls' tokens/s.

`auto` runs as a user's session would: one untimed auto call first, before the group's timed calls (a
cell's first auto call calibrates the costs at that batch size and sampling mode; its wall time is
reported as `first_call_s`), then the `--repeats` timed calls in the same session, so the acceptance auto observed
in earlier calls (and its re-choices every few rounds inside a call) carry over, as they would across
a user's requests. The row lists the k each timed call started and ended with, its probes and switches.
Last in each (batch, temperature) group the k = 0 cell is timed again (`again_ratio` on its row, shown as
"again" in the table): two timings of the same cell, the noise against which a few percent are judged
(`--no-k0-again` skips it).

    python examples/bench_mtp.py --out mtp.json                    # GPU (h200 target, bf16)
    python examples/bench_mtp.py --device cpu --quick --out q.json # CPU check (fp32, small grid)
    python examples/bench_mtp.py --plot-from mtp.json --plot mtp.png  # re-plot a saved run, no GPU
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

from dsv4c.runtime.speculative import merge_spec_stats, speculator

ROOT = Path(__file__).resolve().parents[1]
BUNDLE = ROOT / "examples" / "models" / "v4-tiny-pystdlib"
PROMPTS = ["import os\nimport sys\n", "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n",
           "x = 1\ny = 2\n", "__all__ = [", "class Error(Exception):\n    pass\n\n\n",
           "if __name__ == '__main__':\n", "for i in range(10):\n", "def _check(value):\n    if value is None:\n",
           "import re\n\n_pattern = re.compile(", "    def __init__(self, name):\n        self.name = name\n"]


def compile_bundle(device: str, k: int, max_batch: int, max_tokens: int, out: Path, check: bool = True) -> Path:
    from dsv4c.compile import compile_checkpoint

    target = "h200" if device.startswith("cuda") else "cpu"
    t0 = time.perf_counter()
    compile_checkpoint(BUNDLE, out, target=target, max_tokens=max_tokens, max_batch=max_batch, mtp_k=k, progress=True,
                       verify_boundaries=None if check else False)
    print(f"compiled {BUNDLE.name} for {target} with --mtp {k} in {time.perf_counter() - t0:.0f}s", file=sys.stderr)
    return out


def run_cell(sess, prompts: list[str], n_new: int, temperature: float, mtp) -> dict:
    """One generate over `prompts`; decode tokens/s from the end of admission (Session._serve's
    on_decode hook), the outputs and each request's stats (GenerationResult.stats)."""
    t_first = None
    t0 = time.perf_counter()
    outs: dict[int, list[int]] = {i: [] for i in range(len(prompts))}

    def admitted() -> None:
        nonlocal t_first
        _sync(sess.device)
        t_first = time.perf_counter()

    reqs = sess._requests(prompts, n_new, temperature, 1.0, 0, 1, [])
    for i, tok in sess._serve(reqs, mtp, on_decode=admitted):
        outs[i].append(tok)
    _sync(sess.device)
    t_end = time.perf_counter()
    n_tok = sum(len(o) - 1 for o in outs.values())
    return {"decode_tokens": n_tok, "decode_s": t_end - (t_first or t0), "total_s": t_end - t0,
            "tokens_per_s": n_tok / max(t_end - (t_first or t0), 1e-9), "outputs": outs,
            "stats": [sess._result(r).stats for r in reqs]}


def run_repeats(sess, prompt_sets: list[list[str]], n_new: int, temperature: float, mtp) -> dict:
    """`run_cell` over each prompt set in turn, merged (`merge_calls`)."""
    return merge_calls([run_cell(sess, ps, n_new, temperature, mtp) for ps in prompt_sets], mtp)


def run_interleaved(sess, prompt_sets: list[list[str]], n_new: int, temperature: float, kinds: list) -> dict:
    """The calls of several cells interleaved: call i of every mtp setting in `kinds` runs before call i + 1
    of any, so a slow stretch of the machine (the k = 0 cell timed twice minutes apart differed by up to
    20%, run24) falls on every setting alike. -> {mtp setting: merged cell}."""
    calls: dict = {k: [] for k in kinds}
    for ps in prompt_sets:
        for k in kinds:
            calls[k].append(run_cell(sess, ps, n_new, temperature, k))
    return {k: merge_calls(c, k) for k, c in calls.items()}


def merge_calls(cells: list[dict], mtp) -> dict:
    """Calls of one cell: total decode tokens / total decode seconds, each call's tokens/s, the outputs per
    call, the merged speculation statistics and each call's auto policy."""
    tok, sec = sum(c["decode_tokens"] for c in cells), sum(c["decode_s"] for c in cells)
    merged = merge_spec_stats([st for c in cells for st in c["stats"]]) if mtp != 0 else None
    return {"tokens_per_s": tok / max(sec, 1e-9), "decode_s": sec, "outputs": [c["outputs"] for c in cells],
            "call_tokens_per_s": [round(c["tokens_per_s"], 1) for c in cells],
            "spec": merged, "policies": [c["stats"][0].get("mtp_policy") or {} for c in cells]}


def prompt_sets(B: int, repeats: int, vocab: int | None = None) -> list[list]:
    """Call i's batch: B prompts from PROMPTS starting at i·B (cycled); with `vocab` (an artifact without a
    tokenizer, such as the random-weight slice) B prompts of 16 seeded random token ids per call instead."""
    if vocab is not None:
        g = torch.Generator().manual_seed(0)
        return [[torch.randint(0, vocab, (16,), generator=g).tolist() for _ in range(B)] for _ in range(repeats)]
    return [[PROMPTS[(i * B + j) % len(PROMPTS)] for j in range(B)] for i in range(repeats)]


def auto_row(cell: dict, first: dict, T: float, B: int, base: float, rows: list[dict]) -> dict:
    """The auto cell's row: `first` the untimed auto call (the cell's calibration on first use), `cell` the
    timed calls in the same session (see the module docstring)."""
    pol0 = first["stats"][0].get("mtp_policy") or {}
    pols = cell["policies"]
    fixed = [r for r in rows if r["batch"] == B and r["temperature"] == T and r["k"] != "auto"]
    best = max(fixed, key=lambda r: r["tokens_per_s"])
    last = pols[-1]
    return {"batch": B, "temperature": T, "k": "auto", "auto_k": last.get("k_last", last.get("k")),
            "calls_k": [[p.get("k"), p.get("k_last", p.get("k"))] for p in pols],
            "probes": sum(bool(p.get("probe")) for p in pols) + sum(
                h.get("reason") == "probe" for p in pols for h in p.get("history", [])),
            "switches": sum(h.get("reason") == "observed" for p in pols for h in p.get("history", [])),
            "tokens_per_s": round(cell["tokens_per_s"], 2), "speedup": round(cell["tokens_per_s"] / base, 3),
            "call_tokens_per_s": cell["call_tokens_per_s"],
            "vs_best_fixed": round(cell["tokens_per_s"] / best["tokens_per_s"], 3), "best_fixed_k": best["k"],
            "first_call_s": round(first["total_s"], 3), "first_call_k": [pol0.get("k"), pol0.get("k_last")],
            "reason": last.get("reason"), "predicted_speedup": last.get("predicted_speedup"),
            "alpha": last.get("alpha"), "step_ms": last.get("step_ms"), "step_ms_spread": last.get("step_ms_spread")}


def plot_grid(res: dict, path: str) -> None:
    """Speedup over k = 0 against batch size, one panel per temperature, one line per k; the k that
    `auto` chose in each cell is ringed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = res["rows"]
    temps = sorted({r["temperature"] for r in rows})
    ks = sorted({r["k"] for r in rows if r["k"] != "auto"})
    fig, axes = plt.subplots(1, len(temps), figsize=(4 * len(temps), 3.6), squeeze=False, sharey=True)
    for ax, T in zip(axes[0], temps):
        cells = [r for r in rows if r["temperature"] == T]
        for k in ks:
            pts = sorted((r["batch"], r["speedup"]) for r in cells if r["k"] == k)
            ax.plot([b for b, _ in pts], [v for _, v in pts], marker="o", label=f"k={k}")
            chosen = [(r["batch"], r["speedup"]) for r in cells if r["k"] == k
                      and any(a["k"] == "auto" and a["batch"] == r["batch"] and a["auto_k"] == k for a in cells)]
            if chosen:
                ax.scatter(*zip(*chosen), s=160, facecolors="none", edgecolors="black")
        ax.axhline(1.0, color="grey", lw=0.8, ls="--")
        ax.set_xscale("log", base=2)
        ax.set_title(f"temperature {T}")
        ax.set_xlabel("batch")
    axes[0][0].set_ylabel("decode speedup vs k=0")
    axes[0][0].legend(title="ringed: auto's k", fontsize=8)
    fig.suptitle(f"MTP on {Path(res.get('artifact', '')).name or 'the bundled model'}, {res.get('gpu') or res.get('device')}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--art", help="artifact compiled with --mtp K (default: compile the bundled model)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--k", type=int, default=3, help="K to compile with (the largest k measured)")
    ap.add_argument("--batches", default=None, help="comma list (default 1,8,64; --quick 1,2)")
    ap.add_argument("--temperatures", default=None, help="comma list (default 0,0.7,1.0; --quick 0,1.0)")
    ap.add_argument("--new-tokens", type=int, default=None, help="tokens per request (default 128; --quick 12)")
    ap.add_argument("--quick", action="store_true", help="small grid, for a CPU check")
    ap.add_argument("--no-auto", action="store_true", help="skip the mtp='auto' decision per cell")
    ap.add_argument("--repeats", type=int, default=3,
                    help="timed generate calls per cell, each on other prompts (see the module docstring)")
    ap.add_argument("--out", help="write the results as JSON here")
    ap.add_argument("--plot", help="also plot speedup vs batch per temperature to this PNG")
    ap.add_argument("--plot-from", help="plot a saved --out JSON to --plot and exit")
    ap.add_argument("--graphs", default=None, help="Session graph mode (default: full on a GPU, off on a CPU)")
    ap.add_argument("--round-graphs", choices=["default", "off", "graphs", "emulate"], default="default",
                    help="how pipelined MTP rounds run (Speculator.round_mode): one CUDA graph per round (graphs, the "
                         "default where every graph runs whole-step), or op by op (off), for comparison")
    ap.add_argument("--no-interleave", action="store_true",
                    help="time each cell's calls back to back (the earlier harness) instead of interleaving the "
                         "calls of a group's cells (`run_interleaved`)")
    ap.add_argument("--no-k0-again", action="store_true",
                    help="skip timing each group's k = 0 cell a second time after its other cells (again_ratio: "
                         "the cell-to-cell noise at this length, against which 'within 3%%' is judged)")
    ap.add_argument("--no-boundary-check", action="store_true",
                    help="compile without the padding check at every bucket boundary (tests/test_boundary_check.py "
                         "covers it; at --batches 64 it is most of the compile time)")
    a = ap.parse_args(argv)
    if a.plot_from:
        if not a.plot:
            ap.error("--plot-from needs --plot PNG")
        plot_grid(json.loads(Path(a.plot_from).read_text()), a.plot)
        return 0
    from dsv4c.runtime import Session

    batches = [int(x) for x in (a.batches or ("1,2" if a.quick else "1,8,64")).split(",")]
    temps = [float(x) for x in (a.temperatures or ("0,1.0" if a.quick else "0,0.7,1.0")).split(",")]
    n_new = a.new_tokens or (12 if a.quick else 128)
    tmp = None
    if a.art:
        art = Path(a.art)
    else:
        tmp = tempfile.TemporaryDirectory()
        art = compile_bundle(a.device, a.k, max(max(batches), 2), 64 + n_new + a.k + 8, Path(tmp.name) / "art",
                             check=not a.no_boundary_check)
    graphs = a.graphs or ("full" if torch.device(a.device).type == "cuda" else None)
    sess = Session.load(art, device=a.device, graphs=graphs)
    K = int(sess.manifest["mtp_k"])
    spec = speculator(sess)
    if a.round_graphs != "default":
        spec.round_mode = a.round_graphs
    spec.round_graphs()  # a mode this session cannot run fails here, naming why
    ks = list(range(K + 1))
    rows = []
    t_start = time.perf_counter()

    def save() -> None:  # after every row: a run cut short keeps what it measured
        if a.out:
            Path(a.out).write_text(json.dumps({
                "device": str(sess.device), "gpu": _gpu_name(), "artifact": str(art),
                "target": sess.manifest["target"]["name"], "dtype": sess.manifest["dtype"], "mtp_k": K,
                "round_mode": spec.round_mode,
                "new_tokens": n_new, "repeats": a.repeats, "grid_wall_s": round(time.perf_counter() - t_start, 1),
                "rows": rows}, indent=1) + "\n")

    with torch.no_grad():
        for B in batches:
            sets = prompt_sets(B, a.repeats, None if sess.tokenizer is not None else sess.config.vocab_size)
            for k in ks:  # warm-up per batch, k and T (CUDA-graph capture happens here), as long as a timed call
                for T in temps:  # (a 4-token one ended in its first round, never pipelined); per T: greedy and
                    run_cell(sess, sets[0], n_new, T, k)  # sampled steps and rounds are separate graphs and samplers
            ref_outputs: list = []  # k = 0, temperature 0: the greedy reference of this batch, per call
            for T in temps:
                first = None if a.no_auto else run_cell(sess, sets[0], n_new, T, "auto")  # calibrates, untimed
                kinds = ks + ([] if a.no_auto else ["auto"])
                if a.no_interleave:
                    cells = {k: run_repeats(sess, sets, n_new, T, k) for k in kinds}
                else:
                    cells = run_interleaved(sess, sets, n_new, T, kinds)
                base = cells[0]["tokens_per_s"]
                for k in ks:
                    cell = cells[k]
                    row = {"batch": B, "temperature": T, "k": k, "tokens_per_s": round(cell["tokens_per_s"], 2),
                           "speedup": round(cell["tokens_per_s"] / base, 3), "decode_s": round(cell["decode_s"], 3),
                           "calls": a.repeats, "call_tokens_per_s": cell["call_tokens_per_s"],
                           "interleaved": not a.no_interleave}
                    if k and T == 0:
                        row["greedy_equal_to_k0"] = cell["outputs"] == ref_outputs
                    if k == 0 and T == 0:
                        ref_outputs = cell["outputs"]
                    if k:
                        st = cell["spec"]
                        row.update({"alpha": st["acceptance_per_position"],
                                    "mean_accepted_length": st["mean_accepted_length"],
                                    "histogram": st["accept_histogram"], "fused_rounds": st.get("fused_rounds"),
                                    "fallback_refreshes": st.get("fallback_refreshes")})
                    rows.append(row)
                    print(json.dumps(row), file=sys.stderr)
                    save()
                if not a.no_auto:
                    rows.append(auto_row(cells["auto"], first, T, B, base, rows))
                    print(json.dumps(rows[-1]), file=sys.stderr)  # as it comes: a timeout keeps it
                    save()
                if not a.no_k0_again:  # the same k = 0 cell again, last: how far two timings of one cell differ
                    again = run_repeats(sess, sets, n_new, T, 0)["tokens_per_s"]
                    row0 = next(r for r in rows if (r["batch"], r["temperature"], r["k"]) == (B, T, 0))
                    row0.update(tokens_per_s_again=round(again, 2), again_ratio=round(again / base, 3))
                    save()
    print(table(rows, sess, art))
    save()
    if a.plot:
        plot_grid({"device": str(sess.device), "gpu": _gpu_name(), "artifact": str(art), "rows": rows}, a.plot)
    return 0


def _gpu_name() -> str | None:
    return torch.cuda.get_device_name() if torch.cuda.is_available() else None


def table(rows: list[dict], sess, art) -> str:
    def f(x, fmt="{:.2f}"):
        return "-" if x is None else fmt.format(x)

    out = [f"MTP speculative decoding, {art} on {sess.device} ({sess.manifest['dtype']}; rounds: "
           f"{speculator(sess).round_mode})", "",
           "| batch | T | k | tok/s | speedup | α per position | τ (mean accepted length) | fused / fallback rounds | greedy == k0 |",
           "|---:|---:|---:|---:|---:|---|---:|---|---|"]
    for r in rows:
        if r["k"] == "auto":
            out.append(f"| {r['batch']} | {r['temperature']} | auto → {r['auto_k']} | {r['tokens_per_s']:.1f} | "
                       f"{r['speedup']:.2f}x ({r['vs_best_fixed']:.2f}x of best k = {r['best_fixed_k']}) | "
                       f"{r['reason']} | | | |")
            continue
        alpha = ", ".join(f(x) for x in r.get("alpha", [])) or "-"
        again = f" (again: {r['again_ratio']:.2f}x)" if "again_ratio" in r else ""
        out.append(f"| {r['batch']} | {r['temperature']} | {r['k']} | {r['tokens_per_s']:.1f} | {r['speedup']:.2f}x{again} | "
                   f"{alpha} | {f(r.get('mean_accepted_length'))} | {r.get('fused_rounds', '-')} / {r.get('fallback_refreshes', '-')} | "
                   f"{r.get('greedy_equal_to_k0', '-')} |")
    return "\n".join(out)


if __name__ == "__main__":
    sys.exit(main())
