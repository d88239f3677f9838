"""Loading an artifact never runs code from it.

`torch.export.load` is not safe on untrusted files: a `.pt2` archive can carry pickles (sample inputs,
weights or constants marked `use_pickle`, custom or opaque objects), AOTInductor shared libraries, and
its graph JSON feeds `sympy.sympify` (symbolic shapes; sympify is `eval`) and `exec` (the input guards,
and FX code generation from node names). The manifest's sha256 table catches accidents, not attacks:
anyone can recompute it.

So before `torch.export.load` sees a graph file, `check_pt2` reads it through torch's own zip reader
and allows exactly what `torch.export.save` writes for a dsv4c graph (torch 2.11 and 2.13 write the
same entries; weights are lifted, so a graph holds no state):

    archive_format, archive_version, byteorder, .data/version, .data/serialization_id   short text
    models/model.json                                the graph, JSON (checked below)
    data/weights/model_weights_config.json           JSON, empty config (no weights inside)
    data/constants/model_constants_config.json       JSON, empty config (no constants inside)
    data/sample_inputs/model.pt                      empty (torch writes a pickle when non-empty)

and checks the graph JSON: every op target in an allowed namespace (OP_NAMESPACES), node and argument names plain
identifiers, symbolic expressions and guards in a small grammar (parsed with `ast`, never evaluated),
no custom objects, no control characters that could end a line of generated code. The file is read
once; the checked bytes are what is loaded. `inside` keeps manifest paths inside the artifact folder.
"""
from __future__ import annotations

import ast
import io
import json
import re
from pathlib import Path

from dsv4c.compile import ArtifactError


class UnsafeArtifactError(ArtifactError):
    """An artifact file holds something that loading could execute; the message names the file and entry."""


MODEL = "model"
TEXT_ENTRIES = {"archive_format", "archive_version", "byteorder", ".data/version", ".data/serialization_id"}
EMPTY_CONFIGS = {f"data/weights/{MODEL}_weights_config.json", f"data/constants/{MODEL}_constants_config.json"}
GRAPH_JSON = f"models/{MODEL}.json"
SAMPLE_INPUTS = f"data/sample_inputs/{MODEL}.pt"
OP_NAMESPACES = ("aten", "prims", "dsv4c", "_c10d_functional")  # torch.ops.<ns>.<op>.<overload>; the last:
#                                                                  tensor-parallel graphs' collectives
OPERATOR_FNS = {"getitem", "add", "sub", "mul", "floordiv", "truediv", "mod", "neg", "pow", "eq", "ne", "lt", "le",
                "gt", "ge", "and_", "or_", "not_"}  # _operator.<fn>: symbolic-shape arithmetic
ATEN_DUNDER_OPS = {f"__{i}{op}__" for i in ("", "i") for op in ("and", "or", "xor", "lshift", "rshift")}  # aten.__and__
INPUT_KINDS = {"user_input"}
OUTPUT_KINDS = {"user_output", "user_input_mutation"}
SYMPY_FUNCS = {"Symbol", "Integer", "Float", "Rational", "Add", "Mul", "Pow", "Max", "Min", "Abs", "Eq", "Ne", "Lt",
               "Le", "Gt", "Ge", "And", "Or", "Not", "Mod", "floor", "ceiling", "FloorDiv", "ModularIndexing", "Where",
               "PythonMod", "CleanDiv", "CeilToInt", "FloorToInt", "CeilDiv", "LShift", "RShift", "PowByNatural",
               "FloatPow", "FloatTrueDiv", "IntTrueDiv", "IsNonOverlappingAndDenseIndicator", "TruncToFloat",
               "TruncToInt", "RoundToInt", "RoundDecimal", "ToFloat", "Identity"}
SYMPY_CONSTANTS = {"oo", "zoo", "nan", "int_oo", "True", "False"}
SYMPY_ASSUMPTIONS = {"positive", "negative", "nonnegative", "nonpositive", "integer", "real", "finite", "zero",
                     "nonzero", "even", "odd", "rational", "commutative"}
