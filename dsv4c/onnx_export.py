"""ONNX export of an artifact's dense segments (issue 30), verified with onnxruntime.

    index = export_onnx(ART, OUT, segments="dense", opset=18, verify=True)   # dsv4c export-onnx

The router split (passes/split_at_routers.py) cuts a graph at its routed-expert ops. For ONNX the
segments are cut once more, at every op ONNX cannot hold (`boundary_reason`): the routed experts, and
the dsv4c ops that write a cache in place (ONNX has no in-place update of an input) or whose reference
reads positions on the host. Those run in torch; each run of ops between two of them is a *dense piece*,
exported as one ONNX model. The other dsv4c custom ops (mHC, norms, RoPE, routing, SwiGLU, grouped
linears: pure, static shapes) are inlined as their reference implementation's ATen decomposition, so the
ONNX file holds plain ONNX ops for them (not functions in a `dsv4c` domain).

    parent(ids, slots, pos0, n_real, caches, weights)
      = piece_0 (dense, ONNX) -> op_1 (torch: dsv4c::v4_compress writes caches) -> piece_2 (dense) -> ...

Each dense piece: `OUT/{graph}/piece_{i:03d}.onnx` (+ `.onnx.data`: the weights it reads, as external
data initialisers), exported with torch.onnx's dynamo exporter; its activation inputs keep the graph's
symbolic dims (batch rows in decode, tokens in prefill) as dynamic axes. `OUT/index.json` lists, per
graph, every piece in order: dense pieces with their file, inputs, outputs and router segment, and the
torch pieces between them with the op, what it mutates and why it stays in torch. A dense piece whose
export fails is recorded as not exportable with torch.onnx's error.

Verification (`verify=True`): two short greedy requests through the artifact's Session on the CPU (prefills
of 7 and 5 tokens, decode steps of 2 rows) with the split graphs record every piece's first real inputs; onnxruntime (CPUExecutionProvider) runs each
file on them and the max relative error (max |ort - torch| / max |torch|) must be <= 1e-5 (fp32).
`compose(session, index_dir)` swaps the dense pieces for onnxruntime sessions inside the Session's
graphs, so the Session's own generate loop runs ONNX for the dense parts and torch for the rest
(examples/onnx_roundtrip.py).
"""
from __future__ import annotations

import copy
import json
import operator
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn
from torch.fx import GraphModule, Node

from dsv4c.passes.split_at_routers import MOE_OPS, OP_CAPTURE, op_name

REL_TOL = 1e-5
GRAPHS = ("prefill", "decode")


class OnnxExportError(RuntimeError):
    """The artifact cannot be exported as asked; the message names the graph, piece or op."""


def _schema_mutates(target) -> list[str]:
    schema = getattr(target, "_schema", None)
    if schema is None:
        return []
    return [a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write]


def boundary_reason(n: Node) -> str | None:
    """Why node `n` stays in torch between ONNX pieces (None: it goes into a dense piece)."""
    if n.op != "call_function":
        return None
    name = op_name(n.target)
    if name in MOE_OPS:
        return f"{name}: routed experts (data-dependent tokens per expert; the dynamic segment of the router split)"
    if isinstance(n.target, torch._ops.HigherOrderOperator):
        return f"{name}: higher-order op"
    if not name.startswith("dsv4c."):
        return None
    written = _schema_mutates(n.target)
    if written:
        return f"{name}: writes {', '.join(written)} in place (a cache); ONNX has no in-place update of an input"
    blocker = OP_CAPTURE.get(name, f"{name}: no capture-safety entry")
    if blocker is not None:
        return blocker
    return None


def _reference(name: str):
    from dsv4c.passes.split_at_routers import reference_impl

    return reference_impl(name)


def _owner(n: Node, part: dict[Node, int], kinds: dict[int, str]) -> int | None:
    """getitem of a torch piece's output belongs to that piece."""
    if n.op == "call_function" and n.target is operator.getitem and isinstance(n.args[0], Node):
        p = part.get(n.args[0])
        if p is not None and kinds[p] == "torch":
            return p
    return None


