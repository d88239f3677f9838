"""examples/bench_prefix_cache.py --quick --turn2 on the CPU: a compiled artifact (cpu target, exported graphs,
not the eager step) served through the Session; the second chat turn resumes past the first answer's
completed blocks and gives the tokens of the cache-off run (fp32), decoding in MTP rounds (the answers' blocks
come from the rounds; the restored slots are the compiled prefill's). Plain decoding over cached answers is
tests/test_prefix_cache.py's; a second compile here for it cost half a minute of the suite."""
from __future__ import annotations

import json
import sys
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
MTP = 2  # drafts per round


def test_quick_turn2_resumes_past_the_answers(tmp_path):
    """MTP rounds of 2 drafts (`--mtp 2`)."""
    sys.path.insert(0, str(EXAMPLES))
    import bench_prefix_cache as bpc

    out = tmp_path / "pc.json"
    argv = ["--quick", "--device", "cpu", "--turn2", "--work", str(tmp_path / "w"), "--out", str(out), "--mtp", str(MTP)]
    assert bpc.main(argv) == 0
    r = json.loads(out.read_text())
    b, n_prompt = r["prefix_pool"]["block_size"], r["system"] + r["suffix"]
    answers = [len(t) for t in r["warm"]["tokens"]]
    s = r["summary"]
    assert s["turn2_tokens_equal"] == s["of"] == r["requests"] and s["tokens_equal_warm"] == s["of"]
    # each second turn resumes past its answer's completed blocks, not only past its own prompt's
    lo = sum((n_prompt + n - 1) // b * b for n in answers) / r["requests"]
    hi = sum((n_prompt + n) // b * b for n in answers) / r["requests"]
    assert n_prompt // b * b < lo <= s["turn2_hit_tokens_per_request"] <= hi, (s, lo, hi)
    assert r["turn2_off"]["prefill_calls"]["tokens"] > r["turn2_on"]["prefill_calls"]["tokens"]
