"""The `dsv4c` command line: `init` writes a random checkpoint, `info` describes a model, `compare`
reports what each lowering pass does to the logits, `generate` runs the eager reference."""
from __future__ import annotations

import argparse
import sys
import time
from collections import Counter
from pathlib import Path

import torch

from dsv4c.config import ConfigError, ModelConfig
from dsv4c.targets import TargetError

_DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16}


def _default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def _dtype(s: str) -> torch.dtype:
    if s not in _DTYPES:
        raise argparse.ArgumentTypeError(f"--dtype: expected one of {sorted(_DTYPES)}, got {s!r}")
    return _DTYPES[s]


def _human(n: float) -> str:
    for unit in ("", "K", "M", "B", "T"):
        if abs(n) < 1000:
            return f"{n:.2f}{unit}" if unit else f"{n:.0f}"
        n /= 1000
    return f"{n:.2f}P"


def cmd_init(a: argparse.Namespace) -> int:
    from dsv4c.checkpoint import write_random_checkpoint

    cfg = ModelConfig.resolve(a.config)
    t0 = time.perf_counter()
    out = write_random_checkpoint(cfg, a.output, seed=a.seed, quant=a.quant, dtype=a.dtype,
                                  max_shard_bytes=int(a.shard_gb * (1 << 30)), overwrite=a.force, progress=True)
    size = sum(f.stat().st_size for f in out.glob("*.safetensors"))
    print(f"wrote {out} ({cfg.model_type}, seed {a.seed}, quant {a.quant}): {size / 1e6:.1f} MB "
          f"in {time.perf_counter() - t0:.1f}s")
    return 0


def describe(cfg: ModelConfig) -> list[str]:
    """Human-readable summary lines, with parameter counts from a meta-device model."""
    from dsv4c.model import build_model, count_parameters

    counts = count_parameters(build_model(cfg, device="meta"))
    n = cfg.num_hidden_layers
    lines = [
        f"model_type        {cfg.model_type}",
        f"layers            {n} (+{cfg.num_nextn_predict_layers} MTP)",
        f"hidden / vocab    {cfg.hidden_size} / {cfg.vocab_size}",
        f"heads             {cfg.num_attention_heads}",
        f"experts           {cfg.n_routed_experts} routed (top-{cfg.num_experts_per_tok}) + {cfg.n_shared_experts} shared, "
        f"width {cfg.moe_intermediate_size}",
    ]
    if cfg.is_v4:
        kinds = Counter(cfg.layer_kind(i) for i in range(n))
        lines += [
            f"attention         {dict(kinds)}; window {cfg.sliding_window}; head_dim {cfg.head_dim} "
            f"(rope {cfg.qk_rope_head_dim})",
            f"compress ratios   {list(cfg.compress_ratios[:n])} | MTP {cfg.compress_ratios[n]}",
            f"hash layers       {cfg.num_hash_layers}; hc_mult {cfg.hc_mult}",
        ]
    else:
        lines += [
            f"attention         MLA{' + DSA indexer' if cfg.has_dsa_indexer else ''}; kv_lora {cfg.kv_lora_rank}, "
            f"q_lora {cfg.q_lora_rank}",
            f"dense layers      {cfg.first_k_dense_replace}; groups {cfg.n_group} (top {cfg.topk_group})",
        ]
    lines += [
        f"parameters        total {_human(counts['total'])}, active per token {_human(counts['active'])}",
        f"MTP block         {_human(counts['mtp'])} (not in the totals above)",
    ]
    return lines


def cmd_info(a: argparse.Namespace) -> int:
    t0 = time.perf_counter()
    cfg = ModelConfig.resolve(a.config)
    print("\n".join(describe(cfg)))
    print(f"(built on the meta device in {time.perf_counter() - t0:.2f}s; no weights allocated)")
    return 0


def cmd_generate(a: argparse.Namespace) -> int:
    from dsv4c.checkpoint import load_model
    from dsv4c.model.generate import greedy

    model = load_model(a.checkpoint, dtype=a.dtype)
    tok = _tokenizer(a.checkpoint) if a.prompt is not None else None
    if tok is not None:
        bos = [model.config.bos_token_id] if model.config.bos_token_id is not None else []
        ids = bos + tok.encode(a.prompt).ids
    else:
        try:
            ids = [int(t) for t in a.ids.split(",")] if a.ids else [model.config.bos_token_id or 0]
        except ValueError:
            raise ValueError(f"--ids: expected comma-separated integers, got {a.ids!r}") from None
    bad = [t for t in ids if not 0 <= t < model.config.vocab_size]
    if bad:
        raise ValueError(f"--ids: token ids {bad} outside vocab_size={model.config.vocab_size}")
    out = greedy(model, torch.tensor([ids]), a.max_new_tokens)[0].tolist()
    print(a.prompt + tok.decode(out) if tok is not None else ",".join(str(t) for t in out))
    return 0


