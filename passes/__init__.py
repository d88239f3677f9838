"""The FX pass pipeline (dsv4c.passes).

A pass is a plain function `(gm, ctx) -> PassResult(gm, changed, stats)` over the GraphModule of an
exported graph (`ExportedGraph.module()`: weights are attributes, caches are inputs that custom ops
mutate). `ctx` carries the model config, the target and the graph kind; a pass reads nothing else.
The default pipeline is the one ordered list in `default_pipeline`. `verify` checks the graph
invariants after every pass.
"""
from __future__ import annotations

import operator
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
from torch.fx import GraphModule, Node

from dsv4c.config import ModelConfig


@dataclass(frozen=True)
class PassContext:
    config: ModelConfig
    target: str = "cpu"
    graph_kind: str = "decode"  # prefill | decode | mtp
    kernels: tuple[tuple[str, str], ...] = ()  # (op, implementation) overrides of the target's kernels
    expert_format: str | None = None  # routed-expert format override (`compile --expert-format`)
    dense_format: str | None = None  # dense-linear format override (`compile --dense-format`)
    # disk-canonical names of the weights the checkpoint stores as FP8 blocks (compile reads the headers);
    # None: the release layout's (dsv4c.checkpoint.release_format), for graphs holding in-memory weights
    fp8_stored: frozenset[str] | None = None
    deterministic: bool = False  # batch-invariant kernels (`compile --deterministic`, passes/make_batch_invariant.py)


@dataclass
class PassResult:
    graph: GraphModule
    changed: bool
    stats: dict = field(default_factory=dict)


Pass = Callable[[GraphModule, PassContext], PassResult]


@dataclass
class PassRecord:
    """What one pipeline step did (the per-pass report builds on these)."""

    name: str
    changed: bool
    stats: dict
    seconds: float
    skipped: bool = False


def default_pipeline() -> list[tuple[str, Pass]]:
    """The lowering passes, in order. (The router split is not a rewrite of this graph: the runtime
    applies the plan `split_at_routers` makes of the final graph.)"""
    from dsv4c.passes.absorb_mla import absorb_mla
    from dsv4c.passes.fuse_hc import fuse_hc
    from dsv4c.passes.fuse_hc_chain import fuse_hc_chain
    from dsv4c.passes.fuse_moe_sum import fuse_moe_sum
    from dsv4c.passes.fuse_projections import fuse_projections
    from dsv4c.passes.fuse_rmsnorm import fuse_rmsnorm
    from dsv4c.passes.fuse_rope import fuse_rope
    from dsv4c.passes.fuse_rope_angles import fuse_rope_angles
    from dsv4c.passes.fuse_router import fuse_router
    from dsv4c.passes.fuse_sinkhorn import fuse_sinkhorn
    from dsv4c.passes.fuse_swiglu import fuse_swiglu
    from dsv4c.passes.lower_f32_linears import lower_f32_linears
    from dsv4c.passes.lower_grouped_linear import lower_grouped_linear
    from dsv4c.passes.make_batch_invariant import make_batch_invariant
    from dsv4c.passes.prefetch_weights import prefetch_weights
    from dsv4c.passes.quantize_dense import quantize_dense
    from dsv4c.passes.quantize_experts import quantize_experts
    from dsv4c.passes.select_kernels import select_kernels

    return [
        ("fuse_projections", fuse_projections),
        ("absorb_mla", absorb_mla),
        ("fuse_sinkhorn", fuse_sinkhorn),
        ("fuse_hc", fuse_hc),
        ("fuse_hc_chain", fuse_hc_chain),  # a site's hc_post and the next site's hc_pre: one op
        ("fuse_moe_sum", fuse_moe_sum),  # routed + shared experts added in the post-mix that reads them
        ("fuse_rmsnorm", fuse_rmsnorm),
        ("fuse_rope", fuse_rope),
        ("fuse_rope_angles", fuse_rope_angles),
        ("lower_f32_linears", lower_f32_linears),
        ("fuse_router", fuse_router),
        ("fuse_swiglu", fuse_swiglu),
        ("lower_grouped_linear", lower_grouped_linear),
        ("quantize_experts", quantize_experts),
        ("quantize_dense", quantize_dense),
        ("make_batch_invariant", make_batch_invariant),  # no-op unless ctx.deterministic; sees the formats chosen
        ("select_kernels", select_kernels),
        ("prefetch_weights", prefetch_weights),  # last: places L2 prefetches by the final ops' weights
    ]


class VerifyError(AssertionError):
    """A graph invariant broke; the message names the pass and the node."""


_ALLOWED_NAMESPACES = {"aten", "dsv4c", "_c10d_functional"}  # collectives: passes/shard.py


