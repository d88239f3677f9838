"""Sharded artifacts end to end on CPU (gloo): `compile --tp/--ep`, `dsv4c run` starting one worker per
rank, greedy tokens equal to the single-process artifact's (with and without MTP), a killed worker
named. Slow (compiles two artifacts and starts worker processes)."""
from __future__ import annotations

import threading
import time

import pytest
import torch

from dsv4c import ModelConfig
from dsv4c.checkpoint import write_random_checkpoint
from dsv4c.cli import main as cli_main
from dsv4c.compile import ArtifactError, compile_checkpoint, read_manifest
from dsv4c.parallel import ParallelPlan
from dsv4c.runtime import Session
from dsv4c.runtime.distributed import WorkerError, launch_workers

pytestmark = pytest.mark.slow
# sliding + CSA layers, hash and learned routing, MTP: these tests are about the launch, the layout and the
# token match, not the layer kinds; the sharded HCA layer (ratio 8) is checked against one process in
# tests/test_shard.py::test_sharded_logits_equal_single_process (its V4_CFG keeps it), here it cost a third
# of both compiles
V4_CFG = dict(num_hidden_layers=2, compress_ratios=(0, 4, 0), num_hash_layers=1, hc_sinkhorn_iters=3)
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [3, 4]]
NEW = 6


KW = dict(target="cpu", max_tokens=32, max_batch=2, dtype=torch.float32, mtp_k=1)


@pytest.fixture(scope="module")
def arts(tmp_path_factory):
    d = tmp_path_factory.mktemp("par")
    write_random_checkpoint(ModelConfig.preset("v4-tiny-a").replace(**V4_CFG), d / "ckpt", seed=3,
                            dtype=torch.float32)
    compile_checkpoint(d / "ckpt", d / "tp2", plan=ParallelPlan(2, 1), **KW)
    return d


@pytest.fixture(scope="module")
def single(arts):
    """The same checkpoint compiled for one process: only the (long) token comparison needs it; the
    single-GPU layout (no parallel/ranks entries, graphs/ and weights/ folders) is checked on
    tests/test_compile_session.py's artifacts (test_manifest_lists_every_file_with_its_hash)."""
    compile_checkpoint(arts / "ckpt", arts / "single", **KW)
    return arts / "single"


def _single_tokens(art, mtp: int) -> list[list[int]]:
    sess = Session.load(art)
    return [r.tokens for r in sess.generate(PROMPTS, max_new_tokens=NEW, mtp=mtp)]


def _argv(art, mtp: int) -> list[str]:
    out = ["run", str(art), "--device", "cpu", "--max-new-tokens", str(NEW), "--mtp", str(mtp),
           "--worker-timeout", "600"]
    for p in PROMPTS:
        out += ["--prompt-ids", ",".join(map(str, p))]
    return out


def test_sharded_layout_and_manifest(arts):
    m = read_manifest(arts / "tp2")  # checks every file's hash
    assert m["parallel"] == {"tp": 2, "ep": 1, "world_size": 2}
    for r in (0, 1):
        assert {f"rank{r}/graphs/{k}.pt2" for k in ("prefill", "decode", "verify", "mtp")} <= set(m["files"])
        assert all(w["file"].startswith(f"rank{r}/weights/") for w in m["ranks"][r]["weights"].values())
    H, d = 4, 64
    assert m["ranks"][1]["weights"]["model.layers.0.attn.wq_b.weight"]["shape"] == [H * d // 2, 32]


def test_sharded_artifact_refuses_a_single_process(arts):
    with pytest.raises(ArtifactError, match=r"tp=2.*\(2 rank\(s\)\), but this run has 1 process"):
        Session.load(arts / "tp2")


@pytest.mark.long  # two worker launches of ~30-60 s each: `pytest -m long`
@pytest.mark.parametrize("mtp", [0, 1])
def test_workers_generate_the_single_process_tokens(arts, single, mtp, capfd):
    want = _single_tokens(single, mtp)
    capfd.readouterr()
    assert cli_main(_argv(arts / "tp2", mtp)) == 0
    lines = [ln for ln in capfd.readouterr().out.splitlines() if ln.strip()]
    got = [[int(t) for t in ln.split(" ")[1].split(",")] for ln in lines[-len(PROMPTS):]]
    assert got == want and all(len(t) == NEW for t in want)


def test_a_killed_worker_ends_the_run_naming_its_rank(arts):
    def kill_rank1(procs):
        def later():
            time.sleep(4.0)
            procs[1].kill()
        threading.Thread(target=later, daemon=True).start()

    t0 = time.monotonic()
    procs_seen = []
    with pytest.raises(WorkerError, match="rank 1 was killed by signal 9"):
        launch_workers(_argv(arts / "tp2", 0), 2, timeout_s=300,
                       started=lambda ps: (procs_seen.extend(ps), kill_rank1(ps)))
    assert all(p.poll() is not None for p in procs_seen)  # no orphans
    assert time.monotonic() - t0 < 300