def _tokenizer(checkpoint: Path):
    from tokenizers import Tokenizer

    path = Path(checkpoint) / "tokenizer.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: --prompt needs the checkpoint's tokenizer.json (or use --ids)")
    return Tokenizer.from_file(str(path))


def _model_for(spec: str, meta: bool, dtype: torch.dtype, device: str = "cpu"):
    """A checkpoint folder loads its weights; a preset or config.json gets seeded random weights,
    or none at all on the meta device (also chosen automatically when the weights would not fit:
    above 2B parameters on a CPU, above 90% of the free memory on a GPU). On a GPU the random
    weights are drawn there (other values than the CPU's, same distribution)."""
    from dsv4c.checkpoint import load_model
    from dsv4c.model import build_model, count_parameters

    p = Path(spec)
    if p.is_dir() and any(p.glob("*.safetensors")):
        return load_model(p, device="meta" if meta else device, dtype=dtype)
    cfg = ModelConfig.resolve(spec)
    n = count_parameters(build_model(cfg, device="meta"))["total"]
    on_gpu = torch.device(device).type == "cuda"
    big = n * dtype.itemsize > 0.9 * torch.cuda.mem_get_info(device)[0] if on_gpu else n > 2e9
    if big and not meta:
        print(f"{spec}: {cfg.model_type} ({n / 1e9:.1f}B parameters) does not fit on {device}; comparing on the meta "
              f"device (stats only)", file=sys.stderr)
    return build_model(cfg, device="meta" if meta or big else device, dtype=dtype, on_device=on_gpu)


def cmd_compare(a: argparse.Namespace) -> int:
    import json

    from dsv4c.compare import compare_passes, format_table

    model = _model_for(a.checkpoint, a.meta, a.dtype, a.device)
    kinds = tuple(k for k in a.graphs.split(",") if k)
    from dsv4c.compare import json_rows

    rows = compare_passes(model, target=a.target, kinds=kinds, k=a.k, skip=tuple(a.skip_pass), seed=a.seed,
                          pin_routing=a.pin_routing)
    if a.json:
        # strict JSON has no Infinity: identical logits report snr_db "inf"
        print(json.dumps(json_rows(rows), indent=2, default=str))
    else:
        print(format_table(rows))
    return 0


def _buckets(s: str) -> tuple[int, ...]:
    try:
        return tuple(int(b) for b in s.split(",") if b)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--buckets: expected comma-separated integers, got {s!r}") from None


def cmd_compile(a: argparse.Namespace) -> int:
    from dsv4c.compile import compile_checkpoint, describe_artifact

    t0 = time.perf_counter()
    compile_checkpoint(a.checkpoint, a.output, target=a.target, skip=tuple(a.skip_pass), max_tokens=a.max_tokens,
                       max_batch=a.max_batch, buckets=a.buckets, mtp_k=a.mtp, dtype=a.dtype, force=a.force,
                       progress=True, kernels=dict(a.kernel) or None, expert_format=a.expert_format,
                       convert_device=a.convert_device, dense_format=a.dense_format)
    print(describe_artifact(a.output))
    print(f"compiled in {time.perf_counter() - t0:.1f}s")
    return 0


def cmd_inspect(a: argparse.Namespace) -> int:
    from dsv4c.compile import describe_artifact, read_manifest, write_plan

    print(describe_artifact(a.artifact))
    if a.plan:
        for name, p in (read_manifest(a.artifact, verify=False).get("segment_plan") or {}).items():
            print(f"\n{name}:\n{p['table']}")
        for f in write_plan(a.artifact, a.plan_dir or Path(a.artifact) / "plan"):
            print(f"wrote {f}")
    return 0


def cmd_run(a: argparse.Namespace) -> int:
    from dsv4c.runtime import Session

    sess = Session.load(a.artifact, device=a.device, emulate=a.emulate, graphs=a.graphs)
    prompts = a.prompt or []
    if not prompts:
        raise ValueError("run: give at least one --prompt")
    results = sess.generate(prompts, max_new_tokens=a.max_new_tokens, temperature=a.temperature, top_p=a.top_p,
                            top_k=a.top_k, seed=a.seed, mtp=a.mtp if a.mtp == "auto" else int(a.mtp))
    for p, r in zip(prompts, results):
        print(p + (r.text if r.text is not None else " " + ",".join(map(str, r.tokens))))
        if a.stats:
            print(f"  [{r.finish_reason}; {len(r.tokens)} tokens; ttft {r.stats['ttft_s'] * 1e3:.0f} ms; "
                  f"{r.stats['tokens_per_s']:.1f} tok/s; prefill chunks {r.stats['prefill_chunks']}]")
            if "accept_histogram" in r.stats or "mtp_policy" in r.stats:
                st = r.stats
                alpha = ", ".join("-" if x is None else f"{x:.2f}" for x in st.get("acceptance_per_position", []))
                print(f"  [mtp k={st['mtp_k']} (exact); acceptance per position [{alpha}]; mean accepted length "
                      f"{st.get('mean_accepted_length') or 0:.2f}; histogram {st.get('accept_histogram')}"
                      + (f"; auto: {st['mtp_policy']['reason']}" if st.get("mtp_policy") else "") + "]")
    return 0


