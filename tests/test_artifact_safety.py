"""dsv4c/artifact_safety.py on a small exported program: a clean archive passes and loads; every way a
`.pt2` could make `torch.export.load` (or the `.module()` it builds) run code is refused, naming the
file and the entry. (The end-to-end attack on a compiled artifact is in tests/test_bad_inputs.py.)"""
from __future__ import annotations

import io
import json
import zipfile
from pathlib import Path

import pytest
import torch

from dsv4c.artifact_safety import UnsafeArtifactError, check_pt2, checked_bytes, inside, load_program
from dsv4c.compile import ArtifactError


class _Scale(torch.nn.Module):
    def forward(self, x: torch.Tensor, y: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return (x @ w) * x.shape[0] + y @ w


@pytest.fixture(scope="module")
def pt2(tmp_path_factory) -> Path:
    """A stateless program with a dynamic batch (so it has shape expressions and guards), saved the way
    compile saves graphs (example inputs dropped)."""
    auto = torch.export.Dim.AUTO  # x and y share their batch: a guard ties them
    ep = torch.export.export(_Scale(), (torch.randn(4, 3), torch.randn(4, 3), torch.randn(3, 5)),
                             dynamic_shapes=({0: auto}, {0: auto}, None))
    ep._example_inputs = None
    path = tmp_path_factory.mktemp("pt2") / "g.pt2"
    torch.export.save(ep, str(path))
    return path


def _entries(data: bytes) -> tuple[str, dict[str, bytes]]:
    z = zipfile.ZipFile(io.BytesIO(data))
    root = z.namelist()[0].split("/", 1)[0]
    return root, {n.split("/", 1)[1]: z.read(n) for n in z.namelist()}


def _archive(root: str, entries: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED) as z:
        for rel, data in entries.items():
            z.writestr(f"{root}/{rel}", data)
    return buf.getvalue()


def _with_graph(pt2: Path, edit) -> bytes:
    """The archive with its graph JSON edited by `edit(doc)`."""
    root, entries = _entries(pt2.read_bytes())
    doc = json.loads(entries["models/model.json"])
    edit(doc)
    entries["models/model.json"] = json.dumps(doc).encode()
    return _archive(root, entries)


def _first(doc, key):
    """The first dict in `doc` (depth first) that holds `key`."""
    if isinstance(doc, dict):
        if key in doc:
            return doc
        doc = list(doc.values())
    if isinstance(doc, list):
        for v in doc:
            found = _first(v, key)
            if found is not None:
                return found
    return None


def test_clean_archive_passes_and_loads_the_same_program(pt2):
    data = pt2.read_bytes()
    check_pt2(data, pt2)
    doc = json.loads(_entries(data)[1]["models/model.json"])
    assert doc.get("guards_code") and _first(doc, "expr_str") is not None  # the checks below have targets
    ep = load_program(checked_bytes(pt2.parent, pt2.name))
    x, y, w = torch.randn(7, 3), torch.randn(7, 3), torch.randn(3, 5)
    assert torch.equal(ep.module()(x, y, w), _Scale()(x, y, w))


def _set_guard(doc):
    doc["guards_code"].append("__import__('os').system('touch pwned')")


def _set_expr(doc):
    _first(doc, "expr_str")["expr_str"] = "__import__('os').system('touch pwned')"


def _set_name(doc):
    _first(doc, "as_tensor")["as_tensor"]["name"] = "x = __import__('os').system('touch pwned') #"


def _set_target(doc):
    doc["graph_module"]["graph"]["nodes"][0]["target"] = "builtins.exec"


def _set_stack_trace(doc):
    node = doc["graph_module"]["graph"]["nodes"][0]
    node.setdefault("metadata", {})["stack_trace"] = 'File "x\rimport os", line 1, in f\n  g()'


def _set_input_kind(doc):
    doc["graph_module"]["signature"]["input_specs"][0] = {"custom_obj": {"arg": {"name": "c"}, "custom_obj_name": "c"}}


@pytest.mark.parametrize("edit,where", [
    (_set_guard, "guards_code"), (_set_expr, "expr_str"), (_set_name, "is not a plain identifier"),
    (_set_target, "builtins.exec"), (_set_stack_trace, "control character"), (_set_input_kind, "input_specs"),
], ids=["guard_code", "sympy_expression", "node_name", "op_target", "carriage_return", "custom_obj_input"])
def test_graph_json_outside_the_checked_subset_is_refused(pt2, edit, where):
    with pytest.raises(UnsafeArtifactError, match=rf"g.pt2: entry models/model.json, .*{where}"):
        check_pt2(_with_graph(pt2, edit), pt2)


@pytest.mark.parametrize("rel,data,why", [
    ("data/sample_inputs/model.pt", b"\x80\x04N.", "non-empty sample inputs"),
    ("data/constants/custom_obj_0", b"PK", "custom object"),
    ("data/aotinductor/model/model.so", b"\x7fELF", "AOTInductor"),
    ("extra/notes.txt", b"hello", "not one of the entries"),
    ("data/weights/model_weights_config.json",
     json.dumps({"config": {"w": {"path_name": "weight_0", "use_pickle": True}}}).encode(), "pickled: \\['w'\\]"),
])
def test_entries_outside_the_allow_list_are_refused(pt2, rel, data, why):
    root, entries = _entries(pt2.read_bytes())
    entries[rel] = data
    with pytest.raises(UnsafeArtifactError, match=rf"g.pt2: entry {rel} .*{why}"):
        check_pt2(_archive(root, entries), pt2)


def test_not_an_archive_is_named(pt2):
    with pytest.raises(ArtifactError, match="g.pt2: not a readable .pt2 archive"):
        check_pt2(b"not a zip", pt2)


def test_manifest_paths_stay_inside_the_artifact(tmp_path):
    art = tmp_path / "art"
    (art / "graphs").mkdir(parents=True)
    (art / "graphs" / "a.pt2").write_bytes(b"x")
    assert inside(art, "graphs/a.pt2", "f") == art / "graphs" / "a.pt2"
    (tmp_path / "secret").write_text("s")
    (art / "graphs" / "link.pt2").symlink_to(tmp_path / "secret")
    for rel, why in (("../secret", "not a relative path inside"), ("/etc/passwd", "not a relative path inside"),
                     ("graphs/../../secret", "not a relative path inside"), ("graphs/link.pt2", "outside the artifact")):
        with pytest.raises(UnsafeArtifactError, match=f"graphs.decode.file '{rel}' .*{why}"):
            inside(art, rel, "graphs.decode.file")
