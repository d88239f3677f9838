"""Distil the MTP block of a trained V4 checkpoint from its own main model, to raise draft acceptance.

Draft acceptance at temperature 0 is agreement between the MTP block's top-1 for token t+2 and the main
model's top-1 at position t+1. `examples/train_tiny.py` trained the MTP block against the *corpus* token
t+2; here the main model is frozen and only the `mtp.*` parameters train, on

    KL(teacher || student) + ce_weight · CE(student, argmax teacher)

where, for position t, the student is the MTP distribution for t+2 (from the main streams at t and the
token t+1) and the teacher is softmax(main logits at t+1) (temperature 1). Each step runs the frozen main
model forward under no_grad (bf16 autocast on CUDA) on a fresh batch of the training corpus (the same
stdlib files and HELD_OUT split as train_tiny.py); nothing is precomputed.

Figures on the held-out files, before and after, in memory and after re-quantising to the release format
(the written checkpoint, reloaded): teacher-forced MTP top-1 agreement with the main model's argmax (the
acceptance proxy), MTP top-1 against the corpus, the distillation KL, and the main held-out loss, which
must not move (asserted to 1e-6: the main weights are untouched).

The output folder is the input checkpoint with only the MTP tensors rewritten: every other tensor is
byte-identical (checked after writing); the MTP tensors are quantised by `save_checkpoint(quant="release")`,
as train_tiny.py writes them. config.json, tokenizer.json, the index and the other files are copied;
README.md gets an "MTP distillation" section; distill_log.json holds settings, figures and the step log.

`--minutes` bounds the whole run (corpus, model loading, evaluations, writing, reloading): training stops
early enough to leave room for what follows, estimated from the time the first evaluation took.

    python examples/distill_mtp.py --out OUT --minutes 2.5              # CUDA, bf16 autocast
    python examples/distill_mtp.py --out OUT --device cpu --minutes 2 --batch 8 --seq 128 \
        --eval-windows 8 --eval-seq 256 --gen-prompts 2 --gen-tokens 32   # a CPU smoke run
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file

from dsv4c import load_model, save_checkpoint
from dsv4c.model.v4_train import train_forward, train_mtp_forward

ROOT = Path(__file__).resolve().parents[1]
BUNDLE = ROOT / "examples" / "models" / "v4-tiny-pystdlib"
INDEX_FILE = "model.safetensors.index.json"
MTP_PREFIX = "mtp."

# Legend: B batch, L window length (tokens), R = L - 1 student rows (or L - 2 with corpus targets), V vocab.


# ------------------------------------------------------------------------------------------------
# objective and figures
# ------------------------------------------------------------------------------------------------
def _autocast(device: torch.device):
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")


def teacher_student(model, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ids [B, L] -> (main logits [B, L, V] (no grad), student logits [B, L-1, V], teacher logits [B, L-1, V]).
    Student row t predicts token t+2 from the main streams at t and token t+1; teacher row t is the main
    model's next-token logits at position t+1. Only the MTP block is on the autograd tape."""
    with torch.no_grad():
        logits, streams = train_forward(model, ids)
    student, _ = train_mtp_forward(model, streams[:, :-1], ids[:, 1:])
    return logits, student, logits[:, 1:]


