"""README's Results table is a copy of rows of BENCHMARKS.md's current-state page: a figure changed in
one place and not the other, or a row the page marks stale, fails here."""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGE_COLUMNS = ["what", "ratio", "accuracy", "date", "commit", "GPU", "command", "status"]
README_COLUMNS = ["what", "ratio", "accuracy", "date", "commit", "GPU"]
COMMIT = re.compile(r"`[0-9a-f]{7,40}`( / `[0-9a-f]{7,40}`)*")
DATE = re.compile(r"\d{4}-\d{2}-\d{2}")


def _tables(text: str) -> list[list[dict[str, str]]]:
    """Markdown tables in `text`, each a list of {header: cell} rows (cells hold no `|`)."""
    tables, lines = [], text.splitlines()
    i = 0
    while i < len(lines):
        if lines[i].startswith("|") and i + 1 < len(lines) and re.fullmatch(r"\|(\s*:?-+:?\s*\|)+", lines[i + 1]):
            head = [c.strip() for c in lines[i].strip().strip("|").split("|")]
            rows, i = [], i + 2
            while i < len(lines) and lines[i].startswith("|"):
                cells = [c.strip() for c in lines[i].strip().strip("|").split("|")]
                assert len(cells) == len(head), f"row with {len(cells)} cells under {head}: {lines[i][:120]}"
                rows.append(dict(zip(head, cells)))
                i += 1
            tables.append((head, rows))
        else:
            i += 1
    return tables


def _section(text: str, start: str, end: str | None) -> str:
    """From the heading `start` to the next `end` heading (or the end of the text)."""
    a = text.index(start) + len(start)
    b = text.find(end, a) if end else -1
    return text[a: b if b >= 0 else len(text)]


def _page_rows() -> list[dict[str, str]]:
    text = (ROOT / "BENCHMARKS.md").read_text()
    page = _section(text, "\n# Current state\n", "\n# Log\n")
    tables = _tables(page)
    assert tables, "BENCHMARKS.md: no tables on the current-state page"
    rows = []
    for head, body in tables:
        assert head == PAGE_COLUMNS, f"BENCHMARKS.md current state: table columns {head}, expected {PAGE_COLUMNS}"
        rows += body
    return rows


def _readme_rows() -> list[dict[str, str]]:
    results = _section((ROOT / "README.md").read_text(), "\n## Results\n", "\n## ")
    tables = _tables(results)
    assert len(tables) == 1 and tables[0][0] == README_COLUMNS, [t[0] for t in tables]
    return tables[0][1]


def test_every_page_row_names_date_commit_gpu_command_and_status():
    for r in _page_rows():
        where = r["what"][:60]
        assert DATE.fullmatch(r["date"]), (where, r["date"])
        assert COMMIT.fullmatch(r["commit"]), (where, r["commit"])
        assert r["GPU"] and r["command"] and r["ratio"], where
        assert re.match(r"(current|superseded by |history|stale: )", r["status"]), (where, r["status"])


def test_readme_results_rows_match_the_current_state_page():
    page = {}
    for r in _page_rows():
        assert r["what"] not in page, f"BENCHMARKS.md: two rows named {r['what']!r}"
        page[r["what"]] = r
    readme = _readme_rows()
    assert readme
    for r in readme:
        assert r["what"] in page, f"README Results row not on BENCHMARKS.md's current-state page: {r['what']!r}"
        p = page[r["what"]]
        for col in ("ratio", "accuracy", "date", "commit", "GPU"):
            assert r[col] == p[col], f"{r['what']!r}: README {col} {r[col]!r} != BENCHMARKS.md {p[col]!r}"
        assert p["status"].startswith("current"), f"{r['what']!r} is not current on the page: {p['status']}"
        assert r["accuracy"] not in ("", "-", "–"), f"{r['what']!r}: a speed figure needs its accuracy"


def test_docs_name_every_pass_and_link_nothing_outside_the_repository():
    from dsv4c.passes import default_pipeline

    readme = (ROOT / "README.md").read_text()
    pipeline = _section(readme, "- The pass pipeline (`passes/`)", "\n- ")
    arch = (ROOT / "ARCHITECTURE.md").read_text()
    table = {row["pass"].strip("`") for head, rows in _tables(arch) if head[0] == "pass" for row in rows}
    for name, _ in default_pipeline():
        assert f"`{name}`" in pipeline, f"README's pass list lacks {name}"
        assert name in table, f"ARCHITECTURE.md's pass table lacks {name}"
    for doc in ("README.md", "ARCHITECTURE.md"):
        text = (ROOT / doc).read_text()
        # a loopback address (the server's quick start) is this machine, not a link outside the repository
        assert not re.search(r"https?://(?!127\.0\.0\.1|localhost)|\]\(\.\./|`\.\./", text), \
            f"{doc} links outside the repository"