SYMBOL = re.compile(r"[a-z]{1,4}\d+")  # s55, u0, zuf3: torch's shape symbols
GUARD_METHODS = {"size", "stride", "storage_offset", "dim", "numel"}
PICKLE = b"\x80"  # the first byte of a pickle (protocol 2+)
_BAD_CHARS = re.compile("[\x00-\x08\x0b-\x1f\x7f\x85\u2028\u2029]")  # \r and friends end a line of code
_NAME_KEYS = {"name", "as_name"}
_NAME_TABLES = {"tensor_values", "sym_int_values", "sym_bool_values", "sym_float_values"}
_ARITH = (ast.Add, ast.Sub, ast.Mult, ast.Div, ast.FloorDiv, ast.Mod, ast.Pow)
_CMP = (ast.Eq, ast.NotEq, ast.Lt, ast.LtE, ast.Gt, ast.GtE)


# ---- paths ----------------------------------------------------------------------------------------
def inside(art: Path, rel: str, field: str) -> Path:
    """`art / rel`, refused unless it stays inside the artifact folder: no absolute path, no `..`,
    no symlink that resolves elsewhere. `field` names the manifest field in the error."""
    if not isinstance(rel, str) or not rel or Path(rel).is_absolute() or ".." in Path(rel).parts or "\\" in rel:
        raise UnsafeArtifactError(f"{art / 'manifest.json'}: {field} {rel!r} is not a relative path inside the "
                                  f"artifact folder")
    root = art.resolve()
    target = (art / rel).resolve()
    if target != root and root not in target.parents:
        raise UnsafeArtifactError(f"{art / 'manifest.json'}: {field} {rel!r} resolves to {target}, outside the "
                                  f"artifact folder {root} (a symlink?)")
    return art / rel


def check_manifest_paths(art: Path, manifest: dict) -> None:
    """Every path the manifest names (files table, graphs, weights) stays inside `art`."""
    for rel in manifest.get("files", {}):
        inside(art, rel, "files entry")
    for name, g in manifest.get("graphs", {}).items():
        inside(art, g.get("file"), f"graphs.{name}.file")
    for rel in {w.get("file") for w in manifest.get("weights", {}).values()}:
        inside(art, rel, "weights file")


# ---- the archive ----------------------------------------------------------------------------------
def check_pt2(data: bytes, path: Path) -> None:
    """Refuse a `.pt2` archive (bytes read from `path`) unless it holds only the entries listed in the
    module docstring, with the graph JSON in the checked subset. Reads with torch's zip reader, the one
    `torch.export.load` uses, so both see the same entries."""
    import torch

    try:
        reader = torch._C.PyTorchFileReader(io.BytesIO(data))
        records = list(reader.get_all_records())
    except RuntimeError as e:
        raise ArtifactError(f"{path}: not a readable .pt2 archive ({str(e).splitlines()[0]})") from None
    if len(set(records)) != len(records):
        raise UnsafeArtifactError(f"{path}: duplicate archive entries")
    for rec in records:
        _check_entry(path, rec, reader.get_record(rec))  # (the archive is in memory already: no size limit)
    for need in (GRAPH_JSON, SAMPLE_INPUTS, *EMPTY_CONFIGS):
        if need not in records:
            raise ArtifactError(f"{path}: entry {need} is missing (not a torch.export archive of a dsv4c graph)")


