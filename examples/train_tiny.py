"""Train a small DeepSeek-V4-architecture model on the Python standard library's own source.

Every layer type is present (SWA, CSA with its indexer, HCA), with hash-routed and top-k MoE, a shared
expert, mHC, and one MTP block trained with the MTP loss. The corpus is the running Python's own
stdlib `.py` files; the files in `HELD_OUT` are never trained on and give the evaluation figures.

Outputs (in --out): `release/`, the release-format checkpoint (FP8 attention, MXFP4 experts) with
config.json and tokenizer.json; optionally the bf16 copy (--bf16-out); `train_log.json` (losses, settings, final
figures) and `loss.png` when matplotlib is available.

Run (the bundled model): python examples/train_tiny.py --out OUT --minutes 10 --seed 0   (CUDA, bf16)
"""
from __future__ import annotations

import argparse
import json
import math
import random
import sys
import sysconfig
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from dsv4c import ModelConfig, save_checkpoint
from dsv4c.model import build_model
from dsv4c.model.v4_train import train_forward, train_mtp_forward

# Held-out evaluation files (relative to the stdlib root); present in Python 3.10-3.13.
HELD_OUT = ("textwrap.py", "json/decoder.py", "json/encoder.py", "fractions.py", "heapq.py", "bisect.py",
            "shlex.py", "string.py", "colorsys.py", "calendar.py", "graphlib.py", "sched.py")
SKIP_DIRS = ("test", "tests", "idlelib", "lib2to3", "site-packages", "dist-packages", "turtledemo", "ensurepip")

MODEL = {  # ~15M parameters (embedding and head included), MTP block on top
    "model_type": "deepseek_v4", "vocab_size": 4096, "hidden_size": 320, "num_hidden_layers": 6,
    "num_attention_heads": 8, "head_dim": 64, "qk_rope_head_dim": 16, "q_lora_rank": 128, "o_groups": 2,
    "o_lora_rank": 128, "sliding_window": 64, "compress_ratios": [0, 4, 16, 4, 16, 4, 0], "num_hash_layers": 1,
    "index_n_heads": 16, "index_head_dim": 32, "index_topk": 16, "n_routed_experts": 8, "num_experts_per_tok": 2,
    "moe_intermediate_size": 192, "n_shared_experts": 1, "routed_scaling_factor": 1.5, "swiglu_limit": 10.0,
    "hc_mult": 4, "hc_sinkhorn_iters": 20, "hc_eps": 1e-6, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
    "compress_rope_theta": 160000.0, "max_position_embeddings": 65536, "num_nextn_predict_layers": 1,
    "rope_scaling": {"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536,
                     "beta_fast": 32, "beta_slow": 1},
    "bos_token_id": 0, "eos_token_id": 1, "tie_word_embeddings": False, "scoring_func": "sqrtsoftplus",
}
SPECIAL = ["<|bos|>", "<|eos|>", "<|pad|>"]


def stdlib_files() -> tuple[list[Path], list[Path]]:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if not any(part in SKIP_DIRS for part in p.relative_to(root).parts))
    held = [root / h for h in HELD_OUT if (root / h).exists()]
    train = [p for p in files if p not in set(held)]
    return train, held


def read(p: Path) -> str:
    return p.read_text(encoding="utf-8", errors="replace")


