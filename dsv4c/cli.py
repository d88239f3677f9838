"""The `dsv4c` command line: `init` writes a random checkpoint, `info` describes a model, `compare`
reports what each lowering pass does to the logits, `generate` runs the eager reference, `serve` runs an
OpenAI-compatible HTTP server over a compiled artifact."""
from __future__ import annotations

import argparse
import sys
import time
from collections import Counter
from pathlib import Path

import torch

from dsv4c.config import ConfigError, ModelConfig
from dsv4c.targets import TargetError
from dsv4c.validate import (check_mtp, device_arg, float_in, int_at_least, mtp_arg, plan_dir_outside,
                            read_prompt_file, utf8_text)

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
                          pin_routing=a.pin_routing, on_step=_print_step)
    if a.json:
        # strict JSON has no Infinity: identical logits report snr_db "inf"
        print(json.dumps(json_rows(rows), indent=2, default=str))
    else:
        print(format_table(rows))
    return 0


def _print_step(kind: str, name: str, m: dict) -> None:
    """compare's progress: one line per pass as it finishes (stderr; the table or JSON follows on stdout)."""
    snr = m.get("snr_db")
    err = "" if snr is None else (f": SNR {'inf' if snr == float('inf') else f'{snr:.1f}'} dB vs eager, max abs err "
                                  f"{m['max_abs_err']:.2e}")
    print(f"{kind} {name} done{err}", file=sys.stderr, flush=True)


def _buckets(s: str) -> tuple[int, ...]:
    try:
        return tuple(int(b) for b in s.split(",") if b)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--buckets: expected comma-separated integers, got {s!r}") from None


def _paged(a: argparse.Namespace):
    """--paged [--block-size B] [--pool-blocks N] -> a PagedConfig, or None."""
    if not a.paged:
        if a.block_size is not None or a.pool_blocks is not None:
            raise ValueError("--block-size / --pool-blocks: only with --paged")
        return None
    from dsv4c.runtime.block_pool import PagedConfig

    return PagedConfig(block_size=a.block_size, max_blocks=a.pool_blocks)


def cmd_compile(a: argparse.Namespace) -> int:
    from dsv4c.compile import check_output, compile_checkpoint, describe_artifact

    check_output(a.output, a.force)  # before any work: a file, or a non-empty folder without --force
    t0 = time.perf_counter()
    compile_checkpoint(a.checkpoint, a.output, target=a.target, skip=tuple(a.skip_pass), max_tokens=a.max_tokens,
                       max_batch=a.max_batch, buckets=a.buckets, mtp_k=a.mtp, dtype=a.dtype, force=a.force,
                       progress=True, kernels=dict(a.kernel) or None, expert_format=a.expert_format,
                       convert_device=a.convert_device, plan=_compile_plan(a), deterministic=a.deterministic,
                       dense_format=a.dense_format, paged=_paged(a))
    print(describe_artifact(a.output))
    print(f"compiled in {time.perf_counter() - t0:.1f}s")
    return 0


def _compile_plan(a: argparse.Namespace):
    """--tp/--ep; both omitted: on a GPU target with GPUs here, the memory planner's choice for this
    machine's GPU count (`dsv4c.planner.choose_plan`, which refuses naming the shortfall when nothing
    fits); else one rank."""
    from dsv4c.parallel import ParallelPlan
    from dsv4c.targets import get_target

    if a.tp is not None or a.ep is not None:
        return ParallelPlan(tp=a.tp or 1, ep=a.ep or 1)
    gpus = torch.cuda.device_count()
    if get_target(a.target).device != "cuda" or gpus == 0:
        return ParallelPlan()
    from dsv4c.planner import choose_plan

    plan, _ = choose_plan(ModelConfig.from_pretrained(a.checkpoint), gpus, a.target, a.expert_format,
                          max_tokens=a.max_tokens, max_batch=a.max_batch, mtp_k=a.mtp,
                          dense_format=getattr(a, "dense_format", None))
    return plan