def distill_terms(student: torch.Tensor, teacher: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """student, teacher [B, R, V] -> (mean KL(teacher || student), mean CE(student, argmax teacher),
    top-1 agreement), each over the B·R rows; fp32."""
    logq = student.float().log_softmax(-1)
    logp = teacher.float().log_softmax(-1)
    kl = (logp.exp() * (logp - logq)).sum(-1).mean()
    top = teacher.argmax(-1)
    ce = F.nll_loss(logq.flatten(0, 1), top.flatten())
    agree = (student.argmax(-1) == top).float().mean()
    return kl, ce, agree


def distill_loss(model, ids: torch.Tensor, ce_weight: float) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The training objective on ids [B, L]: (loss, detached {kl, ce, agree})."""
    _, student, teacher = teacher_student(model, ids)
    kl, ce, agree = distill_terms(student, teacher)
    loss = kl + ce_weight * ce if ce_weight else kl
    return loss, {"kl": kl.detach(), "ce": ce.detach(), "agree": agree}


def windows(stream: torch.Tensor, T: int, max_windows: int) -> torch.Tensor:
    """Non-overlapping windows [n, T+1] from the start of a token stream, as train_tiny.evaluate."""
    n = min((stream.numel() - 1) // T, max_windows)
    if n < 1:
        raise ValueError(f"held-out stream of {stream.numel()} tokens has no window of {T + 1}")
    return torch.stack([stream[i * T : i * T + T + 1] for i in range(n)])


@contextlib.contextmanager
def _deterministic():
    """Deterministic kernels (CUDA index_add_ included) so that the main loss repeats exactly."""
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(was)


@torch.no_grad()
def evaluate(model, wins: torch.Tensor, device: torch.device, batch: int = 16) -> dict:
    """Teacher-forced figures over windows wins [n, L] (each from position 0):
    main next-token loss, MTP top-1 agreement with the main argmax (the acceptance proxy), MTP top-1 and
    CE against the corpus token t+2, and KL(main || MTP). MTP rows t = 0..L-3 (those with a corpus target)."""
    sums = {"loss": 0.0, "agree": 0.0, "mtp_top1": 0.0, "mtp_loss": 0.0, "kl": 0.0}
    n_main = n_mtp = 0
    with _deterministic():
        for i in range(0, wins.shape[0], batch):
            ids = wins[i : i + batch].to(device)
            B, L = ids.shape
            with _autocast(device):
                logits, streams = train_forward(model, ids)
                draft, _ = train_mtp_forward(model, streams[:, :-2], ids[:, 1:-1])  # [B, L-2, V] for t+2
            main = logits[:, :-1].float()
            sums["loss"] += F.cross_entropy(main.flatten(0, 1), ids[:, 1:].flatten(), reduction="sum").double().item()
            teacher = logits[:, 1:-1]
            kl, _, _ = distill_terms(draft, teacher)
            rows = B * (L - 2)
            sums["agree"] += (draft.argmax(-1) == teacher.argmax(-1)).sum().item()
            sums["kl"] += kl.double().item() * rows
            sums["mtp_top1"] += (draft.argmax(-1) == ids[:, 2:]).sum().item()
            sums["mtp_loss"] += F.cross_entropy(draft.float().flatten(0, 1), ids[:, 2:].flatten(),
                                                reduction="sum").double().item()
            n_main += B * (L - 1)
            n_mtp += rows
    out = {k: v / (n_main if k == "loss" else n_mtp) for k, v in sums.items()}
    out.update(ppl=math.exp(out["loss"]), windows=int(wins.shape[0]), tokens=n_main, mtp_rows=n_mtp)
    return out


@torch.no_grad()
def continuations(model, prompts: torch.Tensor, n_new: int, device: torch.device, temperature: float = 0.0,
                  gen: torch.Generator | None = None) -> torch.Tensor:
    """prompts [B, P] -> [B, P + n_new]: the main model's continuations, each step a full no-cache
    forward (train_forward) over the sequence so far. Temperature 0: greedy, with deterministic
    kernels; else sampled at `temperature` with `gen` (on-policy text for the MTP to imitate)."""
    ids = prompts.to(device)
    with _deterministic() if temperature == 0 else contextlib.nullcontext():
        for _ in range(n_new):
            with _autocast(device):
                logits, _ = train_forward(model, ids)
            if temperature == 0:
                nxt = logits[:, -1].argmax(-1, keepdim=True)
            else:
                p = torch.softmax(logits[:, -1].float() / temperature, -1).cpu()
                nxt = torch.multinomial(p, 1, generator=gen).to(device)
            ids = torch.cat([ids, nxt], 1)
    return ids.cpu()


def mixed_batches(corpus: Iterator[torch.Tensor], pool: torch.Tensor, every: int, seed: int) -> Iterator[torch.Tensor]:
    """Corpus batches, with every `every`-th batch replaced by the rows of `pool` [N, T+1] in a seeded
    random order (B rows each, B = the corpus batch size)."""
    g = torch.Generator().manual_seed(seed + 1)
    step = 0
    while True:
        batch = next(corpus)
        if pool.numel() and every and step % every == every - 1:
            batch = pool[torch.randint(0, pool.shape[0], (batch.shape[0],), generator=g)]
        step += 1
        yield batch


@torch.no_grad()
def greedy_agreement(model, seqs: torch.Tensor, n_prompt: int, device: torch.device) -> dict:
    """On-policy acceptance proxy: over the main model's own greedy sequences seqs [B, L] (prompt of
    n_prompt tokens), the fraction of rows where the MTP draft for t+2 (fed the generated token t+1)
    equals the token the main model generated at t+2. Rows t = n_prompt-1 .. L-3."""
    ids = seqs.to(device)
    with _deterministic(), _autocast(device):
        _, streams = train_forward(model, ids)
        draft, _ = train_mtp_forward(model, streams[:, n_prompt - 1 : -2], ids[:, n_prompt:-1])
    hits = (draft.argmax(-1) == ids[:, n_prompt + 1 :]).sum().item()
    return {"agree_greedy": hits / draft.shape[0] / draft.shape[1], "greedy_rows": draft.shape[0] * draft.shape[1]}


def figures(model, held: torch.Tensor, gen: torch.Tensor | None, n_prompt: int, device: torch.device,
            batch: int) -> dict:
    """evaluate() on the held-out windows, plus greedy_agreement() when there are greedy sequences."""
    out = evaluate(model, held, device, batch)
    if gen is not None:
        out.update(greedy_agreement(model, gen, n_prompt, device))
    return out


# ------------------------------------------------------------------------------------------------
# training
# ------------------------------------------------------------------------------------------------
def freeze_main(model) -> list[torch.nn.Parameter]:
    """Main model frozen and in eval mode; returns the trainable MTP parameters (all `mtp.*`)."""
    model.eval()
    params = []
    for name, p in model.named_parameters():
        p.requires_grad_(name.startswith(MTP_PREFIX))
        if p.requires_grad:
            params.append(p)
    if not params:
        raise ValueError("checkpoint has no MTP block (no `mtp.*` parameters): nothing to distil")
    return params


@dataclass(frozen=True)
class Schedule:
    """Peak lr with linear warm-up over `warmup` steps, then a cosine to 10% over the run's progress."""
    lr: float
    warmup: int

    def __call__(self, step: int, progress: float) -> float:
        cos = 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(max(progress, 0.0), 1.0)))
        return self.lr * min(1.0, (step + 1) / self.warmup) * cos


