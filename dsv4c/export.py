"""torch.export of the eager models into the graphs dsv4c compiles.

Four graph kinds, all traced from the models' traceable `step` bodies:
  * `prefill`: a chunk of T tokens per sequence, T and the batch B dynamic;
  * `decode`:  1 + k tokens per sequence (k speculative tokens, k = 0 included), B dynamic;
  * `mtp`:     the MTP block over 1 + k positions, B dynamic (V4 takes the main model's streams);
  * `verify_mtp`: `decode` over 1 + k tokens, then the MTP block over the same rows with the main
    output and, as next tokens, the argmax of the main logits (the fused greedy refresh of MTP
    speculation, runtime/speculative.py); its caches are the main ones plus the MTP's under `mtp.`.

Every graph takes `(input_ids [B, T], slots [B], pos0 [B], n_real [B], caches)` where `caches` is a
flat dict `"{layer}.{name}" -> tensor` of static buffers (`[n_slots, ...]`) that the custom ops
update in place (paged graphs, `GraphSpec.paged`: the growing ones are pools of blocks and the main caches
end with the one `"block_table"`; the MTP block's caches stay per slot); the mtp graph takes the
streams/hidden state first. Positions and slots are device tensors, so the graphs carry no
data-dependent guards. Tracing works on the `meta` device: a full-size config exports without weights.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from torch import nn

from dsv4c.config import ModelConfig

GRAPH_KINDS = ("prefill", "decode", "mtp", "verify_mtp")
MTP_CACHE_PREFIX = "mtp."  # verify_mtp: the MTP block's caches in the one flat cache dict


@dataclass(frozen=True)
class GraphSpec:
    """What one exported graph computes."""

    kind: str  # prefill | decode | mtp | verify_mtp
    k: int = 0  # speculative tokens: decode/mtp/verify_mtp graphs take 1 + k tokens per sequence
    n_slots: int = 2  # cached sequences (the caches' leading dim)
    max_len: int = 256  # positions per sequence the caches hold
    extra_ring_slots: int = 0  # V4: window-ring rows beyond W, so speculative rows evict nothing live (k_max)
    paged: object = None  # a dsv4c.model.common.PagedLayout: the growing caches in blocks (runtime/block_pool.py)

    def __post_init__(self):
        if self.kind not in GRAPH_KINDS:
            raise ValueError(f"kind: expected one of {GRAPH_KINDS}, got {self.kind!r}")
        if not 0 <= self.k <= 8:
            raise ValueError(f"k: speculative tokens must be in [0, 8], got {self.k}")
        if self.n_slots < 2:
            raise ValueError("n_slots: at least 2 (a dynamic batch dim needs an example of 2)")
        if self.extra_ring_slots < 0:
            raise ValueError(f"extra_ring_slots: must be >= 0, got {self.extra_ring_slots}")

    @property
    def tokens(self) -> int | None:
        """Fixed tokens per sequence, or None when dynamic (prefill)."""
        return None if self.kind == "prefill" else 1 + self.k


BLOCK_TABLE = "block_table"  # paged caches (dsv4c.model.common.PagedLayout): the one table of every layer


def flat_caches(layers) -> dict[str, torch.Tensor]:
    """[LayerCache] -> {"{i}.{name}": tensor}, plus "block_table" (last) when the caches are paged."""
    out = {f"{i}.{k}": t for i, lc in enumerate(layers) for k, t in lc.tensors().items()}
    bt = next((lc.block_table for lc in layers if getattr(lc, "block_table", None) is not None), None)
    if bt is not None:
        out[BLOCK_TABLE] = bt
    return out


def unflat_caches(flat: dict[str, torch.Tensor], cache_cls, n_layers: int) -> list:
    per = [dict() for _ in range(n_layers)]
    for key, t in flat.items():
        if key == BLOCK_TABLE:
            continue
        i, name = key.split(".", 1)
        per[int(i)][name] = t
    if BLOCK_TABLE in flat:
        for d in per:
            d[BLOCK_TABLE] = flat[BLOCK_TABLE]
    return [cache_cls(**d) for d in per]


class StepModule(nn.Module):
    """The main-model step with a flat-dict cache interface (what `torch.export` traces)."""

    def __init__(self, model: nn.Module, cache_cls, n_layers: int):
        super().__init__()
        self.model, self.cache_cls, self.n_layers = model, cache_cls, n_layers

    def forward(self, input_ids, slots, pos0, n_real, caches: dict[str, torch.Tensor]):
        layers = unflat_caches(caches, self.cache_cls, self.n_layers)
        return self.model.step(input_ids, slots, pos0, n_real, layers)


class MTPStepModule(StepModule):
    def forward(self, hidden, input_ids, slots, pos0, n_real, caches: dict[str, torch.Tensor]):
        (lc,) = unflat_caches(caches, self.cache_cls, 1)
        return self.model.mtp_step(hidden, input_ids, slots, pos0, n_real, lc)


class VerifyMTPStepModule(StepModule):
    """`verify_mtp`: the main step over 1 + k tokens per row, then the MTP block over the same rows.

    MTP row j gets the main output at row j (V4: streams, V3: post-norm hidden) and, as its next
    token, x_{j+1} = argmax of the main logits at row j, computed here. For greedy speculation these
    are the true inputs at every accepted row and at the row of the emitted token, so the MTP output
    at row a is the next round's first draft without a separate `mtp` call. MTP row j sits at the
    main position pos0 + j (the speculator keeps the MTP's positions equal to the main ones), so
    both blocks take `pos0`, `slots` and `n_real`. `caches`: the main caches plus the MTP's under
    `MTP_CACHE_PREFIX`. -> (logits [B, T, V], hidden, MTP logits [B, T, V], MTP output z, MTP input
    ids [B, T]); the ids let the caller check, per row, that the MTP saw the tokens it committed."""

    def forward(self, input_ids, slots, pos0, n_real, caches: dict[str, torch.Tensor]):
        p = MTP_CACHE_PREFIX
        main = {k: v for k, v in caches.items() if not k.startswith(p)}
        mtp = {k[len(p):]: v for k, v in caches.items() if k.startswith(p)}
        logits, hidden = self.model.step(input_ids, slots, pos0, n_real, unflat_caches(main, self.cache_cls,
                                                                                        self.n_layers))
        nxt = logits.argmax(-1)  # [B, T]
        (lc,) = unflat_caches(mtp, self.cache_cls, 1)
        mlogits, z = self.model.mtp_step(hidden, nxt, slots, pos0, n_real, lc)
        return logits, hidden, mlogits, z, nxt


def verify_mtp_caches(main: dict[str, torch.Tensor], mtp: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The flat cache dict of a `verify_mtp` graph: main caches, then the MTP's under the prefix (this order)."""
    return {**main, **{MTP_CACHE_PREFIX + k: v for k, v in mtp.items()}}


def example_inputs(model: nn.Module, spec: GraphSpec, device) -> tuple:
    """Representative inputs: B = 2 sequences at different positions, real tokens everywhere."""
    cfg: ModelConfig = model.config
    B = 2
    T = spec.tokens or 3
    extra = {"extra_ring_slots": spec.extra_ring_slots} if spec.extra_ring_slots else {}
    paged = {"paged": spec.paged} if spec.paged is not None else {}  # the MTP block's own caches stay per slot
    if spec.kind == "mtp":
        cache = model.new_mtp_cache(spec.n_slots, max_len=spec.max_len, **extra)
    else:
        cache = model.new_cache(spec.n_slots, max_len=spec.max_len, **extra, **paged)
    caches = {k: v.to(device) for k, v in flat_caches(cache.layers).items()}
    if spec.kind == "verify_mtp":
        mcache = model.new_mtp_cache(spec.n_slots, max_len=spec.max_len, **extra)
        caches = verify_mtp_caches(caches, {k: v.to(device) for k, v in flat_caches(mcache.layers).items()})
    ids = torch.zeros(B, T, dtype=torch.int64, device=device)
    slots = torch.arange(B, device=device)
    pos0 = torch.tensor([0, 5], device=device)
    n_real = torch.full((B,), T, dtype=torch.int64, device=device)
    args = (ids, slots, pos0, n_real, caches)
    if spec.kind == "mtp":
        shape = (B, T, cfg.hc_mult, cfg.hidden_size) if cfg.is_v4 else (B, T, cfg.hidden_size)
        args = (torch.zeros(shape, dtype=model.act_dtype, device=device),) + args
    return args


def _dynamic_shapes(spec: GraphSpec, caches: dict) -> tuple:
    B = torch.export.Dim("B", min=1, max=spec.n_slots)
    tok = {0: B} if spec.tokens else {0: B, 1: torch.export.Dim("T", min=1, max=spec.max_len)}
    meta = {0: B}
    shapes = (tok, meta, meta, meta, {k: None for k in caches})
    if spec.kind == "mtp":
        shapes = ({0: B, **({} if spec.tokens else {1: tok[1]})},) + shapes
    return shapes


@dataclass
class ExportedGraph:
    spec: GraphSpec
    program: torch.export.ExportedProgram
    seconds: float

    def module(self) -> torch.fx.GraphModule:
        """The graph as an FX GraphModule with weights as attributes: what the passes rewrite."""
        return self.program.module()


def export_graph(model: nn.Module, spec: GraphSpec) -> ExportedGraph:
    """Trace one graph kind of `model` (on its own device, `meta` included)."""
    device = next(model.parameters()).device
    cache = model.new_mtp_cache(2, max_len=8) if spec.kind == "mtp" else model.new_cache(2, max_len=8)
    cache_cls, n_layers = type(cache.layers[0]), len(cache.layers)
    wrapper = {"mtp": MTPStepModule, "verify_mtp": VerifyMTPStepModule}.get(spec.kind, StepModule)(
        model, cache_cls, n_layers)
    args = example_inputs(model, spec, device)
    t0 = time.perf_counter()
    program = torch.export.export(wrapper, args, dynamic_shapes=_dynamic_shapes(spec, args[-1]), strict=False)
    return ExportedGraph(spec, program, time.perf_counter() - t0)


def graph_ops(gm: torch.fx.GraphModule) -> dict[str, int]:
    """Op histogram of a graph: target name -> count."""
    out: dict[str, int] = {}
    for n in gm.graph.nodes:
        if n.op == "call_function":
            key = getattr(n.target, "__name__", str(n.target))
            out[key] = out.get(key, 0) + 1
    return out


def lift_weights(gm: torch.fx.GraphModule) -> dict[str, torch.Tensor]:
    """Turn every weight the graph reads into a trailing `weights: dict[name, tensor]` input.

    Returns the weights it removed (values as they were: real or meta). Re-exporting the graph then
    gives an ExportedProgram with no state at all, so the saved graph holds code only and weights are
    bound by name at load (design.md: weights are data, graphs are code)."""
    import torch.utils._pytree as pytree

    from dsv4c.passes import delete_param, get_param

    g = gm.graph
    for n in list(g.nodes):
        if n.op == "get_attr" and not n.users:
            g.erase_node(n)
    getattrs = [n for n in g.nodes if n.op == "get_attr"]
    names = sorted({n.target for n in getattrs})
    weights = {k: get_param(gm, k) for k in names}
    last = [n for n in g.nodes if n.op == "placeholder"][-1]
    holders = {}
    for k in reversed(names):  # inserting right after `last` in reverse keeps `names` order
        with g.inserting_after(last):
            holders[k] = g.placeholder("w_" + k.replace(".", "_"))
        holders[k].meta["val"] = next(n.meta.get("val") for n in getattrs if n.target == k)
    for n in getattrs:
        n.replace_all_uses_with(holders[n.target])
        g.erase_node(n)
    for k, _ in list(gm.named_parameters()) + list(gm.named_buffers()):
        delete_param(gm, k)
    args_spec = gm._in_spec.children()[0]
    examples = pytree.tree_unflatten([0] * args_spec.num_leaves, args_spec)
    spec = pytree.tree_structure(((*examples, {k: 0 for k in names}), {}))
    cg = g._codegen
    cg.pytree_info = cg.pytree_info._replace(orig_args=list(cg.pytree_info.orig_args) + ["weights"], in_spec=spec)
    gm._in_spec = spec
    gm._forward_pre_hooks.clear()  # the input check of the original signature
    gm.recompile()
    return weights


def export_lifted(gm: torch.fx.GraphModule, spec: GraphSpec, args: tuple,
                  weights: dict[str, torch.Tensor]) -> torch.export.ExportedProgram:
    """Re-export a lifted graph (see `lift_weights`) into a stateless, saveable program."""
    shapes = _dynamic_shapes(spec, args[-1]) + ({k: None for k in weights},)
    ep = torch.export.export(gm, (*args, weights), dynamic_shapes=shapes, strict=False)
    ep._example_inputs = None  # torch.export.save would otherwise pickle them
    return ep


def retarget_device(gm: torch.fx.GraphModule, device: torch.device) -> torch.fx.GraphModule:
    """Point the device literals a graph captured while tracing (`meta` at compile time) at `device`."""
    dev = torch.device(device)
    for n in gm.graph.nodes:
        if isinstance(n.kwargs.get("device"), torch.device):
            n.kwargs = {**n.kwargs, "device": dev}
        if any(isinstance(a, torch.device) for a in n.args):
            n.args = tuple(dev if isinstance(a, torch.device) else a for a in n.args)
    gm.recompile()
    return gm