@dataclass
class Piece:
    index: int
    kind: str  # dense | torch
    nodes: list[str] = field(default_factory=list)
    reason: str = ""  # torch pieces: why torch
    router_segment: int | None = None


def split_for_onnx(gm: GraphModule, router_segment_of) -> tuple[GraphModule, list[Piece]]:
    """Cut `gm` at every boundary node (each its own torch piece); the runs between them are dense pieces.
    Pure dsv4c ops in dense pieces are replaced by their reference implementation (traced into ATen by
    the exporter). Returns the parent module (same calling convention as `gm`) and the pieces in order."""
    from torch.fx.passes.split_module import split_module

    gm = copy.deepcopy(gm)
    part: dict[Node, int] = {}
    kinds: dict[int, str] = {}
    pieces: list[Piece] = []
    cur = None
    for n in gm.graph.nodes:
        if n.op in ("placeholder", "get_attr", "output"):
            continue
        own = _owner(n, part, kinds)
        if own is not None:
            part[n] = own
            pieces[own].nodes.append(n.name)
            continue
        why = boundary_reason(n)
        if why is not None:
            p = Piece(len(pieces), "torch", [n.name], why)
            pieces.append(p)
            kinds[p.index] = "torch"
            part[n] = p.index
            cur = None
            continue
        if cur is None:
            cur = Piece(len(pieces), "dense")
            pieces.append(cur)
            kinds[cur.index] = "dense"
        part[n] = cur.index
        cur.nodes.append(n.name)
        name = op_name(n.target) if n.op == "call_function" else ""
        if name.startswith("dsv4c."):
            n.target = _reference(name)  # reference semantics, traced into ATen by the exporter
    for p in pieces:
        p.router_segment = router_segment_of(p.nodes[0])
    _rematerialise_sizes(gm, part, kinds, pieces)
    gm.recompile()
    split = split_module(gm, gm, lambda n: part[n], keep_original_order=True, keep_original_node_name=True)
    split.graph._codegen = copy.copy(gm.graph._codegen)
    split.recompile()
    calls = [n.target for n in split.graph.nodes if n.op == "call_module"]
    if calls != [f"submod_{p.index}" for p in pieces]:
        raise OnnxExportError(f"split order {calls} != pieces {[p.index for p in pieces]}")
    return split, pieces


def _is_size(n: Node) -> bool:
    val = n.meta.get("val")
    return n.op == "call_function" and isinstance(val, (torch.SymInt, int)) and not isinstance(val, bool)


def _rematerialise_sizes(gm: GraphModule, part: dict[Node, int], kinds: dict[int, str], pieces: list[Piece]) -> None:
    """A size (sym_size of a tensor, arithmetic on sizes) used by a dense piece it was not computed in is
    recomputed inside that piece from the tensor, so no Python int crosses into an ONNX model (the tensor
    itself becomes an input when it is not one already)."""
    memo: dict[tuple[Node, int], Node] = {}

    def copy_into(a: Node, piece: int, before: Node) -> Node:
        if (a, piece) in memo:
            return memo[(a, piece)]
        args = torch.fx.graph.map_arg(
            (a.args, a.kwargs), lambda b: copy_into(b, piece, before) if _is_size(b) and part.get(b) != piece else b)
        with gm.graph.inserting_before(before):
            new = gm.graph.call_function(a.target, args[0], args[1])
        new.meta = dict(a.meta)
        part[new] = piece
        pieces[piece].nodes.append(new.name)
        memo[(a, piece)] = new
        return new

    for u in list(gm.graph.nodes):
        if u not in part or kinds[part[u]] != "dense":
            continue
        for a in list(u.all_input_nodes):
            if _is_size(a) and part.get(a) != part[u]:
                u.replace_input_with(a, copy_into(a, part[u], u))


