"""examples/distill_mtp.py on a tiny random V4 checkpoint in the release format: distillation trains only
the MTP block, lowers its KL to the main model, and writes a checkpoint whose other tensors are the input's
bytes."""
from __future__ import annotations

import itertools
import json
import math
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from dsv4c import ModelConfig, load_model, save_checkpoint, write_random_checkpoint

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
import distill_mtp as dm

PRESET = "v4-tiny-a"
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    """Release format (FP8 attention, MXFP4 experts), several shards plus an index, and a README."""
    path = tmp_path_factory.mktemp("src") / "ckpt"
    write_random_checkpoint(ModelConfig.preset(PRESET), path, seed=0, quant="release", max_shard_bytes=200_000)
    (path / "README.md").write_text("# tiny random model\n")
    (path / "tokenizer.json").write_text("{}\n")
    assert (path / dm.INDEX_FILE).is_file() and len(list(path.glob("*.safetensors"))) > 1
    return path


def _ids(B: int, L: int, seed: int) -> torch.Tensor:
    V = ModelConfig.preset(PRESET).vocab_size
    return torch.randint(0, V, (B, L), generator=torch.Generator().manual_seed(seed))


def _disk(path: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(str(f), "pt") as h:
            out.update({(f.name, k): h.get_tensor(k) for k in h.keys()})
    return out


def _bytes_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and \
        torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


def _trained(ckpt: Path, steps: int, ids: torch.Tensor, lr: float = 1e-2):
    model = load_model(ckpt)
    params = dm.freeze_main(model)
    log = dm.train(model, params, itertools.repeat(ids), CPU, dm.Schedule(lr, 1), 0.0, steps, math.inf, log_every=1)
    return model, log


def test_only_mtp_parameters_train_and_the_kl_drops_on_the_training_batch(ckpt):
    ids = _ids(2, 33, seed=1)
    ref = load_model(ckpt)
    before = {n: p.detach().clone() for n, p in ref.named_parameters()}
    with torch.no_grad():
        kl0 = dm.distill_loss(ref, ids, 0.0)[1]["kl"].item()
    model, log = _trained(ckpt, 8, ids)
    assert log[-1]["steps"] == 8
    with torch.no_grad():
        kl1 = dm.distill_loss(model, ids, 0.0)[1]["kl"].item()
    assert kl1 < 0.6 * kl0, (kl0, kl1)
    moved = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    mtp = {n for n in before if n.startswith("mtp.")}
    assert moved <= mtp  # the main model is untouched, bit for bit
    # every MTP parameter with a gradient path moved (the router bias only selects experts: no gradient)
    assert moved == mtp - {"mtp.0.ffn.gate.bias"}, sorted(mtp - moved)


def test_distill_terms_match_their_definitions():
    g = torch.Generator().manual_seed(3)
    student, teacher = torch.randn(2, 5, 11, generator=g), torch.randn(2, 5, 11, generator=g)
    kl, ce, agree = dm.distill_terms(student, teacher)
    p, q = teacher.double().softmax(-1), student.double().softmax(-1)
    want_kl = (p * (p.log() - q.log())).sum(-1).mean()
    top = teacher.argmax(-1)
    want_ce = -q.log().gather(-1, top[..., None]).mean()
    assert abs(kl.item() - want_kl.item()) < 1e-5 and abs(ce.item() - want_ce.item()) < 1e-5
    assert agree.item() == pytest.approx((student.argmax(-1) == top).double().mean().item(), abs=1e-6)
    assert dm.distill_terms(teacher, teacher)[0].abs().item() < 1e-6  # KL(p || p) = 0


def _successor(ids: torch.Tensor, V: int) -> torch.Tensor:
    return (ids * 7 + 3) % V


def test_positions_of_teacher_student_and_corpus(monkeypatch):
    """With stand-in forwards whose top-1 is known, the MTP row for t+2 (fed token t+1) must be compared
    with the main model's row t+1 and with the corpus token t+2: exact agreement 1, KL 0."""
    V = 13

    def main_fwd(model, ids):  # the main model predicts succ(token at t) for t+1
        return 20.0 * torch.nn.functional.one_hot(_successor(ids, V), V).float(), ids[..., None].float()

    def mtp_fwd(model, streams, next_ids):  # the MTP block predicts succ(token at t+1) for t+2
        assert torch.equal(streams[:, 1:, 0].long(), next_ids[:, :-1])  # streams at t, token t+1
        return 20.0 * torch.nn.functional.one_hot(_successor(next_ids, V), V).float(), streams

    monkeypatch.setattr(dm, "train_forward", main_fwd)
    monkeypatch.setattr(dm, "train_mtp_forward", mtp_fwd)
    g = torch.Generator().manual_seed(8)
    wins = torch.randint(0, V, (5, 12), generator=g)
    for pos in range(6, 12):  # the second half of each window follows the rule
        wins[:, pos] = _successor(wins[:, pos - 1], V)
    r = dm.evaluate(None, wins, CPU, batch=2)
    assert r["agree"] == 1.0 and r["kl"] < 1e-6 and r["mtp_rows"] == 5 * 10 and r["tokens"] == 5 * 11
    hits = (wins[:, 2:] == _successor(wins[:, 1:-1], V)).double().mean().item()  # corpus t+2 vs succ(t+1)
    assert r["mtp_top1"] == pytest.approx(hits) and 0 < hits < 1
    logits = 20.0 * torch.nn.functional.one_hot(_successor(wins[:, :-1], V), V).double()
    want = torch.nn.functional.cross_entropy(logits.flatten(0, 1), wins[:, 1:].flatten()).item()
    assert r["loss"] == pytest.approx(want, rel=1e-6)
    loss, terms = dm.distill_loss(None, wins, ce_weight=0.5)
    assert terms["agree"].item() == 1.0 and loss.item() < 1e-6
    # greedy text: the main model's continuation follows succ, and the MTP draft matches every generated t+2
    seqs = dm.continuations(None, wins[:, :3], 7, CPU)
    assert torch.equal(seqs[:, :3], wins[:, :3]) and seqs.shape == (5, 10)
    assert torch.equal(seqs[:, 3:], _successor(seqs[:, 2:-1], V))
    assert dm.greedy_agreement(None, seqs, 3, CPU) == {"agree_greedy": 1.0, "greedy_rows": 5 * 6}
    seqs[:, 5] = (seqs[:, 5] + 1) % V  # a generated token the main model would not have produced
    # rows t = 2..7: the draft for position 5 misses it, and the draft fed it (for 6) misses too
    assert dm.greedy_agreement(None, seqs, 3, CPU)["agree_greedy"] == pytest.approx(4 / 6)


def test_written_checkpoint_changes_only_mtp_tensors(ckpt, tmp_path):
    model, _ = _trained(ckpt, 4, _ids(2, 33, seed=2))
    out = tmp_path / "out"
    counts = dm.write_distilled(model, ckpt, out)
    src, dst = _disk(ckpt), _disk(out)
    assert set(src) == set(dst)  # same shard files holding the same names
    changed = {k for k in src if not _bytes_equal(src[k], dst[k])}
    assert changed and all(name.startswith("mtp.") for _, name in changed)
    n_mtp = sum(name.startswith("mtp.") for _, name in src)
    assert counts == {"mtp_tensors_rewritten": n_mtp, "mtp_tensors_changed": len(changed),
                      "non_mtp_tensors_identical": len(src) - n_mtp}
    for f in ("config.json", dm.INDEX_FILE, "tokenizer.json", "README.md"):
        assert (out / f).read_bytes() == (ckpt / f).read_bytes(), f
    # the MTP tensors are the release encoding of the trained weights, as save_checkpoint writes them
    ref_dir = tmp_path / "ref"
    save_checkpoint(model, ref_dir, quant="release")
    want, got, orig = load_model(ref_dir).state_dict(), load_model(out).state_dict(), load_model(ckpt).state_dict()
    for name, t in got.items():
        assert torch.equal(t, want[name] if name.startswith("mtp.") else orig[name]), name
    fmt = {name: t.dtype for (_, name), t in dst.items()}
    assert fmt["mtp.0.e_proj.weight"] == torch.float8_e4m3fn and fmt["mtp.0.ffn.experts.0.w1.weight"] == torch.int8


def test_run_reports_agreement_from_the_reloaded_checkpoint(ckpt, tmp_path):
    out = tmp_path / "run"
    a = dm.parse_args(["--ckpt", str(ckpt), "--out", str(out), "--device", "cpu", "--steps", "6", "--batch", "2",
                       "--seq", "32", "--lr", "1e-2", "--warmup", "1", "--eval-seq", "32", "--eval-windows", "4",
                       "--eval-batch", "3", "--log-every", "2", "--minutes", "10", "--gen-prompts", "2",
                       "--gen-prompt-len", "8", "--gen-tokens", "6"])
    train_stream, held_stream = _ids(1, 4000, seed=4)[0], _ids(1, 200, seed=5)[0]
    r = dm.run(a, train_stream, held_stream, time.perf_counter(), command="python examples/distill_mtp.py TEST")
    assert r["steps"] == 6 and [rec["step"] for rec in r["log"]] == [0, 2, 4]
    assert json.loads((out / "distill_log.json").read_text()) == json.loads(json.dumps(r))
    assert r["checks"]["main_loss_equal_in_memory"] and r["checks"]["main_loss_equal_release"]
    b, m, q = r["held_out_before"], r["held_out_after"], r["held_out_after_release"]
    assert b["windows"] == 4 and q["mtp_rows"] == 4 * 31
    assert q["greedy_rows"] == 2 * 5 and all(0 <= x["agree_greedy"] <= 1 for x in (b, m, q))
    # the reported agreement of the written checkpoint, recomputed through the cached reference path
    model = load_model(out)
    wins = dm.windows(held_stream, 32, 4)
    with torch.no_grad():
        logits, streams = model.forward_with_streams(wins)
        draft, _ = model.mtp_forward(streams[:, :-2], wins[:, 1:-1], model.new_mtp_cache(4, max_len=31))
        agree = (draft.argmax(-1) == logits[:, 1:-1].argmax(-1)).double().mean().item()
        top1 = (draft.argmax(-1) == wins[:, 2:]).double().mean().item()
    assert abs(q["agree"] - agree) <= 1 / q["mtp_rows"] + 1e-9, (q["agree"], agree)
    assert abs(q["mtp_top1"] - top1) <= 1 / q["mtp_rows"] + 1e-9
    # distillation on random text moves the held-out KL of this random model down
    assert m["kl"] < b["kl"] and q["kl"] < b["kl"], (b["kl"], m["kl"], q["kl"])
    readme = (out / "README.md").read_text()
    assert readme.startswith("# tiny random model\n") and "## MTP distillation" in readme
    assert "python examples/distill_mtp.py TEST" in readme and f"{q['agree']:.1%}" in readme


def test_minutes_bound_stops_training(ckpt, tmp_path):
    a = dm.parse_args(["--ckpt", str(ckpt), "--out", str(tmp_path / "o"), "--device", "cpu", "--batch", "2",
                       "--seq", "32", "--eval-seq", "32", "--eval-windows", "2", "--minutes", "0.001",
                       "--gen-tokens", "0"])
    t0 = time.perf_counter()
    r = dm.run(a, _ids(1, 2000, seed=6)[0], _ids(1, 100, seed=7)[0], t0)
    assert r["steps"] == 0 and r["checks"]["main_loss_equal_release"]
    assert (tmp_path / "o" / "distill_log.json").is_file()


def test_out_must_not_be_the_input(ckpt):
    with pytest.raises(SystemExit):
        dm.parse_args(["--ckpt", str(ckpt), "--out", str(ckpt)])


def test_on_policy_rows_replace_every_nth_batch():
    corpus = (torch.zeros(4, 9, dtype=torch.int64) + i for i in itertools.count())
    pool = torch.full((3, 9), -1, dtype=torch.int64)
    got = list(itertools.islice(dm.mixed_batches(corpus, pool, 2, seed=0), 6))
    assert [int(b[0, 0]) for b in got] == [0, -1, 2, -1, 4, -1] and all(b.shape == (4, 9) for b in got)
    plain = (torch.zeros(4, 9, dtype=torch.int64) + i for i in itertools.count())
    assert [int(b[0, 0]) for b in itertools.islice(dm.mixed_batches(plain, pool[:0], 2, seed=0), 3)] == [0, 1, 2]
