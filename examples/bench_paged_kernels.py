"""Issue 27: each V4 decode cache kernel against its paged (block-table) twin, at the slice's decode shapes.

    python examples/bench_paged_kernels.py --out $OUT/paged_kernels.json        # H200, about a minute
    python examples/bench_paged_kernels.py --device cpu --quick --out q.json    # interpreter smoke run, seconds

For the preset's attention config (heads, head dim, window, indexer heads / dim / top-k, compress ratios), at
batch B (64) and decode position C (4224 = 4096 shared + 128 own tokens), with caches sized as
`compile --max-tokens M` sizes them (M = 4264, as examples/bench_prefix_cache.py) and the pools cut into
blocks of b positions (default: the compile's, the smallest multiple of every compression ratio >= 16):
  attention csa   kernels/v4_attention.py, m = 4, the indexer's top-k entries (from the same keys)
  attention hca   m = 128, every visible entry
  indexer topk    kernels/v4_indexer.py: scores and selection over the CSA indexer keys
  compress csa    kernels/v4_compress.py, the CSA layer's compressor (m = 4, width d); groups close
  compress idx    the CSA indexer's compressor (m = 4, width dI)
  compress hca    m = 128, width d
The compressors run at position P = the last one < C that closes a group of every ratio (4223), so each
call writes an entry (the only place the paged path differs); the others run at C.
Both sides hold the same rows: the pool holds each slot's rows in its blocks, table rows laid out as
  private  each row its own blocks, shuffled over the pool (nothing shared)
  shared   the first ⌊4096 / b⌋ blocks the same for every row (prefix sharing, as bench_prefix_cache's
           paged_on / paged_warm); the slot caches hold the same rows as copies
and each pair's results are compared (`same`: bit-identical, as the kernels read the same rows in the same
order; else `rel_diff`; the exit status is 1 above 1e-5). Timing (CUDA): a CUDA graph of --reps back-to-back
calls, each after a write of 2x the L2 (the decode step streams the expert weights between two layers'
attention), replayed --iters times, each replay timed with CUDA events; the median replay minus the median of
the same graph without the calls, per call, in µs.
--no-flush times calls back to back (warm L2). The CPU run (--quick: tiny shapes) checks `same` only.

Legend: B batch rows, C decode position, M max tokens, b block size (positions), RB rows per block (b / m).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from functools import partial
from pathlib import Path

if "--device" in sys.argv and sys.argv[sys.argv.index("--device") + 1] == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: CPU tensors run the interpreter

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_segments import _commit  # noqa: E402

from dsv4c import ModelConfig  # noqa: E402
from dsv4c.kernels.v4_attention import v4_attention_fused  # noqa: E402
from dsv4c.kernels.v4_compress import v4_compress_fused  # noqa: E402
from dsv4c.kernels.v4_indexer import v4_indexer_topk_fused  # noqa: E402
from dsv4c.runtime.prefix_cache import default_block_size  # noqa: E402

KERNELS = ("attention csa", "attention hca", "indexer topk", "compress csa", "compress idx", "compress hca")
LAYOUTS = ("private", "shared")
TOL = 1e-5  # paged vs slot results (exit status 1 above it): the kernels' bf16 target; equal in practice


def dims(cfg: ModelConfig, quick: bool) -> dict:
    """The shapes of one decode step's cache kernels (--quick: tiny, for the interpreter)."""
    if quick:
        return dict(B=3, C=60, M=72, H=4, d=32, W=8, HI=4, dI=16, topk=8, rope=8, m_csa=4, m_hca=16, shared=32)
    ratios = sorted({m for m in cfg.compress_ratios if m})
    if ratios != [4, 128]:
        raise ValueError(f"{cfg.model_type}: compress ratios {ratios}; this benchmark times the V4 layout [4, 128]")
    return dict(B=64, C=4224, M=4264, H=cfg.num_attention_heads, d=cfg.head_dim, W=cfg.sliding_window,
                HI=cfg.index_n_heads, dI=cfg.index_head_dim, topk=cfg.index_topk, rope=cfg.qk_rope_head_dim,
                m_csa=4, m_hca=128, shared=4096)