# ---- recording the pieces' inputs -----------------------------------------------------------------
class _Recorder:
    """Forward pre-hooks on the dense submodules: the first call's inputs (detached clones)."""

    def __init__(self, split: GraphModule, pieces: list[Piece], weight_ids: set[int]):
        self.inputs: dict[int, tuple] = {}
        self.weight_ids = weight_ids
        self.handles = []
        for p in pieces:
            sub = getattr(split, f"submod_{p.index}")
            self.handles.append(sub.register_forward_pre_hook(self._hook(p.index)))

    def _hook(self, i: int):
        def hook(_mod, args):
            if i not in self.inputs:
                self.inputs[i] = tuple(a.detach().clone() if isinstance(a, torch.Tensor) and id(a) not in
                                       self.weight_ids else a for a in args)
        return hook

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def _placeholders(sub: GraphModule) -> list[str]:
    return [n.name for n in sub.graph.nodes if n.op == "placeholder"]


def _outputs(sub: GraphModule) -> list[str]:
    out = sub.graph.find_nodes(op="output")[0].args[0]
    outs = out if isinstance(out, (tuple, list)) else (out,)
    return [o.name if isinstance(o, Node) else repr(o) for o in outs]


class _Standalone(nn.Module):
    """A dense piece with its weights as buffers (initialisers in ONNX) and the rest as inputs."""

    def __init__(self, sub: GraphModule, names: list[str], weights: dict[int, torch.Tensor]):
        super().__init__()
        self.sub, self.n, self.weight_pos = sub, len(names), sorted(weights)
        for k, (pos, t) in enumerate(sorted(weights.items())):
            self.register_buffer(f"w{k}_{re.sub(r'[^0-9A-Za-z_]', '_', names[pos])}"[:120], t)

    def forward(self, *acts):
        it_w = iter(self.buffers())
        it_a = iter(acts)
        args = [next(it_w) if i in self.weight_pos else next(it_a) for i in range(self.n)]
        out = self.sub(*args)
        return tuple(out) if isinstance(out, (tuple, list)) else (out,)


def _dynamic_shapes(acts: list, symbolic: list) -> list:
    """Dim.DYNAMIC for each dim that is symbolic in the exported graph (batch rows, tokens)."""
    from torch.export import Dim

    out = []
    for a, val in zip(acts, symbolic):
        if not isinstance(a, torch.Tensor) or not isinstance(val, torch.Tensor):
            out.append(None)
            continue
        out.append({d: Dim.DYNAMIC for d, s in enumerate(val.shape) if isinstance(s, torch.SymInt)} or None)
    return out


def _rel_err(ref: torch.Tensor, got: torch.Tensor) -> float:
    ref, got = ref.double(), torch.as_tensor(got).double()
    if ref.shape != got.shape:
        return float("inf")
    scale = ref.abs().max().item() if ref.numel() else 0.0
    diff = (ref - got).abs().max().item() if ref.numel() else 0.0
    return diff / scale if scale > 0 else diff


def _export_piece(split: GraphModule, p: Piece, recorded: tuple, weight_ids: set[int], path: Path,
                  opset: int) -> dict:
    """Export one dense piece; returns its index entry (exportable or not, with the reason)."""
    sub = getattr(split, f"submod_{p.index}")
    names = _placeholders(sub)
    metas = [n.meta.get("val") for n in sub.graph.nodes if n.op == "placeholder"]
    entry: dict = {"piece": p.index, "kind": "dense", "router_segment": p.router_segment, "n_ops": len(p.nodes)}
    bad = [names[i] for i, a in enumerate(recorded) if not isinstance(a, torch.Tensor)]
    if bad:
        entry.update(exportable=False, reason=f"non-tensor inputs {bad} (Python ints/shapes crossing the cut)")
        return entry
    weights = {i: a for i, a in enumerate(recorded) if id(a) in weight_ids}
    acts = [a for i, a in enumerate(recorded) if i not in weights]
    act_names = [n for i, n in enumerate(names) if i not in weights]
    act_meta = [m for i, m in enumerate(metas) if i not in weights]
    model = _Standalone(sub, names, weights).eval()
    out_names = _outputs(sub)
    t0 = time.perf_counter()
    try:
        torch.onnx.export(model, tuple(acts), str(path), dynamo=True, external_data=True, opset_version=opset,
                          input_names=[f"in.{n}" for n in act_names], output_names=[f"out.{n}" for n in out_names],
                          dynamic_shapes={"acts": tuple(_dynamic_shapes(acts, act_meta))}, optimize=False, verbose=False)
    except Exception as e:  # the exporter's own reason (the innermost cause), recorded as is
        entry.update(exportable=False, reason=f"torch.onnx.export failed: {_root_cause(e)}")
        return entry
    entry.update(exportable=True, file=path.name, export_seconds=round(time.perf_counter() - t0, 2),
                 inputs=[{"name": n, "shape": list(a.shape), "dtype": str(a.dtype).replace("torch.", ""),
                          "dynamic_dims": sorted((_dynamic_shapes([a], [m])[0] or {}).keys())}
                         for n, a, m in zip(act_names, acts, act_meta)],
                 outputs=out_names, weights=[names[i] for i in sorted(weights)])
    return entry