def cmd_bench(a: argparse.Namespace) -> int:
    from dsv4c.bench import bench_artifact, format_table, write_json

    res = bench_artifact(a.artifact, a.batch, a.prompt_len, a.output_len, device=a.device, graphs=a.graphs,
                         emulate=a.emulate, mtp=a.mtp if a.mtp == "auto" else int(a.mtp), seed=a.seed)
    print(format_table(res))
    if a.json:
        write_json(res, a.json)
    return 0


def _kernel(s: str) -> tuple[str, str]:
    op, sep, impl = s.partition("=")
    if not sep or not op or not impl:
        raise argparse.ArgumentTypeError(f"--kernel: expected OP=IMPL (e.g. moe_experts=gathered), got {s!r}")
    return op, impl


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dsv4c", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)

    s = sub.add_parser("init", help="write a seeded random checkpoint for a preset or config.json")
    s.add_argument("config", help="preset name (e.g. v4-tiny-a, v4-flash) or a config.json / checkpoint folder")
    s.add_argument("-o", "--output", required=True, type=Path)
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--quant", choices=("none", "release"), default="none",
                   help="release: FP8 128x128 attention/shared weights, MXFP4 routed experts (V4)")
    s.add_argument("--dtype", type=_dtype, default=torch.bfloat16, help="storage dtype of unquantised weights")
    s.add_argument("--shard-gb", type=float, default=4.0)
    s.add_argument("--force", action="store_true", help="replace the contents of a non-empty output folder")
    s.set_defaults(fn=cmd_init)

    s = sub.add_parser("info", help="describe a model: layers and total/active parameter counts")
    s.add_argument("config", help="preset name or a config.json / checkpoint folder")
    s.set_defaults(fn=cmd_info)

    s = sub.add_parser("compare", help="run the pass pipeline one pass at a time; report logits error vs eager")
    s.add_argument("checkpoint", help="checkpoint folder, preset name or config.json (random weights)")
    s.add_argument("--target", default="cpu", choices=("cpu", "h100", "h200", "b200"))
    s.add_argument("--skip-pass", action="append", default=[], metavar="NAME", help="leave a pass out (repeatable)")
    s.add_argument("--graphs", default="prefill,decode", help="comma-separated graph kinds: prefill,decode,mtp")
    s.add_argument("--k", type=int, default=0, help="speculative tokens of the decode/mtp graphs (1 + k per step)")
    s.add_argument("--meta", action="store_true", help="no weights: export and pass stats only, no numerics")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--dtype", type=_dtype, default=torch.float32)
    s.add_argument("--json", action="store_true", help="print JSON: one entry per graph and pass")
    s.add_argument("--device", default="cpu", help="where the model and graphs run (cuda: full-size slices "
                   "such as v4-flash-slice, and the targets' Triton kernels)")
    s.add_argument("--pin-routing", action="store_true", help="also run every graph with the eager model's routing "
                   "decisions fed to its experts (only kernel/format error left); per-layer routing flips are "
                   "reported either way")
    s.set_defaults(fn=cmd_compare)

    s = sub.add_parser("compile", help="compile a checkpoint for a target into an artifact folder")
    s.add_argument("checkpoint", type=Path)
    s.add_argument("--target", required=True, choices=("b200", "h200", "h100", "cpu"))
    s.add_argument("-o", "--output", required=True, type=Path)
    s.add_argument("--skip-pass", action="append", default=[], metavar="NAME")
    s.add_argument("--max-tokens", type=int, default=4096, help="positions per sequence the caches hold")
    s.add_argument("--max-batch", type=int, default=8, help="sequences decoded together (cache slots)")
    s.add_argument("--buckets", type=_buckets, default=None, help="CUDA-graph batch buckets (sequences per decode step), e.g. 1,2,4,8")
    s.add_argument("--mtp", type=int, default=0, help="speculative tokens k of the decode graph (1 + k per step)")
    s.add_argument("--dtype", type=_dtype, default=None, help="activation dtype (default: the target's; cpu fp32)")
    s.add_argument("--force", action="store_true", help="replace a non-empty output folder")
    s.add_argument("--kernel", type=_kernel, action="append", default=[], metavar="OP=IMPL",
                   help="override the target's implementation of one op, e.g. moe_experts=gathered "
                        "(capture-safe experts: lets --graphs full capture the whole decode step)")
    s.add_argument("--expert-format", default=None,
                   choices=("reference", "bf16", "fp8_block", "mxfp4_w4a16", "nvfp4_w4a16", "nvfp4_w4a4"),
                   help="routed-expert format instead of the target's (h200/h100: fp8_block; b200: nvfp4_w4a4); "
                        "a format the target's GPU cannot run fails with the capability it needs")
    s.add_argument("--dense-format", default=None, choices=("reference", "bf16", "fp8_block", "fp8_block_w8a16"),
                   help="format of the dense linears the checkpoint stores in FP8 (attention, shared experts) instead "
                        "of the target's (h200/h100/b200: fp8_block = W8A8; fp8_block_w8a16 = FP8 weights x bf16 "
                        "activations; bf16 = widened as before)")
    s.add_argument("--convert-device", default=None, metavar="DEVICE",
                   help="where routed experts are converted/quantised (default: cuda when a GPU is present, "
                        "else cpu); exact, so the weight files' bytes do not depend on it")
    s.set_defaults(fn=cmd_compile)

    s = sub.add_parser("inspect", help="print an artifact's manifest readably")
    s.add_argument("artifact", type=Path)
    s.add_argument("--plan", action="store_true", help="print the router-split plan; write DOT (+PNG) files")
    s.add_argument("--plan-dir", type=Path, default=None, help="where --plan writes (default ART/plan)")
    s.set_defaults(fn=cmd_inspect)

    s = sub.add_parser("run", help="load an artifact in a Session and generate")
    s.add_argument("artifact", type=Path)
    s.add_argument("--prompt", action="append", help="prompt text (repeatable: one batch)")
    s.add_argument("--max-new-tokens", type=int, default=32)
    s.add_argument("--temperature", type=float, default=0.0)
    s.add_argument("--top-p", type=float, default=1.0)
    s.add_argument("--top-k", type=int, default=0)
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--device", default=_default_device(), help="default: cuda when a GPU is present, else cpu")
    s.add_argument("--emulate", action="store_true", help="run another target's artifact on the reference ops")
    s.add_argument("--graphs", default=None, choices=("auto", "off", "piecewise", "full", "emulate", "full-emulate"),
                   help="CUDA graphs for the decode steps (default: auto on a GPU, i.e. each graph captured whole "
                        "when all its segments can be, else piecewise; off on a CPU)")
    s.add_argument("--stats", action="store_true", help="per-request time to first token and tokens/s "
                   "(and MTP acceptance with --mtp)")
    s.add_argument("--mtp", default="0", help="MTP speculative decoding: 0 (off), k = 1..K (the artifact's "
                   "--mtp K), or auto; exact (greedy output and sampling distribution unchanged)")
    s.set_defaults(fn=cmd_run)

    s = sub.add_parser("bench", help="throughput and latency percentiles of an artifact (JSON with --json)")
    s.add_argument("artifact", type=Path)
    s.add_argument("--batch", type=int, nargs="+", default=[1, 8], help="batch sizes (sequences)")
    s.add_argument("--prompt-len", type=int, default=128)
    s.add_argument("--output-len", type=int, default=32)
    s.add_argument("--device", default=_default_device(), help="default: cuda when a GPU is present, else cpu")
    s.add_argument("--emulate", action="store_true", help="run another target's artifact on the reference ops")
    s.add_argument("--graphs", default=None, choices=("auto", "off", "piecewise", "full", "emulate", "full-emulate"))
    s.add_argument("--mtp", default="0", help="MTP speculative decoding: 0, k, or auto")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--json", type=Path, default=None, help="write the results as JSON here")
    s.set_defaults(fn=cmd_bench)

    s = sub.add_parser("generate", help="greedy-decode with the eager reference model (text or token ids)")
    s.add_argument("checkpoint", type=Path)
    s.add_argument("--ids", default="", help="comma-separated prompt token ids")
    s.add_argument("--prompt", default=None, help="prompt text, encoded with the checkpoint's tokenizer.json")
    s.add_argument("--max-new-tokens", type=int, default=16)
    s.add_argument("--dtype", type=_dtype, default=torch.float32)
    s.set_defaults(fn=cmd_generate)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.fn(args)
    except (ConfigError, FileNotFoundError, FileExistsError, KeyError, ValueError, TargetError) as e:
        print(f"dsv4c {args.cmd}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
