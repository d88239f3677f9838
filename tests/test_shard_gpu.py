"""World size 1 on NCCL (issue 24): `dsv4c compile --tp 1 --ep 1` writes the plain single-GPU artifact
(the shard pass skips a one-rank plan), and that artifact run by a launcher worker (torchrun's
environment, NCCL process group of one rank: what `torchrun --nproc-per-node 1 -m dsv4c run ART` does)
gives the tokens of the same artifact run in-process. On the device: `pytest -m gpu tests/test_shard_gpu.py`
(under 2 minutes on one H200: the bundled model's compile is most of it)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dsv4c.cli import main as cli_main
from dsv4c.compile import read_manifest
from dsv4c.runtime.distributed import launch_workers

pytestmark = pytest.mark.gpu
BUNDLE = Path(__file__).resolve().parents[1] / "examples" / "models" / "v4-tiny-pystdlib"
PROMPTS = ["5,6,7,8,9,10,11", "3,4,200,17"]


def _run_argv(art: Path) -> list[str]:
    out = ["run", str(art), "--device", "cuda", "--max-new-tokens", "12", "--worker-timeout", "300"]
    for p in PROMPTS:
        out += ["--prompt-ids", p]
    return out


def _tokens(out: str) -> str:
    """The run's printed generations: each prompt's ids then its decoded continuation, which may itself hold
    newlines, so the text from the first prompt on (NCCL's own log lines dropped) is compared whole."""
    text = "\n".join(ln for ln in out.splitlines() if "NCCL" not in ln)
    starts = [text.find("\n" + p) if i else text.find(p) for i, p in enumerate(PROMPTS)]
    assert all(s >= 0 for s in starts) and starts == sorted(starts), out[-2000:]
    return text[starts[0]:]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_world_size_one_on_nccl_gives_the_single_gpu_tokens(tmp_path, capfd, monkeypatch):
    art = tmp_path / "p11"
    assert cli_main(["compile", str(BUNDLE), "--target", "h200", "--tp", "1", "--ep", "1", "--max-tokens", "64",
                     "--max-batch", "2", "-o", str(art)]) == 0
    m = read_manifest(art)
    assert "parallel" not in m and all(f.startswith(("graphs/", "weights/")) or "/" not in f for f in m["files"])
    capfd.readouterr()
    assert cli_main(_run_argv(art)) == 0  # world size 1, no torchrun env: in this process, no process group
    want = _tokens(capfd.readouterr().out)
    monkeypatch.setenv("NCCL_DEBUG", "INFO")  # the worker's NCCL announces itself
    assert launch_workers(_run_argv(art), 1, timeout_s=300) == 0
    cap = capfd.readouterr()
    assert _tokens(cap.out) == want
    assert "NCCL INFO" in cap.out + cap.err  # the worker's process group is NCCL (its one broadcast: the stop)