def _root_cause(e: BaseException) -> str:
    while e.__cause__ is not None:
        e = e.__cause__
    lines = [ln.strip() for ln in str(e).strip().splitlines() if ln.strip()]
    return f"{type(e).__name__}: {' '.join(lines[:4])[:700]}"


def _written_inputs(n: Node) -> list[str]:
    """The graph values node `n` writes in place (its schema's mutable arguments)."""
    schema = getattr(n.target, "_schema", None)
    if schema is None:
        return []
    out = []
    for i, a in enumerate(schema.arguments):
        if a.alias_info is not None and a.alias_info.is_write:
            v = n.args[i] if i < len(n.args) else n.kwargs.get(a.name)
            if isinstance(v, Node):
                out.append(v.name)
    return out


def _torch_entry(split: GraphModule, p: Piece) -> dict:
    sub = getattr(split, f"submod_{p.index}")
    calls = [n for n in sub.graph.nodes if n.op == "call_function" and n.target is not operator.getitem]
    return {"piece": p.index, "kind": "torch", "op": op_name(calls[0].target), "router_segment": p.router_segment,
            "reason": p.reason, "inputs": _placeholders(sub), "outputs": _outputs(sub),
            "mutates": [w for n in calls for w in _written_inputs(n)]}


def _ort_session(path: Path):
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    opts.log_severity_level = 3  # errors only (CastLike constant-folding notices otherwise)
    return ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])


def _run_ort(sess, acts: list[torch.Tensor]) -> list:
    feeds = {i.name: a.detach().cpu().numpy() for i, a in zip(sess.get_inputs(), acts)}
    return sess.run(None, feeds)


def _splits(sess, cfg, target: str, kinds) -> dict:
    from dsv4c.passes import PassContext
    from dsv4c.passes.split_at_routers import plan_segments

    out = {}
    for kind in kinds:
        gm = sess.graphs[kind]
        plan = plan_segments(gm, PassContext(cfg, target, sess.manifest["graphs"][kind]["kind"]))

        def seg_of(name, _plan=plan):
            try:
                return _plan.segment_of(name)
            except (KeyError, ValueError):
                return None
        out[kind] = split_for_onnx(gm, seg_of)
    return out


def _drive(sess, steps: int = 2) -> None:
    """Two short greedy requests through the Session's own loop: prefills of 7 and 5 tokens, then decode
    steps of 2 rows (sample sizes of 1 would make torch.export specialise the batch dim to 1)."""
    sess.generate([[5, 17, 42, 7, 99, 3, 12], [9, 4, 33, 8, 2]], max_new_tokens=steps, temperature=0.0)