def train(model, params: list[torch.nn.Parameter], data: Iterator[torch.Tensor], device: torch.device,
          sched: Schedule, ce_weight: float, max_steps: int, stop_at: float, log_every: int = 25,
          clip: float = 1.0) -> list[dict]:
    """AdamW on `params` until `max_steps` or the wall clock reaches `stop_at` (perf_counter seconds).
    Progress for the cosine = max(step fraction, time fraction). Returns the logged records."""
    opt = torch.optim.AdamW(params, lr=sched.lr, betas=(0.9, 0.95), weight_decay=0.0)
    t0 = time.perf_counter()
    budget = max(stop_at - t0, 1e-9)
    log, step = [], 0
    while step < max_steps and time.perf_counter() < stop_at:
        lr = sched(step, max(step / max_steps, (time.perf_counter() - t0) / budget))
        for grp in opt.param_groups:
            grp["lr"] = lr
        ids = next(data).to(device, non_blocking=True)
        with _autocast(device):
            loss, terms = distill_loss(model, ids, ce_weight)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, clip)
        opt.step()
        if step % log_every == 0:
            rec = {"step": step, "seconds": round(time.perf_counter() - t0, 2), "lr": lr,
                   **{k: v.item() for k, v in terms.items()}}
            log.append(rec)
            print(json.dumps(rec), flush=True)
        step += 1
    log.append({"steps": step, "seconds": time.perf_counter() - t0})
    return log