def cmd_inspect(a: argparse.Namespace) -> int:
    from dsv4c.compile import describe_artifact, read_manifest, write_plan

    # the plan goes to the current folder or --plan-dir, never into the artifact (checked before any output)
    plan_dir = plan_dir_outside(a.artifact, a.plan_dir or Path(f"{Path(a.artifact).resolve().name}.plan"))
    print(describe_artifact(a.artifact))
    if a.plan:
        for name, p in (read_manifest(a.artifact, verify=False).get("segment_plan") or {}).items():
            print(f"\n{name}:\n{p['table']}")
        for f in write_plan(a.artifact, plan_dir):
            print(f"wrote {f}")
    return 0


def cmd_run(a: argparse.Namespace) -> int:
    from dsv4c.compile import read_manifest
    from dsv4c.runtime import Session

    prompts = (a.prompt or []) + [read_prompt_file(f) for f in a.prompt_file or []]
    prompts += [[int(t) for t in p.split(",")] for p in (a.prompt_ids or [])]
    if not prompts:
        raise ValueError("run: give at least one --prompt, --prompt-file or --prompt-ids")
    check_mtp(a.mtp, read_manifest(a.artifact, verify=False), a.artifact)  # before the artifact loads
    sess = Session.load(a.artifact, device=a.device, emulate=a.emulate, graphs=a.graphs,
                        deterministic=a.deterministic, max_num_batched_tokens=a.max_num_batched_tokens)
    results = sess.generate(prompts, max_new_tokens=a.max_new_tokens, temperature=a.temperature, top_p=a.top_p,
                            top_k=a.top_k, seed=a.seed, mtp=a.mtp, min_p=a.min_p, presence_penalty=a.presence_penalty,
                            frequency_penalty=a.frequency_penalty, repetition_penalty=a.repetition_penalty)
    for p, r in zip(prompts, results):
        head = p if isinstance(p, str) else ",".join(map(str, p))
        print(head + (r.text if r.text is not None else " " + ",".join(map(str, r.tokens))))
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
    from dsv4c.compile import read_manifest

    check_mtp(a.mtp, read_manifest(a.artifact, verify=False), a.artifact)  # before the artifact loads
    res = bench_artifact(a.artifact, a.batch, a.prompt_len, a.output_len, device=a.device, graphs=a.graphs,
                         emulate=a.emulate, mtp=a.mtp if a.mtp == "auto" else int(a.mtp), seed=a.seed,
                         deterministic=a.deterministic, max_num_batched_tokens=a.max_num_batched_tokens,
                         side_stream=not a.one_stream)
    print(format_table(res))
    if a.json:
        write_json(res, a.json)
    return 0


def cmd_plan(a: argparse.Namespace) -> int:
    """Print every candidate ParallelPlan's per-GPU bytes and step roofline; exit 2 naming the shortfall
    when none fits."""
    import json

    from dsv4c.planner import PlanRefused, choose_plan

    try:
        _, report = choose_plan(a.config, a.gpus, a.target, a.expert_format, a.max_tokens, a.max_batch, mtp_k=a.mtp)
        refused = None
    except PlanRefused as e:
        report, refused = e.report, str(e)
    print(json.dumps(report.to_dict(), indent=2) if a.json else report.format())
    if refused:
        print(f"dsv4c plan: refused: {refused}", file=sys.stderr)
        return 2
    return 0


def _add_plan_parser(sub) -> None:
    from dsv4c.passes.quantize_experts import KERNEL_FORMAT

    s = sub.add_parser("plan", help="memory planner: per-GPU bytes of each tensor/expert-parallel plan, the "
                                    "fastest that fits (exit 2 naming the shortfall when none does)")
    s.add_argument("config", help="preset name (v4-flash, v4-pro, v3, ...) or a config.json / checkpoint folder")
    s.add_argument("--gpus", type=int, required=True, help="GPUs (tp x ep = this)")
    s.add_argument("--target", required=True, choices=("h200", "h100", "b200"))
    s.add_argument("--expert-format", default=None, choices=sorted(KERNEL_FORMAT),
                   help="routed-expert format (default: the target's)")
    s.add_argument("--max-tokens", type=int, default=4096, help="positions per sequence the caches hold (L)")
    s.add_argument("--max-batch", type=int, default=8, help="sequences decoded together (B; B + 1 cache slots)")
    s.add_argument("--mtp", type=int, default=0, help="plan for an artifact compiled with --mtp K (MTP weights "
                   "and caches)")
    s.add_argument("--json", action="store_true", help="print the report as JSON")
    s.set_defaults(fn=cmd_plan)