def verify(gm: GraphModule, ctx: PassContext, after: str = "export") -> None:
    """Graph invariants, checked after every pass:
    lint; every value node carries meta["val"]; only aten/dsv4c ops and getitem; in-place writes
    only to graph inputs (the caches); no graph output aliases a graph input."""
    where = f"after {after}"
    try:
        gm.graph.lint()
    except Exception as e:  # lint raises plain RuntimeErrors
        raise VerifyError(f"{where}: graph lint failed: {e}") from None
    inputs = {n for n in gm.graph.nodes if n.op == "placeholder"}
    for n in gm.graph.nodes:
        if n.op in ("placeholder", "output"):
            continue
        if n.op == "call_function":
            _check_op(n, where)
            _check_mutation(n, inputs, where)
        if n.op in ("call_function", "get_attr") and "val" not in n.meta and n.users:
            raise VerifyError(f"{where}: node {n.name} ({n.target}) has no meta['val']")
    for out in gm.graph.find_nodes(op="output")[0].args[0]:
        if isinstance(out, Node) and (out in inputs or _is_view_of_input(out, inputs)):
            raise VerifyError(f"{where}: graph output {out.name} aliases a graph input")


def _check_op(n: Node, where: str) -> None:
    if n.target is operator.getitem:
        return
    if getattr(n.target, "__module__", None) == "_operator" and not isinstance(n.meta.get("val"), torch.Tensor):
        return  # shape arithmetic on symbolic sizes
    ns = getattr(n.target, "namespace", None)
    if ns not in _ALLOWED_NAMESPACES:
        raise VerifyError(f"{where}: node {n.name} calls {n.target}, not an aten or dsv4c op")


def _mutated_args(n: Node) -> list[Node]:
    schema = getattr(n.target, "_schema", None)
    if schema is None:
        return []
    out = []
    for i, a in enumerate(schema.arguments):
        if a.alias_info is not None and a.alias_info.is_write:
            v = n.args[i] if i < len(n.args) else n.kwargs.get(a.name)
            if isinstance(v, Node):
                out.append(v)
    return out


def _check_mutation(n: Node, inputs: set[Node], where: str) -> None:
    for arg in _mutated_args(n):
        if arg not in inputs:
            raise VerifyError(f"{where}: node {n.name} ({n.target}) writes {arg.name}, which is not a graph input")


def _is_view_of_input(n: Node, inputs: set[Node]) -> bool:
    seen = n
    while seen.op == "call_function" and getattr(seen.target, "_schema", None) is not None:
        rets = seen.target._schema.returns
        if not (rets and rets[0].alias_info is not None) or not seen.args or not isinstance(seen.args[0], Node):
            return False
        seen = seen.args[0]
        if seen in inputs:
            return True
    return False


def run_pipeline(gm: GraphModule, ctx: PassContext, passes: list[tuple[str, Pass]] | None = None,
                 skip: tuple[str, ...] | list[str] = (), dump_dir: str | Path | None = None,
                 after_each: Callable[[str, GraphModule], None] | None = None,
                 check: bool = True) -> tuple[GraphModule, list[PassRecord]]:
    """Run the passes in order. `skip` names passes to leave out; `dump_dir` gets the readable code
    before and after every pass; `after_each(name, gm)` sees the graph after each pass (reports)."""
    passes = default_pipeline() if passes is None else passes
    known = {name for name, _ in passes}
    unknown = set(skip) - known
    if unknown:
        raise ValueError(f"skip: unknown pass name(s) {sorted(unknown)}; the pipeline has {sorted(known)}")
    if check:
        verify(gm, ctx)
    records = []
    for i, (name, fn) in enumerate(passes):
        if name in skip:
            records.append(PassRecord(name, False, {}, 0.0, skipped=True))
            continue
        _dump(dump_dir, f"{i:02d}_{name}.before.py", gm)
        t0 = time.perf_counter()
        res = fn(gm, ctx)
        seconds = time.perf_counter() - t0
        gm = res.graph
        if res.changed:
            gm.recompile()
        if check:
            verify(gm, ctx, after=name)
        _dump(dump_dir, f"{i:02d}_{name}.after.py", gm)
        records.append(PassRecord(name, res.changed, res.stats, seconds))
        if after_each is not None:
            after_each(name, gm)
    return gm, records


def _dump(dump_dir, fname: str, gm: GraphModule) -> None:
    if dump_dir is None:
        return
    d = Path(dump_dir)
    d.mkdir(parents=True, exist_ok=True)
    (d / fname).write_text(gm.code)


# ---- helpers shared by the passes ------------------------------------------------------------------
class KernelUnavailableError(RuntimeError):
    """A pass needs a kernel op that is not registered (its kernel module failed to import) on a CUDA
    target; the message names the op and the module's import error."""


