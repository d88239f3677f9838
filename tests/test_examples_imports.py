"""Every name an example imports from another example exists there. Examples import each other's helpers
inside functions, where nothing runs them until that branch does: compare_passes' MTP rungs imported a helper
that bench_mtp had dropped and reported themselves "not available" for five days."""
from __future__ import annotations

import ast
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def _top_level_names(tree: ast.Module) -> set[str]:
    names: set[str] = set()
    for n in tree.body:
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(n.name)
        elif isinstance(n, (ast.Assign, ast.AnnAssign)):
            targets = n.targets if isinstance(n, ast.Assign) else [n.target]
            names |= {x.id for t in targets for x in ast.walk(t) if isinstance(x, ast.Name)}
        elif isinstance(n, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in n.names}
    return names


def _example_imports() -> list[tuple[str, str, str]]:
    """(importing file, example module, name) for every `from <example> import name`, at any depth."""
    mods = {p.stem for p in EXAMPLES.glob("*.py")}
    out = []
    for p in sorted(EXAMPLES.glob("*.py")):
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module in mods:
                out += [(p.name, node.module, a.name) for a in node.names]
    return out


def test_examples_import_only_names_their_sibling_examples_define():
    imports = _example_imports()
    assert len(imports) > 10  # the examples do share helpers (bench_segments, bench_mtp, ...)
    defined = {m: _top_level_names(ast.parse((EXAMPLES / f"{m}.py").read_text())) for _, m, _ in imports}
    missing = [f"{f}: from {m} import {n}" for f, m, n in imports if n not in defined[m]]
    assert not missing, missing


def test_the_check_sees_an_import_inside_a_function(tmp_path, monkeypatch):
    (tmp_path / "a.py").write_text("def f():\n    from b import gone\n    return gone\n")
    (tmp_path / "b.py").write_text("def kept():\n    pass\n")
    monkeypatch.setitem(globals(), "EXAMPLES", tmp_path)
    assert _example_imports() == [("a.py", "b", "gone")]
    assert "gone" not in _top_level_names(ast.parse((tmp_path / "b.py").read_text()))