def cmd_export_onnx(a: argparse.Namespace) -> int:
    """Export the artifact's dense pieces as ONNX (+ index.json); with --verify, exit 1 if one misses 1e-5."""
    from dsv4c.onnx_export import OnnxExportError, export_onnx, format_index

    try:
        index = export_onnx(a.artifact, a.output, segments=a.segments, opset=a.opset, verify=a.verify)
    except (OnnxExportError, ImportError) as e:
        print(f"dsv4c export-onnx: error: {e}", file=sys.stderr)
        return 2
    print(format_index(index))
    print(f"wrote {Path(a.output) / 'index.json'}")
    if a.verify:
        bad = [(k, e["piece"]) for k, g in index["graphs"].items() for e in g["pieces"]
               if e.get("verify") and not e["verify"]["ok"]]
        if bad:
            print(f"dsv4c export-onnx: verification failed for {bad}", file=sys.stderr)
            return 1
    return 0


def _add_export_onnx_parser(sub) -> None:
    s = sub.add_parser("export-onnx", help="export an artifact's dense segments (between MoE and cache ops) as "
                                           "ONNX models with an index; --verify checks them in onnxruntime")
    s.add_argument("artifact", type=Path, help="an fp32 artifact (dsv4c compile ... --target cpu)")
    s.add_argument("-o", "--output", required=True, type=Path)
    s.add_argument("--segments", choices=("dense", "all"), default="dense",
                   help="all: also list each torch piece with why it is not ONNX")
    s.add_argument("--opset", type=int, default=18)
    s.add_argument("--verify", action="store_true", help="onnxruntime (CPU) vs torch on the same recorded "
                   "inputs, max relative error <= 1e-5 per piece")
    s.set_defaults(fn=cmd_export_onnx)


def cmd_serve(a: argparse.Namespace) -> int:
    import os

    from dsv4c.runtime.serve import ServeConfig, serve

    if not (Path(a.artifact) / "manifest.json").is_file():
        raise FileNotFoundError(f"{a.artifact}: not an artifact folder (no manifest.json); make one with "
                                f"dsv4c compile")
    mtp = a.mtp if a.mtp == "auto" else _int_arg("--mtp", a.mtp)
    if a.max_waiting < 1:
        raise ValueError(f"--max-waiting: must be >= 1, got {a.max_waiting}")
    cfg = ServeConfig(Path(a.artifact), served_model_name=a.served_model_name,
                      api_key=a.api_key or os.environ.get("DSV4C_API_KEY") or None, max_waiting=a.max_waiting,
                      mtp=mtp, device=a.device, graphs=a.graphs, reasoning_parser=a.reasoning_parser,
                      max_num_batched_tokens=a.max_num_batched_tokens)
    serve(cfg, host=a.host, port=a.port, log_level=a.log_level)
    return 0


def _int_arg(name: str, v: str) -> int:
    try:
        return int(v)
    except ValueError:
        raise ValueError(f"{name}: expected an integer or 'auto', got {v!r}") from None


def _kernel(s: str) -> tuple[str, str]:
    op, sep, impl = s.partition("=")
    if not sep or not op or not impl:
        raise argparse.ArgumentTypeError(f"--kernel: expected OP=IMPL (e.g. moe_experts=gathered), got {s!r}")
    return op, impl


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Defaults in --help, except None/False ones and where the help text already explains its default."""

    def _get_help_string(self, action):
        text = action.help or ""
        if action.default is None or action.default is False or "default" in text:
            return text
        return super()._get_help_string(action)


class _Parser(argparse.ArgumentParser):
    """Every (sub)command shows its defaults in --help (also options added without a help text)."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", _HelpFormatter)
        super().__init__(*args, **kwargs)

    def add_argument(self, *args, **kwargs):
        if "help" not in kwargs and args and args[0].startswith("-") and kwargs.get("default") not in (None, False):
            kwargs["help"] = "(default: %(default)s)"
        return super().add_argument(*args, **kwargs)