def train_tokenizer(files: list[Path], vocab: int, out: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=SPECIAL, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator((read(p) for p in files), trainer=trainer)
    tok.save(str(out))
    return tok


def encode_files(tok, files: list[Path]) -> torch.Tensor:
    """One token stream: <bos> file <eos> <bos> file <eos> ..."""
    ids = []
    for enc in tok.encode_batch([read(p) for p in files]):
        ids += [0] + enc.ids + [1]
    return torch.tensor(ids, dtype=torch.int64)


def batches(stream: torch.Tensor, B: int, T: int, g: torch.Generator):
    n = stream.numel() - T - 1
    while True:
        start = torch.randint(0, n, (B,), generator=g)
        yield torch.stack([stream[s : s + T + 1] for s in start.tolist()])


def losses(model, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Main next-token CE, and the MTP CE for t+2 from (streams at t, token t+1)."""
    logits, streams = train_forward(model, ids)
    main = F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
    mtp_logits, _ = train_mtp_forward(model, streams[:, :-2], ids[:, 1:-1])
    mtp = F.cross_entropy(mtp_logits.flatten(0, 1), ids[:, 2:].flatten())
    mtp_acc = (mtp_logits.argmax(-1) == ids[:, 2:]).float().mean()
    return main, mtp, mtp_acc


@torch.no_grad()
def evaluate(model, stream: torch.Tensor, T: int, device, max_windows: int = 64) -> dict:
    """Held-out loss/perplexity and MTP top-1 accuracy over non-overlapping windows."""
    n = min((stream.numel() - 1) // T, max_windows)
    tot = {"main": 0.0, "mtp": 0.0, "mtp_acc": 0.0}
    for i in range(n):
        ids = stream[i * T : i * T + T + 1][None].to(device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            main, mtp, acc = losses(model, ids)
        tot["main"] += main.item() / n
        tot["mtp"] += mtp.item() / n
        tot["mtp_acc"] += acc.item() / n
    return {"loss": tot["main"], "ppl": math.exp(tot["main"]), "mtp_loss": tot["mtp"], "mtp_top1": tot["mtp_acc"],
            "windows": n, "tokens": n * T}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--bf16-out", type=Path, default=None)
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--max-steps", type=int, default=100000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--mtp-weight", type=float, default=0.3)
    a = ap.parse_args(argv)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    random.seed(a.seed)
    torch.manual_seed(a.seed)
    a.out.mkdir(parents=True, exist_ok=True)

    train_files, held = stdlib_files()
    t0 = time.perf_counter()
    tok = train_tokenizer(train_files, MODEL["vocab_size"], a.out / "tokenizer.json")
    train_stream, held_stream = encode_files(tok, train_files), encode_files(tok, held)
    print(f"tokenizer + encode: {time.perf_counter() - t0:.0f}s; train {train_stream.numel():,} tokens from "
          f"{len(train_files)} files, held-out {held_stream.numel():,} tokens from {len(held)} files", flush=True)

    cfg = ModelConfig.from_dict(MODEL)
    model = build_model(cfg, device=dev, dtype=torch.float32)
    _scale_init_(model)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=a.lr, betas=(0.9, 0.95), weight_decay=0.1)
    g = torch.Generator().manual_seed(a.seed)
    data = batches(train_stream, a.batch, a.seq, g)
    log, step, deadline = [], 0, time.perf_counter() + 60 * a.minutes
    warmup = 200
    t_start = time.perf_counter()
    while time.perf_counter() < deadline and step < a.max_steps:
        frac = (time.perf_counter() - t_start) / (60 * a.minutes)
        lr = a.lr * min(1.0, (step + 1) / warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(frac, 1.0))))
        for grp in opt.param_groups:
            grp["lr"] = lr
        ids = next(data).to(dev, non_blocking=True)
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda"):
            main, mtp, acc = losses(model, ids)
            loss = main + a.mtp_weight * mtp
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        if step % 25 == 0:
            rec = {"step": step, "seconds": time.perf_counter() - t_start, "lr": lr, "loss": main.item(),
                   "mtp_loss": mtp.item(), "mtp_top1": acc.item()}
            log.append(rec)
            print(json.dumps(rec), flush=True)
        step += 1

    model.eval()
    result = {"steps": step, "tokens_seen": step * a.batch * a.seq, "seed": a.seed, "batch": a.batch, "seq": a.seq,
              "lr": a.lr, "mtp_weight": a.mtp_weight, "minutes": a.minutes, "held_out_files": list(HELD_OUT),
              "python": sys.version.split()[0], "torch": torch.__version__,
              "params": sum(p.numel() for n, p in model.named_parameters() if not n.startswith("mtp.")),
              "mtp_params": sum(p.numel() for n, p in model.named_parameters() if n.startswith("mtp."))}
    result["held_out_trained"] = evaluate(model, held_stream, a.seq, dev)
    # shards under 12 MiB: small files travel and diff better than one 17 MB blob
    save_checkpoint(model.cpu(), a.out / "release", quant="release", overwrite=True, max_shard_bytes=12 << 20)
    if a.bf16_out:
        save_checkpoint(model, a.bf16_out, quant="none", dtype=torch.bfloat16, overwrite=True)
    from dsv4c import load_model

    release = load_model(a.out / "release").to(dev)
    result["held_out_release"] = evaluate(release, held_stream, a.seq, dev)
    (a.out / "tokenizer.json").replace(a.out / "release" / "tokenizer.json")
    (a.out / "train_log.json").write_text(json.dumps({"result": result, "log": log}, indent=1))
    print(json.dumps(result, indent=1), flush=True)
    _plot(log, a.out / "loss.png")
    return 0


def _scale_init_(model) -> None:
    """A trainable init: dsv4c's seeded random weights are for tests (large gains so that every
    branch fires); training starts from small weights, with the mHC and sinks left random but mild."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2 and not name.endswith("_fn"):
                p.normal_(0, 0.02 if "experts" not in name else 0.02)
            elif name.endswith("_fn"):
                p.normal_(0, 1e-3)
            elif name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith(("attn_sink", "_base", ".ape", "gate.bias")):
                p.zero_()
            elif name.endswith("_scale"):
                p.fill_(1.0)


def _plot(log: list[dict], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not available: no loss.png", flush=True)
        return
    steps = [r["step"] for r in log]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(steps, [r["loss"] for r in log], label="main next-token loss")
    ax.plot(steps, [r["mtp_loss"] for r in log], label="MTP (t+2) loss")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats)")
    ax.set_title("v4-tiny-pystdlib training")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