def _check_entry(path: Path, rec: str, data: bytes) -> None:
    def refuse(why: str):
        raise UnsafeArtifactError(f"{path}: entry {rec} {why}; dsv4c refuses to load it (loading could run code "
                                  f"from the file)")

    if rec in TEXT_ENTRIES:
        if len(data) > 64:
            refuse(f"is {len(data)} bytes, expected a short text")
        return
    if rec == SAMPLE_INPUTS:
        if data:
            kind = ", a pickle" if data[:1] == PICKLE else ""
            refuse(f"holds non-empty sample inputs ({len(data)} bytes{kind})")
        return
    if rec in EMPTY_CONFIGS:
        cfg = _json(path, rec, data)
        if not isinstance(cfg, dict) or cfg.get("config") != {}:
            entries = cfg.get("config") if isinstance(cfg, dict) else None
            pickled = [k for k, v in (entries or {}).items() if isinstance(v, dict) and v.get("use_pickle")]
            refuse(f"lists stored tensors or objects{' marked as pickled: ' + str(pickled[:3]) if pickled else ''} "
                   f"(a dsv4c graph holds no state)")
        return
    if rec == GRAPH_JSON:
        check_graph_json(_json(path, rec, data), path, rec)
        return
    name = rec.rsplit("/", 1)[-1]
    if rec.startswith("data/aotinductor/"):
        refuse("is an AOTInductor file (a shared library)")
    if name.startswith("custom_obj_"):
        refuse("is a custom object (TorchScript pickle)")
    if name.startswith("opaque_obj_"):
        refuse("is an opaque object (a pickle)")
    if data[:1] == PICKLE or rec.endswith((".pt", ".pkl", ".pickle")):
        refuse("is a pickle")
    refuse("is not one of the entries torch.export.save writes for a dsv4c graph")


def _json(path: Path, rec: str, data: bytes):
    try:
        return json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ArtifactError(f"{path}: entry {rec} is not valid JSON ({e})") from None


# ---- the graph JSON -------------------------------------------------------------------------------
def check_graph_json(doc, path: Path, rec: str = GRAPH_JSON) -> None:
    """Refuse a serialized ExportedProgram unless every string torch turns into code is in the checked
    subset (see the module docstring)."""
    def refuse(where: str, why: str):
        raise UnsafeArtifactError(f"{path}: entry {rec}, {where}: {why}; dsv4c refuses to load it")

    if not isinstance(doc, dict) or not isinstance(doc.get("graph_module"), dict):
        refuse("top level", "not a serialized ExportedProgram")
    for i, g in enumerate(doc.get("guards_code") or []):
        if not isinstance(g, str) or not _valid(g, _guard_node):
            refuse(f"guards_code[{i}]", f"{str(g)[:120]!r} is not a plain shape guard")
    for k in doc.get("range_constraints") or {}:
        if not SYMBOL.fullmatch(k):
            refuse("range_constraints", f"{k[:80]!r} is not a shape symbol")
    sig = doc["graph_module"].get("signature") or {}
    for spec in sig.get("input_specs", []):
        if not isinstance(spec, dict) or not set(spec) <= INPUT_KINDS:
            refuse("signature.input_specs", f"kind {sorted(spec) if isinstance(spec, dict) else spec} (only "
                                            f"{sorted(INPUT_KINDS)}: the graph takes its weights as inputs)")
    for spec in sig.get("output_specs", []):
        if not isinstance(spec, dict) or not set(spec) <= OUTPUT_KINDS:
            refuse("signature.output_specs", f"kind {sorted(spec) if isinstance(spec, dict) else spec}")
    _walk(doc, "", refuse)


def _walk(o, where: str, refuse) -> None:
    if isinstance(o, dict):
        for k, v in o.items():
            if _BAD_CHARS.search(k):
                refuse(where or "top level", f"key {k[:80]!r} holds a control character")
            at = f"{where}.{k}" if where else k
            if k in _NAME_KEYS and isinstance(v, str) and not _identifier(v):
                refuse(at, f"name {v[:80]!r} is not a plain identifier")
            elif k in _NAME_TABLES and isinstance(v, dict):
                bad = [n for n in v if not _identifier(n)]
                if bad:
                    refuse(at, f"name {bad[0][:80]!r} is not a plain identifier")
            elif k == "custom_obj_values" and v:
                refuse(at, "holds custom objects")
            elif k in ("as_custom_obj", "as_custom_objs"):
                refuse(at, "is a custom-object argument")
            elif k == "expr_str" and not (isinstance(v, str) and _valid(v, _sympy_node)):
                refuse(at, f"{str(v)[:120]!r} is not a plain symbolic expression")
            elif k == "target" and isinstance(v, str) and not _allowed_target(v):
                refuse(at, f"op {v[:120]!r} is outside the allowed namespaces ({', '.join(OP_NAMESPACES)})")
            _walk(v, at, refuse)
    elif isinstance(o, list):
        for i, v in enumerate(o):
            _walk(v, f"{where}[{i}]", refuse)
    elif isinstance(o, str) and _BAD_CHARS.search(o):
        refuse(where, "a string holds a control character that ends a line of generated code")


