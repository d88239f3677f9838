"""How much of a quantised artifact's logits error comes from routing flips (CPU, pure PyTorch).

    python examples/routing_flips.py                                   # slice dims, 256 experts of width 256
    python examples/routing_flips.py --experts 16 --moe-inter 2048    # slice dims, 16 full-width experts
    python examples/routing_flips.py --quick                          # v4-tiny-b (a smoke run)

The eager model is run twice on one prompt, in bf16, with the routed experts' weights rounded to
MXFP4 (the release values, which the h200 artifact's FP8 experts hold exactly): once as it is, once
with the experts' activations quantised the way the FP8 W8A8 kernels do it (x and h per 1x128 to
e4m3 with ue8m0 scales). It prints the last position's logits error and, per MoE layer, the share of
tokens whose top-k expert set changed. With random routers and many experts the top-k margins are
small, so a few percent of activation error changes the chosen experts in later layers, and the
logits move far more than the quantisation itself would move them.

Legend: T prompt tokens, K experts per token.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_artifact import round_to_release_  # noqa: E402

import dsv4c.model.moe as moe  # noqa: E402
from dsv4c import ModelConfig  # noqa: E402
from dsv4c import quant as Q  # noqa: E402
from dsv4c.model import build_model  # noqa: E402
from dsv4c.model.common import swiglu_act  # noqa: E402


def fake_quant_act(x: torch.Tensor) -> torch.Tensor:
    q, s = Q.quant_act_fp8(x.float())
    return Q.dequant_act(q, s)


def swiglu_w8a8(x, w1, w3, w2, limit: float) -> torch.Tensor:
    """moe's swiglu with the W8A8 kernels' activation quantisation (x and h), fp32 accumulation."""
    xq = fake_quant_act(x)
    h = swiglu_act(xq @ w1.float().T, xq @ w3.float().T, limit)
    return (fake_quant_act(h) @ w2.float().T).to(x.dtype)


class _Routing(TorchDispatchMode):
    """The expert ids [T, K] of every routed-expert call."""

    def __init__(self):
        super().__init__()
        self.idx: list[torch.Tensor] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if "moe_experts" in str(func):
            self.idx.append(args[1].clone())
        return func(*args, **(kwargs or {}))


@torch.no_grad()
def run(cfg: ModelConfig, prompt: int, seed: int = 11) -> dict:
    model = build_model(cfg, dtype=torch.bfloat16)
    round_to_release_(model)
    ids = torch.randint(0, cfg.vocab_size, (1, prompt), generator=torch.Generator().manual_seed(seed))
    out, routes = {}, {}
    for name, fn in (("eager", moe.swiglu), ("w8a8", swiglu_w8a8)):
        saved, moe.swiglu = moe.swiglu, fn
        try:
            with _Routing() as rec:
                out[name] = model(ids)[0, -1].float()
        finally:
            moe.swiglu = saved
        routes[name] = rec.idx
    flips = [(a.sort(-1).values != b.sort(-1).values).any(-1).float().mean().item()
             for a, b in zip(routes["eager"], routes["w8a8"])]
    ref, got = out["eager"], out["w8a8"]
    return {"experts": cfg.n_routed_experts, "moe_inter": cfg.moe_intermediate_size, "prompt": prompt,
            "logits_rel_err": ((got - ref).norm() / ref.norm()).item(),
            "argmax_equal": int(got.argmax()) == int(ref.argmax()), "expert_set_changed_per_layer": flips}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="v4-flash-slice")
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--moe-inter", type=int, default=256, help="expert width (2048 in Flash; less fits a CPU)")
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args(argv)
    base = ModelConfig.preset("v4-tiny-b" if a.quick else a.preset).to_dict()
    over = {} if a.quick else {"n_routed_experts": a.experts, "moe_intermediate_size": a.moe_inter,
                               "vocab_size": a.vocab}
    cfg = ModelConfig.from_dict({**base, **over, "num_nextn_predict_layers": 0})
    t0 = time.perf_counter()
    res = run(cfg, 16 if a.quick else a.prompt)
    res["seconds"] = round(time.perf_counter() - t0, 1)
    print(json.dumps(res))
    if a.out:
        a.out.write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