class KernelUnavailableWarning(UserWarning):
    """The CPU target's notice that a fusion pass is left out because its kernel op is missing."""


def kernel_ops(ctx: PassContext, *names: str) -> tuple | None:
    """The default overloads of dsv4c::<names>, after registering the model's ops. When one is missing
    (the Triton kernel modules register them, so they need triton): on a CUDA target raise
    `KernelUnavailableError`; on the CPU target warn (`KernelUnavailableWarning`, printed once per
    call site) and return None, and the pass returns `PassResult(gm, False, {..., "skipped": unavailable(...)})`."""
    from dsv4c.model import register_ops
    from dsv4c.targets import get_target

    failed = register_ops()
    missing = [n for n in names if getattr(torch.ops.dsv4c, n, None) is None]
    if not missing:
        return tuple(getattr(torch.ops.dsv4c, n).default for n in names)
    why = "; ".join(f"dsv4c.kernels.{m}: {e}" for m, e in failed.items()) or "no kernel module failed to import"
    msg = f"dsv4c::{'/'.join(missing)} is not registered ({why})"
    if get_target(ctx.target).device == "cuda":
        raise KernelUnavailableError(f"target {ctx.target!r} needs {msg}; install triton (Linux) or fix the import")
    warnings.warn(f"{msg}: the {ctx.target} target runs without this fusion", KernelUnavailableWarning, stacklevel=3)
    return None


def unavailable(*names: str) -> str:
    return f"dsv4c::{'/'.join(names)} unavailable (needs triton)"


def tensor_value(a) -> torch.Tensor | None:
    """The fake tensor a graph node holds (`meta["val"]`), or None for literals and non-tensor nodes."""
    v = a.meta.get("val") if isinstance(a, Node) else None
    return v if isinstance(v, torch.Tensor) else None


def is_noop_cast(n: Node) -> bool:
    """`aten.to.dtype(x, dt)` where x already has dtype dt."""
    if n.op != "call_function" or n.target is not torch.ops.aten.to.dtype:
        return False
    src = n.args[0]
    return isinstance(src, Node) and "val" in src.meta and src.meta["val"].dtype == n.args[1]


def resolve(n: Node) -> Node:
    """Look through no-op casts to the node that really produces the value."""
    while is_noop_cast(n):
        n = n.args[0]
    return n


def get_param(gm: GraphModule, target: str) -> torch.Tensor:
    obj = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def set_param(gm: GraphModule, target: str, value: torch.Tensor) -> None:
    *path, leaf = target.split(".")
    mod = gm
    for part in path:
        if not hasattr(mod, part):
            mod.add_module(part, torch.nn.Module())
        mod = getattr(mod, part)
    mod.register_parameter(leaf, torch.nn.Parameter(value, requires_grad=False))


def delete_param(gm: GraphModule, target: str) -> None:
    *path, leaf = target.split(".")
    mod = gm
    for part in path:
        mod = getattr(mod, part)
    delattr(mod, leaf)


def fake_value(ref: Node, fn: Callable, *args):
    """Compute a new node's meta['val'] with the graph's fake mode (`ref` carries a fake tensor)."""
    mode = ref.meta["val"].fake_mode
    with mode:
        conv = [mode.from_tensor(a) if isinstance(a, torch.Tensor) and not isinstance(a, torch._subclasses.FakeTensor)
                else a for a in args]
        return fn(*conv)


def fake_linear(x, w):
    """Fake value of `linear(x, w)` from shapes alone (torch 2.11's composite linear calls numel() on
    symbolic sizes under fake tensors)."""
    return x.new_empty((*x.shape[:-1], w.shape[0]))


def fake_einsum(eq: str, operands):
    """Fake value of a two-operand einsum, from its equation and the operand shapes."""
    ins, out = eq.split("->")
    sizes = {}
    for spec, t in zip(ins.split(","), operands):
        sizes.update(zip(spec, t.shape))
    return operands[0].new_empty(tuple(sizes[c] for c in out))


def erase_unused(gm: GraphModule, nodes) -> None:
    """Erase `nodes` once nothing uses them, then whatever fed only them (transitively). Placeholders
    and ops that write their arguments (cache updates) are never erased; `_assert_tensor_metadata`
    checks on an erased value go with it."""
    assert_op = torch.ops.aten._assert_tensor_metadata.default
    pending = set(nodes)
    while pending:
        progress = False
        for n in list(pending):
            checks = [u for u in n.users if u.target is assert_op]
            if len(n.users) > len(checks):
                continue
            pending.discard(n)
            progress = True
            if n.op in ("placeholder", "output") or _mutated_args(n):
                continue
            for u in checks:
                gm.graph.erase_node(u)
            inputs = n.all_input_nodes
            gm.graph.erase_node(n)
            pending.update(inputs)
        if not progress:
            break