class Tables:
    """Cache slots 0..B-1 (B + 1 slots, the last scratch) and a block table [B + 1, NB] into a pool of
    B·NB blocks (+1 scratch), the compile's default pool, in one of LAYOUTS."""

    def __init__(self, B: int, M: int, b: int, layout: str, shared_positions: int, g: torch.Generator):
        self.B, self.M, self.b, self.NB = B, M, b, -(-M // b)
        self.N = B * self.NB
        perm = torch.randperm(self.N, generator=g)
        table = torch.full((B + 1, self.NB), self.N, dtype=torch.int64)
        table[:B] = perm.view(B, self.NB)
        self.n_shared = shared_positions // b if layout == "shared" else 0
        table[:B, : self.n_shared] = table[0, : self.n_shared]  # every row: row 0's first blocks
        self.table = table
        self.slots = torch.randperm(B, generator=g)  # distinct, shuffled, never the scratch slot

    def rows(self, m: int, width: int, dtype, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """(slot cache [B + 1, ⌈M/m⌉, width], pool [N + 1, b/m, width]) holding the same rows; rows of the
        shared blocks are equal in every slot (copies in the slot cache, one block in the pool)."""
        RB = self.b // m
        E = self.NB * RB
        rows = torch.randn(self.B + 1, E, width, generator=g)
        rows[:, : self.n_shared * RB] = rows[0, : self.n_shared * RB]
        pool = torch.randn(self.N + 1, RB, width, generator=g)  # unused blocks hold garbage
        pool[self.table[: self.B]] = rows[: self.B].view(self.B, self.NB, RB, width)
        E_slot = -(-self.M // m)  # the slot caches' capacity (V4Model.new_cache), <= E
        return rows[:, :E_slot].to(dtype).contiguous(), pool.to(dtype)


def rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """0.0 when bit-identical, else ||a - b|| / ||a||."""
    if torch.equal(a, b):
        return 0.0
    return ((a.float() - b.float()).norm() / a.float().norm().clamp_min(1e-30)).item()


def slot_rows(pool: torch.Tensor, table: torch.Tensor, n: int) -> torch.Tensor:
    """The first n logical rows of every real slot, read from the pool: [slots - 1, n, width]."""
    return pool[table[:-1]].flatten(1, 2)[:, :n]


def cases(D: dict, layout: str, b: int, dev, dtype, seed: int = 0) -> dict:
    """name -> (slot call, paged call, diff: () -> relative difference of their results) over the same rows."""
    g = torch.Generator().manual_seed(seed)
    B, C, M, H, d, W = D["B"], D["C"], D["M"], D["H"], D["d"], D["W"]
    tb = Tables(B, M, b, layout, D["shared"], g)
    to = lambda x: x.to(dev)  # noqa: E731
    slots, table = to(tb.slots), to(tb.table)
    pos_c = torch.full((B,), C, dtype=torch.int64, device=dev)
    n_real = torch.ones(B, dtype=torch.int64, device=dev)
    out: dict = {}

    # indexer top-k over the CSA indexer keys (its output also feeds the CSA attention)
    keys, kpool = (to(x) for x in tb.rows(D["m_csa"], D["dI"], dtype, g))
    iq = to(torch.randn(B, 1, D["HI"], D["dI"], generator=g).to(dtype))
    iw = to(torch.randn(B, 1, D["HI"], generator=g))
    topk = partial(v4_indexer_topk_fused, iq, iw)
    slot_idx = partial(topk, keys, slots, pos_c, D["topk"], D["m_csa"])
    paged_idx = partial(topk, kpool, slots, pos_c, D["topk"], D["m_csa"], block_table=table)
    sel = slot_idx()
    out["indexer topk"] = (slot_idx, paged_idx, lambda: 0.0 if torch.equal(sel, paged_idx()) else float("inf"))

    # attention: CSA with the indexer's selection, HCA over every visible entry (ring rows written: the same)
    q = to(torch.randn(B, 1, H, d, generator=g).to(dtype))
    kv = to(torch.randn(B, 1, d, generator=g).to(dtype))
    ring = to(torch.randn(B + 1, W, d, generator=g).to(dtype))
    sinks = to(torch.randn(H, generator=g))
    attn = partial(v4_attention_fused, q, kv, slots, pos_c, n_real)
    for name, m, selected in (("attention csa", D["m_csa"], sel), ("attention hca", D["m_hca"], None)):
        ent, pool = (to(x) for x in tb.rows(m, d, dtype, g))
        slot_call = partial(attn, ring.clone(), sinks, ent, selected, W, m)
        paged_call = partial(attn, ring.clone(), sinks, pool, selected, W, m, block_table=table)
        out[name] = (slot_call, paged_call, lambda s=slot_call, p=paged_call: rel_diff(s(), p()))

    # compressors at the last position < C that closes a group of every ratio
    P = (C // D["m_hca"]) * D["m_hca"] - 1
    pos_p = torch.full((B,), P, dtype=torch.int64, device=dev)
    invf = to(torch.rand(D["rope"] // 2, generator=g))
    for name, m, w in (("compress csa", D["m_csa"], d), ("compress idx", D["m_csa"], D["dI"]),
                       ("compress hca", D["m_hca"], d)):
        c = 2 if m == 4 else 1
        ent, pool = (to(x) for x in tb.rows(m, w, dtype, g))
        x, sc = to(torch.randn(B, 1, c * w, generator=g)), to(torch.randn(B, 1, c * w, generator=g))
        ape, nw = to(torch.randn(m, c * w, generator=g)), to(torch.randn(w, generator=g))
        st = to(torch.randn(B + 1, c * m, c * w, generator=g))
        comp = partial(v4_compress_fused, x, sc, slots, pos_p, n_real, ape, nw, invf)

        def diff(ent=ent, pool=pool, st=st, comp=comp, m=m):
            e, p, s1, s2 = ent.clone(), pool.clone(), st.clone(), st.clone()
            comp(s1, s1.clone(), e, m, 1e-6)
            comp(s2, s2.clone(), p, m, 1e-6, block_table=table)
            return max(rel_diff(e[:-1], slot_rows(p, table, e.shape[1])), rel_diff(s1[:-1], s2[:-1]))

        out[name] = (partial(comp, st.clone(), st.clone(), ent.clone(), m, 1e-6),
                     partial(comp, st.clone(), st.clone(), pool.clone(), m, 1e-6, block_table=table), diff)
    return out


def time_us(call, reps: int, iters: int, flush: torch.Tensor | None) -> float:
    """Median µs per call (module doc): graphs of reps x (flush, call) and of reps x flush, replay medians."""
    call()
    torch.cuda.synchronize()

    def replay_ms(with_call: bool) -> float:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(reps):
                if flush is not None:
                    flush.add_(1)
                if with_call:
                    call()
        g.replay()
        torch.cuda.synchronize()
        ms = []
        for _ in range(iters):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            g.replay()
            b.record()
            b.synchronize()
            ms.append(a.elapsed_time(b))
        del g
        return statistics.median(ms)

    base = replay_ms(False) if flush is not None else 0.0
    return (replay_ms(True) - base) * 1e3 / reps


def table_md(rows: list[dict]) -> str:
    lines = ["| kernel | layout | slot µs | paged µs | paged / slot | same |", "|---|---|---:|---:|---:|---|"]
    for r in rows:
        t = (f"{r['slot_us']:.2f} | {r['paged_us']:.2f} | {r['ratio']:.3f}" if "slot_us" in r else "- | - | -")
        lines.append(f"| {r['kernel']} | {r['layout']} | {t} | {r['same']} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="v4-flash-slice")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--block-size", type=int, default=None, help="positions per block (default: the compile's)")
    ap.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=LAYOUTS)
    ap.add_argument("--kernels", nargs="+", default=list(KERNELS), choices=KERNELS)
    ap.add_argument("--reps", type=int, default=20, help="calls per CUDA graph")
    ap.add_argument("--iters", type=int, default=30, help="timed replays (median)")
    ap.add_argument("--no-flush", action="store_true", help="no L2 flush between calls")
    ap.add_argument("--quick", action="store_true", help="tiny shapes (CPU interpreter smoke run, no timing)")
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args(argv)
    dev = torch.device(a.device)
    cuda = dev.type == "cuda"
    t0 = time.perf_counter()
    cfg = ModelConfig.preset(a.preset)
    D = dims(cfg, a.quick)
    b = a.block_size or (16 if a.quick else default_block_size(cfg))
    dtype = torch.bfloat16 if cuda else torch.float32
    res: dict = {"preset": a.preset, "device": torch.cuda.get_device_name(dev) if cuda else "cpu",
                 "torch": torch.__version__, "commit": _commit(), "dims": D, "block_size": b,
                 "dtype": str(dtype), "flush_l2": cuda and not a.no_flush, "reps": a.reps, "iters": a.iters, "rows": []}
    flush = None
    if cuda and not a.no_flush:
        flush = torch.zeros(2 * torch.cuda.get_device_properties(dev).L2_cache_size // 4, dtype=torch.int32, device=dev)
    for layout in a.layouts:
        cs = cases(D, layout, b, dev, dtype)
        for name in a.kernels:
            slot_call, paged_call, diff = cs[name]
            err = diff()
            row = {"kernel": name, "layout": layout, "same": err == 0.0, "rel_diff": err}
            if cuda:
                row["slot_us"] = time_us(slot_call, a.reps, a.iters, flush)
                row["paged_us"] = time_us(paged_call, a.reps, a.iters, flush)
                row["ratio"] = row["paged_us"] / row["slot_us"]
            res["rows"].append(row)
            print(json.dumps(row), flush=True)
            a.out.write_text(json.dumps(res, indent=1))
        del cs
    if cuda:
        per_step = {}  # one decode step of the slice: CSA layers x (attention, indexer, 2 compressors), HCA layers
        n_csa = sum(1 for m in cfg.compress_ratios[: cfg.num_hidden_layers] if m == 4)
        n_hca = sum(1 for m in cfg.compress_ratios[: cfg.num_hidden_layers] if m == 128)
        count = {"attention csa": n_csa, "indexer topk": n_csa, "compress csa": n_csa, "compress idx": n_csa,
                 "attention hca": n_hca, "compress hca": n_hca}
        for layout in a.layouts:
            rows = [r for r in res["rows"] if r["layout"] == layout and r["kernel"] in count]
            slot = sum(count[r["kernel"]] * r["slot_us"] for r in rows)
            paged = sum(count[r["kernel"]] * r["paged_us"] for r in rows)
            per_step[layout] = {"slot_us": slot, "paged_us": paged, "extra_us": paged - slot}
        res["per_step"] = per_step
    res["elapsed_s"] = round(time.perf_counter() - t0, 1)
    res["table"] = table_md(res["rows"])
    a.out.write_text(json.dumps(res, indent=1))
    print(res["table"])
    if "per_step" in res:
        print(json.dumps(res["per_step"], indent=1))
    return 0 if all(r["rel_diff"] <= TOL for r in res["rows"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