# ------------------------------------------------------------------------------------------------
# writing: the input checkpoint with its MTP tensors replaced
# ------------------------------------------------------------------------------------------------
def shard_files(ckpt: Path) -> list[str]:
    """The safetensors files of a checkpoint folder: from its index, else the folder's *.safetensors."""
    index = ckpt / INDEX_FILE
    if index.is_file():
        return sorted(set(json.loads(index.read_text())["weight_map"].values()))
    files = sorted(p.name for p in ckpt.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{ckpt}: no *.safetensors files and no {INDEX_FILE}")
    return files


def _raw(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(_raw(a), _raw(b))


def write_distilled(model, src: Path, out: Path) -> dict:
    """Write `src` to `out` with the MTP tensors taken from `model` (a CPU model), quantised by
    `save_checkpoint(quant="release")`; every other tensor is copied as stored, shard by shard (re-encoding
    would not do: MXFP4 re-quantisation of dequantised weights gives the same values but not always the
    same bytes). Returns counts."""
    out.mkdir(parents=True, exist_ok=True)
    for stale in list(out.glob("*.safetensors")) + [out / INDEX_FILE]:  # from an earlier run into this folder
        stale.unlink(missing_ok=True)
    with tempfile.TemporaryDirectory(dir=out, prefix=".mtp-encode-") as tmp:
        save_checkpoint(model, tmp, quant="release", overwrite=True, max_shard_bytes=1 << 40)
        with safe_open(str(Path(tmp) / "model.safetensors"), "pt") as h:
            fresh = {k: h.get_tensor(k) for k in h.keys() if k.startswith(MTP_PREFIX)}
            fresh_names = set(h.keys())
        src_names: set[str] = set()
        replaced = changed = 0
        for fname in shard_files(src):
            with safe_open(str(src / fname), "pt") as h:
                meta = h.metadata()
                tensors = {k: h.get_tensor(k) for k in h.keys()}
            src_names |= set(tensors)
            for k, old in tensors.items():
                if not k.startswith(MTP_PREFIX):
                    continue
                new = fresh.get(k)
                if new is None or new.dtype != old.dtype or new.shape != old.shape:
                    got = "missing" if new is None else f"{new.dtype} {list(new.shape)}"
                    raise ValueError(f"{src / fname}: MTP tensor {k!r} is {old.dtype} {list(old.shape)} on disk, "
                                     f"but the release encoding gives {got}: not the release layout")
                changed += not same_bytes(old, new)
                tensors[k] = new
                replaced += 1
            save_file(tensors, str(out / fname), metadata=meta)
    if src_names != fresh_names:
        diff = sorted(src_names ^ fresh_names)[:5]
        raise ValueError(f"{src}: tensor names differ from the model's release encoding (e.g. {diff})")
    for f in src.iterdir():  # config.json, tokenizer.json, the index, README/log/plot: copied as they are
        if f.is_file() and not f.name.endswith(".safetensors"):
            shutil.copyfile(f, out / f.name)
    return {"mtp_tensors_rewritten": replaced, "mtp_tensors_changed": changed, **verify_copy(src, out)}


def verify_copy(src: Path, out: Path) -> dict:
    """Every non-MTP tensor of `out` is byte-identical to `src` (raises otherwise); counts."""
    same = 0
    for fname in shard_files(src):
        with safe_open(str(src / fname), "pt") as a, safe_open(str(out / fname), "pt") as b:
            if set(a.keys()) != set(b.keys()):
                raise AssertionError(f"{out / fname}: tensor names differ from {src / fname}")
            for k in a.keys():
                if k.startswith(MTP_PREFIX):
                    continue
                if not same_bytes(a.get_tensor(k), b.get_tensor(k)):
                    raise AssertionError(f"{out / fname}: non-MTP tensor {k!r} differs from {src / fname}")
                same += 1
    return {"non_mtp_tensors_identical": same}


def main_params_digest(model) -> float:
    """A cheap fingerprint of the non-MTP parameters (float64 sum of |w|·(1 + index mod 7))."""
    tot = 0.0
    for i, (name, p) in enumerate(model.named_parameters()):
        if not name.startswith(MTP_PREFIX):
            tot += p.detach().double().abs().sum().item() * (1 + i % 7)
    return tot


# ------------------------------------------------------------------------------------------------
# driver
# ------------------------------------------------------------------------------------------------
def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ckpt", type=Path, default=BUNDLE, help="release-format V4 checkpoint folder with an MTP block")
    ap.add_argument("--out", type=Path, required=True, help="output folder (must not be --ckpt)")
    ap.add_argument("--minutes", type=float, default=2.5, help="hard wall-clock bound for the whole run")
    ap.add_argument("--steps", type=int, default=100000, help="at most this many training steps")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seq", type=int, default=512, help="training window (tokens)")
    ap.add_argument("--lr", type=float, default=1e-3, help="peak learning rate")
    ap.add_argument("--warmup", type=int, default=30, help="linear warm-up steps")
    ap.add_argument("--ce-weight", type=float, default=0.0, help="weight of CE to the main model's argmax")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--eval-seq", type=int, default=512, help="held-out window (train_tiny.py: 512)")
    ap.add_argument("--eval-windows", type=int, default=64, help="held-out windows (train_tiny.py: 64)")
    ap.add_argument("--eval-batch", type=int, default=16)
    ap.add_argument("--gen-prompts", type=int, default=16, help="greedy sequences for the on-policy agreement")
    ap.add_argument("--gen-prompt-len", type=int, default=64, help="their prompt length (held-out tokens)")
    ap.add_argument("--gen-tokens", type=int, default=128, help="greedy tokens per sequence (0: skip)")
    ap.add_argument("--log-every", type=int, default=25)
    ap.add_argument("--self-text", type=int, default=0,
                    help="rows of on-policy text sampled from the main model (--seq + 1 tokens each) to mix in")
    ap.add_argument("--self-prompt", type=int, default=32, help="corpus tokens that start each on-policy row")
    ap.add_argument("--self-temperature", type=float, default=1.0)
    ap.add_argument("--self-every", type=int, default=2, help="every N-th training batch comes from the on-policy rows")
    a = ap.parse_args(argv)
    if a.out.resolve() == a.ckpt.resolve():
        ap.error("--out must differ from --ckpt: the input checkpoint is never modified in place")
    return a


def load_corpus(ckpt: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """(train stream, held-out stream) of train_tiny.py's stdlib split, encoded with the checkpoint's tokenizer."""
    from tokenizers import Tokenizer

    sys.path.insert(0, str(ROOT / "examples"))
    import train_tiny as tt

    tok = Tokenizer.from_file(str(ckpt / "tokenizer.json"))
    train_files, held = tt.stdlib_files()
    if not held:
        raise RuntimeError("no held-out stdlib files found (train_tiny.HELD_OUT) in this Python's stdlib")
    return tt.encode_files(tok, train_files), tt.encode_files(tok, held)


def greedy_prompts(stream: torch.Tensor, B: int, P: int) -> torch.Tensor:
    """B prompts [B, P] from the end of the held-out stream (away from the evaluation windows)."""
    end = stream.numel()
    if B * P > end:
        raise ValueError(f"held-out stream of {end} tokens is too short for {B} prompts of {P}")
    return torch.stack([stream[end - (i + 1) * P : end - i * P] for i in range(B)])


def sample_batches(stream: torch.Tensor, B: int, T: int, seed: int) -> Iterator[torch.Tensor]:
    """train_tiny.batches: random windows [B, T+1] of the stream, seeded."""
    sys.path.insert(0, str(ROOT / "examples"))
    import train_tiny as tt

    return tt.batches(stream, B, T, torch.Generator().manual_seed(seed))


def run(a: argparse.Namespace, train_stream: torch.Tensor, held_stream: torch.Tensor, t_start: float,
        command: str | None = None) -> dict:
    """Everything after the corpus: load, evaluate, distil, write, reload, evaluate, log. Returns the log."""
    deadline = t_start + 60 * a.minutes
    dev = torch.device(a.device)
    torch.manual_seed(a.seed)
    t0 = time.perf_counter()
    model = load_model(a.ckpt).to(dev)
    t_load = time.perf_counter() - t0
    params = freeze_main(model)
    digest = main_params_digest(model)
    held = windows(held_stream, a.eval_seq, a.eval_windows)

    evaluate(model, held[:1, : min(65, held.shape[1])], dev, 1)  # first-call costs out of the timing below
    t0 = time.perf_counter()
    gen = None
    if a.gen_tokens and a.gen_prompts:  # the main model is frozen: its greedy sequences are made once
        gen = continuations(model, greedy_prompts(held_stream, a.gen_prompts, a.gen_prompt_len),
                                   a.gen_tokens, dev)
    t_gen = time.perf_counter() - t0
    t0 = time.perf_counter()
    before = figures(model, held, gen, a.gen_prompt_len, dev, a.eval_batch)
    t_eval = time.perf_counter() - t0
    print(json.dumps({"held_out_before": before, "eval_seconds": round(t_eval, 2),
                      "greedy_generation_seconds": round(t_gen, 2)}), flush=True)
    # what follows training: one evaluation in memory, CPU copy + write, reload, one more evaluation
    data = sample_batches(train_stream, a.batch, a.seq, a.seed)
    t_self = 0.0
    if a.self_text:  # on-policy text: the main model's own samples from training-corpus prompts
        t0 = time.perf_counter()
        prompts = next(sample_batches(train_stream, a.self_text, a.self_prompt - 1, a.seed + 7))
        pool = continuations(model, prompts, a.seq + 1 - a.self_prompt, dev, a.self_temperature,
                                     torch.Generator().manual_seed(a.seed + 11))
        data = mixed_batches(data, pool, a.self_every, a.seed)
        t_self = time.perf_counter() - t0
        print(json.dumps({"self_text_rows": pool.shape[0], "self_text_seconds": round(t_self, 1)}), flush=True)
    reserve = 2.5 * t_eval + 2.5 * t_load + 5.0
    stop_at = deadline - reserve
    log = train(model, params, data, dev,
                Schedule(a.lr, a.warmup), a.ce_weight, a.steps, stop_at, a.log_every)
    steps, train_s = log[-1]["steps"], log[-1]["seconds"]

    after = figures(model, held, gen, a.gen_prompt_len, dev, a.eval_batch)
    print(json.dumps({"held_out_after": after}), flush=True)
    digest_after = main_params_digest(model)
    write = write_distilled(model.cpu(), a.ckpt, a.out)
    del model
    release = load_model(a.out).to(dev)
    after_release = figures(release, held, gen, a.gen_prompt_len, dev, a.eval_batch)
    print(json.dumps({"held_out_after_release": after_release}), flush=True)

    checks = {
        "main_params_digest_equal": digest == digest_after,
        "main_loss_equal_in_memory": abs(after["loss"] - before["loss"]) <= 1e-6,
        "main_loss_equal_release": abs(after_release["loss"] - before["loss"]) <= 1e-6,
        **write,
    }
    result = {
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(a).items()},
        "python": sys.version.split()[0], "torch": torch.__version__, "device_name": _device_name(dev),
        "train_tokens_available": int(train_stream.numel()), "held_out_tokens": int(held_stream.numel()),
        "steps": steps, "train_seconds": train_s, "tokens_seen": steps * a.batch * (a.seq + 1),
        "mtp_params": sum(p.numel() for p in params),
        "held_out_before": before, "held_out_after": after, "held_out_after_release": after_release,
        "checks": checks, "total_seconds": time.perf_counter() - t_start, "minutes_bound": a.minutes,
        "log": log[:-1],
    }
    (a.out / "distill_log.json").write_text(json.dumps(result, indent=1) + "\n")
    if (a.out / "README.md").is_file():
        with (a.out / "README.md").open("a") as f:
            f.write(readme_section(result, command))
    summary = {k: result[k] for k in ("steps", "train_seconds", "total_seconds", "checks")}
    summary["agree"] = [before["agree"], after["agree"], after_release["agree"]]
    print(json.dumps(summary), flush=True)
    # asserted last, so that a failing run still leaves its figures on disk
    assert checks["main_params_digest_equal"], "the main model's parameters changed"
    assert checks["main_loss_equal_in_memory"], (before["loss"], after["loss"])
    assert checks["main_loss_equal_release"], (before["loss"], after_release["loss"])
    return result


def readme_section(r: dict, command: str | None) -> str:
    """The "MTP distillation" section appended to the output's README.md."""
    b, m, q = r["held_out_before"], r["held_out_after"], r["held_out_after_release"]
    s = r["settings"]
    cmd = command or (f"python examples/distill_mtp.py --out OUT --minutes {s['minutes']} --batch {s['batch']} "
                      f"--seq {s['seq']} --lr {s['lr']} --ce-weight {s['ce_weight']} --seed {s['seed']}")
    greedy = "agree_greedy" in b
    head = "| MTP block | agreement with the main argmax | top-1 vs corpus t+2 | KL(main ‖ MTP) | main loss |"
    head += " agreement on greedy text |" if greedy else ""
    rows = []
    for name, x in [("input checkpoint", b), ("distilled, in memory (fp32 weights)", m),
                    ("distilled, this release-format checkpoint", q)]:
        row = f"| {name} | {x['agree']:.1%} | {x['mtp_top1']:.1%} | {x['kl']:.3f} | {x['loss']:.4f} |"
        rows.append(row + (f" {x['agree_greedy']:.1%} |" if greedy else ""))
    objective = "KL(main next-token distribution at t+1 ‖ MTP distribution for t+2)"
    if s["ce_weight"]:
        objective += f" + {s['ce_weight']} × CE to the main model's argmax"
    greedy_note = (f"\n- *Agreement on greedy text* is the same agreement on the main model's own greedy "
                   f"continuations ({s['gen_prompts']} held-out prompts of {s['gen_prompt_len']} tokens, "
                   f"{s['gen_tokens']} new tokens each): the closer proxy for draft acceptance at temperature 0."
                   if greedy else "")
    return f"""
## MTP distillation

The MTP block was then distilled from the main model by `examples/distill_mtp.py`.

- **Objective.** The main model is frozen; only `mtp.*` trains, on {objective}, over the training files.
- **Run.** {r['steps']} steps of {s['batch']} × {s['seq']} tokens, AdamW at peak lr {s['lr']} ({s['warmup']} warm-up
  steps, cosine to 10%): {r['train_seconds']:.0f} s of training and {r['total_seconds']:.0f} s in all, on
  {r['device_name']} with torch {r['torch']}, over CPython {r['python']} files.
- **Format.** Every non-MTP tensor in this folder is byte-identical to the input checkpoint. The MTP tensors
  are re-quantised in the release formats.

```bash
{cmd}
```

Teacher-forced figures on {b['windows']} held-out windows of {s['eval_seq']} tokens:

- *Agreement* is the MTP block's top-1 for t+2 against the main model's top-1 at t+1, the teacher-forced
  proxy for draft acceptance.{greedy_note}

{head}
|{'---|' * (6 if greedy else 5)}
""" + "\n".join(rows) + """

All figures are in `distill_log.json`. The measured speculative-decoding acceptance comes from compiling
this folder (`dsv4c compile … --mtp K`) and running `examples/bench_mtp.py --art`.
"""


def _device_name(dev: torch.device) -> str:
    return torch.cuda.get_device_name(dev) if dev.type == "cuda" else "CPU"


def main(argv=None) -> int:
    t_start = time.perf_counter()
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS for the exact-loss check
    a = parse_args(argv)
    command = " ".join(["python examples/distill_mtp.py"] + (sys.argv[1:] if argv is None else list(argv)))
    t0 = time.perf_counter()
    train_stream, held_stream = load_corpus(a.ckpt)
    print(f"corpus: train {train_stream.numel():,} tokens, held-out {held_stream.numel():,} tokens "
          f"({time.perf_counter() - t0:.1f}s)", flush=True)
    run(a, train_stream, held_stream, t_start, command)
    return 0


if __name__ == "__main__":
    sys.exit(main())