def _chunk_arg(s: argparse.ArgumentParser) -> None:
    """--max-num-batched-tokens of run, bench and serve: the Session's prefill chunk."""
    s.add_argument("--max-num-batched-tokens", type=int_at_least(1, "--max-num-batched-tokens"), default=None,
                   help="prompt tokens per prefill call (default: the Session's, min(max_tokens, 2048)); larger "
                        "chunks prefill faster and hold decode steps back longer")


def build_parser() -> argparse.ArgumentParser:
    import dsv4c

    p = _Parser(prog="dsv4c", description=__doc__)
    p.add_argument("--version", action="version", version=f"dsv4c {dsv4c.__version__} (torch {torch.__version__})")
    sub = p.add_subparsers(dest="cmd", required=True, parser_class=_Parser)

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
    s.add_argument("--max-tokens", type=int_at_least(1, "--max-tokens"), default=4096,
                   help="positions per sequence the caches hold")
    s.add_argument("--max-batch", type=int_at_least(1, "--max-batch"), default=8,
                   help="sequences decoded together (cache slots)")
    s.add_argument("--buckets", type=_buckets, default=None, help="CUDA-graph batch buckets (sequences per decode step), e.g. 1,2,4,8")
    s.add_argument("--mtp", type=int_at_least(0, "--mtp"), default=0,
                   help="speculative tokens k of the decode graph (1 + k per step)")
    s.add_argument("--dtype", type=_dtype, default=None, help="activation dtype (default: the target's; cpu fp32)")
    s.add_argument("--force", action="store_true", help="replace a non-empty output folder")
    s.add_argument("--kernel", type=_kernel, action="append", default=[], metavar="OP=IMPL",
                   help="override the target's implementation of one op, e.g. moe_experts=gathered "
                        "(capture-safe experts: lets --graphs full capture the whole decode step)")
    s.add_argument("--expert-format", default=None,
                   choices=("reference", "bf16", "fp8_block", "mxfp4_w4a16", "nvfp4_w4a16", "nvfp4_w4a4"),
                   help="routed-expert format instead of the target's (h200/h100: fp8_block; b200: nvfp4_w4a4); "
                        "a format the target's GPU cannot run fails with the capability it needs")
    s.add_argument("--tp", type=int, default=None, help="tensor-parallel ranks (heads, vocabulary, expert columns)")
    s.add_argument("--ep", type=int, default=None, help="expert-parallel ranks (routed experts)")
    s.add_argument("--dense-format", default=None, choices=("reference", "bf16", "fp8_block", "fp8_block_w8a16"),
                   help="format of the dense linears the checkpoint stores in FP8 (attention, shared experts) instead "
                        "of the target's (bf16 = widened, the GPU targets' default until measured; fp8_block = "
                        "W8A8; fp8_block_w8a16 = FP8 weights x bf16 activations)")
    s.add_argument("--convert-device", default=None, metavar="DEVICE",
                   help="where routed experts are converted/quantised (default: cuda when a GPU is present, "
                        "else cpu); exact, so the weight files' bytes do not depend on it")
    s.add_argument("--deterministic", action="store_true",
                   help="batch-invariant kernels: each row's logits do not depend on the rows sharing a step "
                        "(unquantised experts, or FP4 weight-only ones with --expert-format mxfp4_w4a16 / "
                        "nvfp4_w4a16; refuses what it cannot make invariant, naming the kernel)")
    s.add_argument("--paged", action="store_true",
                   help="paged caches: the caches that grow with the sequence (V4 compressed entries and indexer "
                        "keys, V3 latent) in blocks of a shared pool read through block tables; prefixes share "
                        "blocks without copies (runtime/block_pool.py)")
    s.add_argument("--block-size", type=int, default=None, metavar="B",
                   help="with --paged: positions per block (default: a multiple of every compression ratio, >= 16)")
    s.add_argument("--pool-blocks", type=int, default=None, metavar="N",
                   help="with --paged: blocks in the pool (default: max_batch x max_tokens / B, the slot caches' "
                        "capacity; fewer use less memory: blocks are taken as tokens grow, and requests wait or "
                        "are preempted when none is left)")
    s.set_defaults(fn=cmd_compile)

    s = sub.add_parser("inspect", help="print an artifact's manifest readably")
    s.add_argument("artifact", type=Path)
    s.add_argument("--plan", action="store_true", help="print the router-split plan; write DOT (+PNG) files")
    s.add_argument("--plan-dir", type=Path, default=None,
                   help="where --plan writes (default: ./NAME.plan in the current folder, never inside the artifact)")
    s.set_defaults(fn=cmd_inspect)

    s = sub.add_parser("run", help="load an artifact in a Session and generate")
    s.add_argument("artifact", type=Path)
    s.add_argument("--prompt", action="append", type=utf8_text("--prompt"), help="prompt text (repeatable: one batch)")
    s.add_argument("--prompt-file", action="append", metavar="PATH",
                   help="a file whose whole UTF-8 text is one prompt; - reads standard input (repeatable)")
    s.add_argument("--prompt-ids", action="append", metavar="IDS", help="a prompt as comma-separated token ids "
                   "(repeatable; for artifacts without a tokenizer)")
    s.add_argument("--max-new-tokens", type=int_at_least(1, "--max-new-tokens"), default=32)
    _chunk_arg(s)
    s.add_argument("--temperature", type=float, default=0.0)
    s.add_argument("--top-p", type=float, default=1.0)
    s.add_argument("--top-k", type=int, default=0)
    s.add_argument("--min-p", type=float_in(0, 1, "--min-p"), default=0.0,
                   help="keep tokens >= MIN_P x the most likely one's probability")
    s.add_argument("--presence-penalty", type=float_in(-2, 2, "--presence-penalty"), default=0.0,
                   help="-2..2, on the output so far (plain decoding)")
    s.add_argument("--frequency-penalty", type=float_in(-2, 2, "--frequency-penalty"), default=0.0,
                   help="-2..2, per occurrence in the output so far (plain decoding)")
    s.add_argument("--repetition-penalty", type=float_in(0, 2, "--repetition-penalty", low_open=True), default=1.0,
                   help="(0, 2], on prompt and output tokens (plain decoding)")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--device", type=device_arg, default=_default_device(),
                   help="cpu or cuda (default: cuda when a GPU is present)")
    s.add_argument("--emulate", action="store_true", help="run another target's artifact on the reference ops")
    s.add_argument("--graphs", default=None, choices=("auto", "off", "piecewise", "full", "emulate", "full-emulate"),
                   help="CUDA graphs for the decode steps (default: auto on a GPU, i.e. each graph captured whole "
                        "when all its segments can be, else piecewise; off on a CPU)")
    s.add_argument("--stats", action="store_true", help="per-request time to first token and tokens/s "
                   "(and MTP acceptance with --mtp)")
    s.add_argument("--mtp", type=mtp_arg, default=0, help="MTP speculative decoding: 0 (off), k = 1..K (the artifact's "
                   "--mtp K), or auto; exact (greedy output and sampling distribution unchanged)")
    s.add_argument("--worker-timeout", type=float, default=3600.0,
                   help="a sharded artifact's workers: seconds before a run that has not ended is stopped")
    s.add_argument("--deterministic", action="store_true", help="require an artifact compiled with "
                   "--deterministic (batch-invariant kernels); refuses any other")
    s.set_defaults(fn=cmd_run)

    s = sub.add_parser("bench", help="throughput and latency percentiles of an artifact (JSON with --json)")
    s.add_argument("artifact", type=Path)
    s.add_argument("--batch", type=int_at_least(1, "--batch"), nargs="+", default=[1, 8],
                   help="batch sizes (sequences)")
    s.add_argument("--prompt-len", type=int_at_least(1, "--prompt-len"), default=128, help="prompt tokens")
    s.add_argument("--output-len", type=int_at_least(1, "--output-len"), default=32, help="generated tokens")
    _chunk_arg(s)
    s.add_argument("--device", type=device_arg, default=_default_device(),
                   help="cpu or cuda (default: cuda when a GPU is present)")
    s.add_argument("--emulate", action="store_true", help="run another target's artifact on the reference ops")
    s.add_argument("--graphs", default=None, choices=("auto", "off", "piecewise", "full", "emulate", "full-emulate"))
    s.add_argument("--mtp", type=mtp_arg, default=0, help="MTP speculative decoding: 0, k, or auto")
    s.add_argument("--one-stream", action="store_true", help="keep each MoE layer's shared expert on the step's "
                   "stream (default: a second CUDA stream in steps captured whole; the outputs are the same)")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--json", type=Path, default=None, help="write the results as JSON here")
    s.add_argument("--worker-timeout", type=float, default=3600.0,
                   help="a sharded artifact's workers: seconds before a run that has not ended is stopped")
    s.add_argument("--deterministic", action="store_true", help="require an artifact compiled with "
                   "--deterministic (batch-invariant kernels); refuses any other")
    s.set_defaults(fn=cmd_bench)

    s = sub.add_parser("serve", help="serve an artifact over an OpenAI-compatible HTTP API (FastAPI + uvicorn)")
    s.add_argument("artifact", type=Path)
    s.add_argument("--host", default="127.0.0.1", help="address to bind (default loopback only; 0.0.0.0 exposes it)")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1 (default: "
                   "$DSV4C_API_KEY, else none)")
    s.add_argument("--max-waiting", type=int, default=256, help="requests waiting for a cache slot before 503")
    _chunk_arg(s)
    s.add_argument("--served-model-name", default=None, help="the model name clients send (default: the "
                   "artifact folder's name)")
    s.add_argument("--mtp", default="auto", help="MTP speculative decoding: 0, k = 1..K, or auto (decided at "
                   "startup; plain decoding when the artifact has no MTP)")
    s.add_argument("--device", default=None, help="default: cuda when a GPU is present, else cpu")
    s.add_argument("--graphs", default=None, choices=("auto", "off", "piecewise", "full", "emulate", "full-emulate"))
    s.add_argument("--reasoning-parser", default="auto", choices=("auto", "deepseek", "none"),
                   help="chat completions: the reasoning before </think> as reasoning_content (deepseek); auto: "
                   "deepseek where the chat template writes </think>")
    s.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"))
    s.set_defaults(fn=cmd_serve)

    s = sub.add_parser("generate", help="greedy-decode with the eager reference model (text or token ids)")
    s.add_argument("checkpoint", type=Path)
    s.add_argument("--ids", default="", help="comma-separated prompt token ids")
    s.add_argument("--prompt", default=None, help="prompt text, encoded with the checkpoint's tokenizer.json")
    s.add_argument("--max-new-tokens", type=int_at_least(1, "--max-new-tokens"), default=16)
    s.add_argument("--dtype", type=_dtype, default=torch.float32)
    s.set_defaults(fn=cmd_generate)

    _add_plan_parser(sub)
    _add_export_onnx_parser(sub)
    return p


