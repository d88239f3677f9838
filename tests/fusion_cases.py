"""Shared cases of the fusion-pass tests (test_fuse_sinkhorn / _hc / _rmsnorm / _rope): a two-layer V4 (SWA + CSA)
or a preset, its step graphs exported once per (model, kind, dtype), random inputs on a cache filled by
a ragged prompt, and the comparison of two runs (outputs and cache writes).

Kinds: prefill, decode (1 token per row), verify (the decode graph of 1 + K tokens), mtp."""
from __future__ import annotations

import copy

import torch

from dsv4c import ModelConfig
from dsv4c.export import GraphSpec, example_inputs, export_graph, flat_caches
from dsv4c.model import build_model
from dsv4c.presets import V4_TINY_A

V4_TINY_2L = {**V4_TINY_A, "num_hidden_layers": 2, "layer_types": ["sliding_attention", "compressed_sparse_attention"],
              "compress_ratios": [0, 4, 0], "num_hash_layers": 1, "mlp_layer_types": ["hash_moe", "moe"]}
N_SLOTS, MAX_LEN, K = 3, 64, 2

_models: dict = {}
_graphs: dict = {}


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| in fp64 (0 for empty tensors)."""
    return ((a.double() - b.double()).norm() / b.double().norm()).item() if b.numel() else 0.0


def model(name: str = "v4", dtype=torch.float32):
    """"v4": the two-layer V4 above; else a preset name. Built once per (name, dtype)."""
    if (name, dtype) not in _models:
        cfg = ModelConfig.from_dict(V4_TINY_2L) if name == "v4" else ModelConfig.preset(name)
        _models[(name, dtype)] = build_model(cfg, dtype=dtype)
    return _models[(name, dtype)]


def spec(kind: str) -> GraphSpec:
    return GraphSpec("decode" if kind == "verify" else kind, k=0 if kind == "decode" else K, n_slots=N_SLOTS,
                     max_len=MAX_LEN)


def exported(name: str, kind: str, dtype=torch.float32):
    """The unfused GraphModule of `kind` (callers get a deep copy of the one export)."""
    if (name, kind, dtype) not in _graphs:
        _graphs[(name, kind, dtype)] = export_graph(model(name, dtype), spec(kind)).module()
    return copy.deepcopy(_graphs[(name, kind, dtype)])


def inputs(name: str, kind: str, dtype=torch.float32) -> list:
    """Random inputs; main graphs run on a cache filled by a ragged prompt in slots 0 and 1."""
    m = model(name, dtype)
    g = torch.Generator().manual_seed(1)
    args = list(example_inputs(m, spec(kind), "cpu"))
    if kind == "mtp":
        args[0] = torch.randn(args[0].shape, generator=g).to(args[0].dtype)
        args[1] = torch.randint(0, m.config.vocab_size, args[1].shape, generator=g)
        return args
    cache = m.new_cache(N_SLOTS, max_len=MAX_LEN)
    with torch.no_grad():
        m(torch.randint(0, m.config.vocab_size, (2, 11), generator=g), cache,
          n_real=torch.tensor([11, 7]), slots=torch.arange(2))
    T = {"prefill": 9, "decode": 1, "verify": 1 + K}[kind]
    ids = torch.randint(0, m.config.vocab_size, (2, T), generator=g)
    return [ids, torch.arange(2), cache.pos[:2].clone(), torch.full((2,), T), flat_caches(cache.layers)]


@torch.no_grad()
def run(gm, args):
    """(outputs, the caches after the run) on a copy of `args`."""
    args = copy.deepcopy(args)
    return gm(*args), args[-1]


def max_rel(x: torch.Tensor, y: torch.Tensor) -> float:
    if torch.equal(x, y):
        return 0.0
    diff = torch.where(x == y, 0.0, x.double() - y.double())  # equal infinities (open-group scores) differ by 0
    return (diff.abs().max() / y[y.isfinite()].double().abs().max().clamp_min(1e-30)).item()


def assert_same(a, b, rel: float = 0.0) -> None:
    """Outputs and cache contents of two runs agree within `rel` (0: bit-exact)."""
    (oa, ca), (ob, cb) = a, b
    assert len(oa) == len(ob)
    for i, (x, y) in enumerate(zip(oa, ob)):
        assert max_rel(x, y) <= rel, (i, max_rel(x, y))
    for k in cb:
        assert max_rel(ca[k], cb[k]) <= rel, (k, max_rel(ca[k], cb[k]))


def pipeline_pair(pass_name: str):
    """The two-layer V4's decode graph through default_pipeline on h200, with and without `pass_name`
    (quantize_experts skipped: lossy, tests/test_quantize_experts.py). Asserts both give the same outputs
    and cache writes; -> (ctx, fused graph, its pass records, the graph without the pass)."""
    from dsv4c.passes import PassContext, run_pipeline

    ctx = PassContext(model("v4").config, "h200", graph_kind="decode")
    skip = ("quantize_experts", "quantize_dense")
    unfused, _ = run_pipeline(exported("v4", "decode"), ctx, skip=skip + (pass_name,))
    gm, recs = run_pipeline(exported("v4", "decode"), ctx, skip=skip)
    args = inputs("v4", "decode")
    assert_same(run(gm, args), run(unfused, args))
    return ctx, gm, recs, unfused


def assert_in_capturable_segments(gm, ctx, targets, n: int) -> None:
    """Exactly `n` nodes call one of `targets`, and each sits in a static, capturable segment of the plan."""
    from dsv4c.passes.split_at_routers import plan_segments

    plan = plan_segments(gm, ctx)
    fused = {nd.name for nd in gm.graph.nodes if nd.target in targets}
    holding = [s for s in plan.segments if fused & set(s.nodes)]
    assert len(fused) == n == sum(len(fused & set(s.nodes)) for s in holding)
    assert all(s.kind == "static" and s.capturable for s in holding), [(s.index, s.reason) for s in holding]


def swap_targets(gm, impl: dict) -> int:
    """Point every node that calls one of `impl`'s ops at its implementation (e.g. the Triton kernel
    instead of the model's function), recompile, and return how many nodes changed."""
    swapped = 0
    for nd in gm.graph.nodes:
        if nd.target in impl:
            nd.target = impl[nd.target]
            swapped += 1
    gm.recompile()
    return swapped
