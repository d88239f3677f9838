"""Naive vs absorbed MLA decode on the GPU: one V3-shaped attention layer over a 4K-token cache.

The model is a 1-layer V3 config with the real attention geometry (hidden 7168, 128 heads,
q_lora 1536, kv_lora 512, rope 64, nope 128, v 128) and a tiny dense FFN and vocabulary, so the
step time is the attention layer's. The same exported decode graph runs before and after
`absorb_mla`; both read a static latent cache of `--cache` rows per sequence.

Run: python examples/bench_absorb_mla.py --json out.json     (needs CUDA; bf16)
"""
from __future__ import annotations

import argparse
import copy
import json
import sys

import torch

from dsv4c import ModelConfig
from dsv4c.export import GraphSpec, export_graph, flat_caches
from dsv4c.model import build_model
from dsv4c.passes import PassContext
from dsv4c.passes.absorb_mla import absorb_mla


def layer_config() -> ModelConfig:
    v3 = ModelConfig.preset("v3")
    return v3.replace(num_hidden_layers=1, first_k_dense_replace=1, intermediate_size=256, vocab_size=1024,
                      num_nextn_predict_layers=0)


def copy_bandwidth(device) -> float:
    """Bytes/s of a 1 GiB device-to-device copy, counting read + write."""
    n = 1 << 30
    a = torch.empty(n, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    ms = time_ms(lambda: b.copy_(a), reps=20)
    return 2 * n / (ms / 1e3)


def time_ms(fn, reps: int = 30, warmup: int = 5) -> float:
    """Median of CUDA-event timings."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        torch.cuda.synchronize()
        times.append(s.elapsed_time(e))
    return sorted(times)[len(times) // 2]


def min_bytes(cfg: ModelConfig, B: int, L: int) -> int:
    """Fewest bytes one decode step must read: attention weights + the latent cache rows (bf16)."""
    D, H, Q, c, r = cfg.hidden_size, cfg.num_attention_heads, cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_rope_head_dim
    dn, dv = cfg.qk_nope_head_dim, cfg.v_head_dim
    weights = D * Q + Q * H * (dn + r) + D * (c + r) + c * H * (dn + dv) + H * dv * D
    return 2 * (weights + B * L * (c + r))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--cache", type=int, default=4096)
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA device", file=sys.stderr)
        return 2
    dev = torch.device("cuda")
    cfg = layer_config()
    torch.manual_seed(0)
    model = build_model(cfg, device=dev, dtype=torch.bfloat16)
    bw = copy_bandwidth(dev)
    results = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "cache_rows": a.cache,
               "copy_bandwidth_GBps": bw / 1e9, "rows": []}
    for B in [int(b) for b in a.batches.split(",")]:
        spec = GraphSpec("decode", n_slots=max(B, 2), max_len=a.cache)
        naive = export_graph(model, spec).module()
        absorbed = absorb_mla(export_graph(model, spec).module(), PassContext(cfg, graph_kind="decode")).graph
        absorbed.recompile()
        cache = model.new_cache(max(B, 2), max_len=a.cache)
        for lc in cache.layers:  # a full cache of real-looking rows
            for t in lc.tensors().values():
                t.normal_()
        ids = torch.randint(0, cfg.vocab_size, (B, 1), device=dev)
        slots = torch.arange(B, device=dev)
        pos0 = torch.full((B,), a.cache - 1, device=dev)
        n_real = torch.ones(B, dtype=torch.int64, device=dev)
        caches = flat_caches(cache.layers)
        outs = {}
        for name, gm in (("naive", naive), ("absorbed", absorbed)):
            outs[name] = gm(ids, slots, pos0, n_real, copy.deepcopy(caches))[0].float()
        ms = {name: time_ms(lambda gm=gm: gm(ids, slots, pos0, n_real, caches)) for name, gm in
              (("naive", naive), ("absorbed", absorbed))}
        roof = min_bytes(cfg, B, a.cache) / bw * 1e3
        diff = (outs["naive"] - outs["absorbed"]).abs().max().item() / outs["naive"].abs().max().item()
        row = {"batch": B, "naive_ms": ms["naive"], "absorbed_ms": ms["absorbed"],
               "speedup": ms["naive"] / ms["absorbed"], "roofline_ms": roof,
               "naive_vs_roofline": roof / ms["naive"], "absorbed_vs_roofline": roof / ms["absorbed"],
               "rel_logit_diff": diff}
        results["rows"].append(row)
        print(json.dumps(row))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