def _parallel(a: argparse.Namespace, fn) -> int | None:
    """`run`/`bench` of a sharded artifact: start one worker per rank (or, inside a worker or under
    torchrun, be one). None: a single-process artifact, run here as before."""
    from dsv4c.compile import read_manifest
    from dsv4c.runtime import distributed as D

    world = read_manifest(a.artifact, verify=False).get("parallel", {}).get("world_size", 1)
    if not D.torchrun_env():
        if world == 1:
            return None
        return D.launch_workers(a.argv, world, timeout_s=a.worker_timeout)
    dev = torch.device(a.device)
    if dev.type == "cuda":
        dev = torch.device("cuda", int(D.os.environ.get("LOCAL_RANK", "0")))
        a.device = str(dev)
    rank = D.init_from_env(dev.type)
    try:
        if rank == 0:
            try:
                return fn(a)
            finally:
                D.send_stop(dev)
        from dsv4c.runtime import Session

        D.serve_follower(Session.load(a.artifact, device=dev, emulate=a.emulate, graphs=a.graphs,
                                      max_num_batched_tokens=getattr(a, "max_num_batched_tokens", None)))
        return 0
    finally:
        D.dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    try:
        if args.cmd in ("run", "bench"):
            rc = _parallel(args, args.fn)  # a sharded artifact: one worker per rank
            if rc is not None:
                return rc
        return args.fn(args)
    except (ConfigError, FileNotFoundError, FileExistsError, NotADirectoryError, IsADirectoryError, PermissionError,
            KeyError, ValueError, TargetError) as e:
        print(f"dsv4c {args.cmd}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