def _identifier(s: str) -> bool:
    return s.isidentifier() and s.isascii() and not s.startswith("__")


def _allowed_target(t: str) -> bool:
    parts = t.split(".")
    if parts[0] == "_operator":
        return len(parts) == 2 and parts[1] in OPERATOR_FNS
    return (len(parts) in (4, 5) and parts[:2] == ["torch", "ops"] and parts[2] in OP_NAMESPACES
            and (_identifier(parts[3]) or parts[3] in ATEN_DUNDER_OPS) and all(_identifier(p) for p in parts[4:]))


def _valid(src: str, node_ok) -> bool:
    if len(src) > 10_000:
        return False
    try:
        tree = ast.parse(src, mode="eval")
    except (SyntaxError, ValueError):
        return False
    return all(node_ok(n) for n in ast.walk(tree))


def _guard_node(n: ast.AST) -> bool:
    """Guards such as `L['slots'].size()[0] == L['input_ids'].size()[0]` or `L['x'].size()[1] <= 64`."""
    if isinstance(n, (ast.Expression, ast.Compare, ast.BoolOp, ast.And, ast.Or, ast.Load, ast.Not, ast.USub,
                      *_CMP, *_ARITH)):
        return True
    if isinstance(n, (ast.UnaryOp, ast.BinOp)):
        return isinstance(n.op, (ast.Not, ast.USub, *_ARITH))
    if isinstance(n, ast.Constant):
        return type(n.value) in (int, float, bool) or (isinstance(n.value, str) and _identifier(n.value))
    if isinstance(n, ast.Name):
        return n.id == "L"
    if isinstance(n, ast.Subscript):
        return isinstance(n.slice, ast.Constant)
    if isinstance(n, ast.Call):
        return (isinstance(n.func, ast.Attribute) and n.func.attr in GUARD_METHODS and not n.args
                and not n.keywords)
    if isinstance(n, ast.Attribute):
        return n.attr in GUARD_METHODS
    return False


def _sympy_node(n: ast.AST) -> bool:
    """Expressions such as `Symbol('s55', positive=True, integer=True)` or `FloorDiv(s0 + 1, 4)`."""
    if isinstance(n, (ast.Expression, ast.Compare, ast.BoolOp, ast.And, ast.Or, ast.Load, ast.Not, ast.USub,
                      *_CMP, *_ARITH)):
        return True
    if isinstance(n, (ast.UnaryOp, ast.BinOp)):
        return isinstance(n.op, (ast.Not, ast.USub, *_ARITH))
    if isinstance(n, ast.Constant):
        return type(n.value) in (int, float, bool) or (isinstance(n.value, str) and SYMBOL.fullmatch(n.value))
    if isinstance(n, ast.Name):
        return n.id in SYMPY_FUNCS or n.id in SYMPY_CONSTANTS or bool(SYMBOL.fullmatch(n.id))
    if isinstance(n, ast.Call):
        return isinstance(n.func, ast.Name) and n.func.id in SYMPY_FUNCS
    if isinstance(n, ast.keyword):
        return n.arg in SYMPY_ASSUMPTIONS and isinstance(n.value, ast.Constant) and isinstance(n.value.value, bool)
    return False


# ---- loading ----------------------------------------------------------------------------------------
def checked_bytes(art: Path, rel: str, field: str = "graph file") -> bytes:
    """The bytes of the graph archive `art / rel`, read once and checked (`check_pt2`): load these, not
    the file, so it cannot change between the check and the load."""
    path = inside(art, rel, field)
    data = path.read_bytes()
    check_pt2(data, path)
    return data


def load_program(data: bytes):
    """`torch.export.load` of archive bytes that passed `check_pt2` (`checked_bytes`)."""
    import torch

    return torch.export.load(io.BytesIO(data))