def export_onnx(art: str | Path, out: str | Path, segments: str = "dense", opset: int = 18, verify: bool = False,
                graphs: tuple[str, ...] = GRAPHS, max_pieces: int | None = None) -> dict:
    """Export the dense pieces of the artifact's prefill and decode graphs to `out`; writes and returns
    the index. `segments="all"` also tries to export each torch piece (its op alone) and records
    torch.onnx's own error. `max_pieces` (tests): per graph only the first max_pieces - 1 dense pieces and
    the last one; the others are listed as skipped."""
    from dsv4c.runtime import Session

    if segments not in ("dense", "all"):
        raise ValueError(f"--segments: expected dense or all, got {segments!r}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    sess = Session.load(art, device="cpu", graphs="off")
    if sess.manifest["dtype"] != "float32":
        raise OnnxExportError(f"{art}: compiled in {sess.manifest['dtype']}; export and verify an fp32 artifact "
                              f"(dsv4c compile ... --dtype fp32): the 1e-5 check is an fp32 check")
    missing = [k for k in graphs if k not in sess.graphs]
    if missing:
        raise OnnxExportError(f"{art}: no graph {missing} in the artifact (it has {sorted(sess.graphs)})")
    target = sess.manifest["target"]["name"]
    splits = _splits(sess, sess.config, target, graphs)
    originals = dict(sess.graphs)
    weight_ids = {id(t) for t in sess.weights.values()}
    recorders = {}
    for kind, (split, pieces) in splits.items():
        sess.graphs[kind] = split
        recorders[kind] = _Recorder(split, pieces, weight_ids)
    _drive(sess, steps=3)
    sess.graphs.update(originals)
    index = {"artifact": str(Path(art).resolve()), "opset": opset, "segments": segments, "rel_tol": REL_TOL,
             "exporter": f"torch.onnx dynamo (torch {torch.__version__})", "graphs": {}}
    for kind, (split, pieces) in splits.items():
        rec = recorders[kind]
        rec.remove()
        (out / kind).mkdir(exist_ok=True)
        entries = []
        dense = [p.index for p in pieces if p.kind == "dense"]
        chosen = set(dense) if max_pieces is None else set(dense[: max(max_pieces - 1, 0)] + dense[-1:])
        for p in pieces:
            if p.kind == "torch":
                e = _torch_entry(split, p)
                if segments == "all" and p.index in rec.inputs:
                    e.update(_try_torch_piece(split, p, rec.inputs[p.index], out / kind / f"piece_{p.index:03d}.onnx",
                                              opset))
                entries.append(e)
                continue
            if p.index not in chosen:
                entries.append({"piece": p.index, "kind": "dense", "router_segment": p.router_segment,
                                "exportable": None, "reason": f"skipped (max_pieces={max_pieces})"})
                continue
            if p.index not in rec.inputs:
                entries.append({"piece": p.index, "kind": "dense", "exportable": False,
                                "reason": "not reached by a prefill + decode step"})
                continue
            e = _export_piece(split, p, rec.inputs[p.index], weight_ids, out / kind / f"piece_{p.index:03d}.onnx",
                              opset)
            if e.get("exportable") and verify:
                e["verify"] = _verify(split, p, rec.inputs[p.index], out / kind / e["file"], e)
            entries.append(e)
        index["graphs"][kind] = {"pieces": entries,
                                 "dense": sum(e["kind"] == "dense" for e in entries),
                                 "exported": sum(bool(e.get("exportable")) and e["kind"] == "dense" for e in entries),
                                 "torch": sum(e["kind"] == "torch" for e in entries)}
    (out / "index.json").write_text(json.dumps(index, indent=2, default=str))
    return index


def _try_torch_piece(split: GraphModule, p: Piece, recorded: tuple, path: Path, opset: int) -> dict:
    """--segments all: try torch.onnx on the torch piece's op alone (no weights lifted); record its error.
    A success is kept as a file but not used by `compose` (the op mutates a cache or is data-dependent)."""
    sub = getattr(split, f"submod_{p.index}")
    args = tuple(a for a in recorded)
    if not all(isinstance(a, torch.Tensor) for a in args):
        return {"onnx_export": "not tried: non-tensor inputs"}
    try:
        torch.onnx.export(_Standalone(sub, _placeholders(sub), {}).eval(), args, str(path), dynamo=True,
                          external_data=True, opset_version=opset, optimize=False, verbose=False)
    except Exception as e:
        return {"onnx_export": f"failed: {_root_cause(e)}"}
    return {"onnx_export": f"exported to {path.name}, unused: {p.reason}"}


@torch.no_grad()
def _verify(split: GraphModule, p: Piece, recorded: tuple, path: Path, entry: dict) -> dict:
    sub = getattr(split, f"submod_{p.index}")
    ref = sub(*recorded)
    ref = list(ref) if isinstance(ref, (tuple, list)) else [ref]
    names = _placeholders(sub)
    wset = set(entry["weights"])
    acts = [a for n, a in zip(names, recorded) if n not in wset]
    try:
        got = _run_ort(_ort_session(path), acts)
    except Exception as e:  # onnxruntime's own reason
        return {"max_rel_err": None, "ok": False, "error": f"onnxruntime: {type(e).__name__}: {str(e)[:500]}"}
    errs = [_rel_err(r, g) for r, g in zip(ref, got)]
    worst = max(errs) if errs else 0.0
    return {"max_rel_err": worst, "ok": worst <= REL_TOL and len(got) == len(ref), "outputs": len(ref)}


# ---- the composed run ----------------------------------------------------------------------------
class _OrtPiece(nn.Module):
    """Calls an exported dense piece in onnxruntime with the activation inputs (weights are inside)."""

    def __init__(self, path: Path, names: list[str], weights: list[str], n_out: int):
        super().__init__()
        self.sess = _ort_session(path)
        self.keep = [i for i, n in enumerate(names) if n not in set(weights)]
        self.n_out = n_out
        self.calls = 0

    def forward(self, *args):
        self.calls += 1
        outs = [torch.from_numpy(o) for o in _run_ort(self.sess, [args[i] for i in self.keep])]
        return tuple(outs) if self.n_out > 1 else outs[0]


def compose(sess, index_dir: str | Path) -> dict[str, list[_OrtPiece]]:
    """Swap every exported dense piece of `sess`'s graphs for onnxruntime (in place); MoE and cache ops
    stay in torch. Returns the ORT modules per graph (their `calls` count the runs)."""
    index_dir = Path(index_dir)
    index = json.loads((index_dir / "index.json").read_text())
    splits = _splits(sess, sess.config, sess.manifest["target"]["name"], tuple(index["graphs"]))
    used = {}
    for kind, (split, pieces) in splits.items():
        entries = {e["piece"]: e for e in index["graphs"][kind]["pieces"]}
        mods = []
        for p in pieces:
            e = entries.get(p.index)
            if p.kind != "dense" or not e or not e.get("exportable"):
                continue
            sub = getattr(split, f"submod_{p.index}")
            m = _OrtPiece(index_dir / kind / e["file"], _placeholders(sub), e["weights"], len(_outputs(sub)))
            setattr(split, f"submod_{p.index}", m)
            mods.append(m)
        sess.graphs[kind] = split
        used[kind] = mods
    return used


def format_index(index: dict) -> str:
    lines = []
    for kind, g in index["graphs"].items():
        lines.append(f"{kind}: {g['dense']} dense pieces ({g['exported']} exported), {g['torch']} torch ops between")
        for e in g["pieces"]:
            if e["kind"] == "torch":
                lines.append(f"  [{e['piece']:3d}] torch  {e['op']}: {e['reason']}"
                             + (f"; torch.onnx: {e['onnx_export']}" if e.get("onnx_export") else ""))
            elif e.get("exportable") is None:
                lines.append(f"  [{e['piece']:3d}] dense, {e['reason']}")
            elif e.get("exportable"):
                v = e.get("verify")
                ver = ("" if not v else f"  onnxruntime FAILED: {v['error']}" if v.get("error") else
                       f"  max rel err {v['max_rel_err']:.2e} {'ok' if v['ok'] else 'FAIL'}")
                lines.append(f"  [{e['piece']:3d}] onnx   {e['file']} ({e['n_ops']} ops, {len(e['inputs'])} inputs, "
                             f"{len(e['weights'])} weights){ver}")
            else:
                lines.append(f"  [{e['piece']:3d}] dense, not exportable: {e['reason']}")
    return "\n".join(lines)
