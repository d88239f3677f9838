"""run54's recorded timelines (profiles.txt, `profile_step --timeline`) grouped by kernel class on the step's
critical path (profile_step.critical_rows), beside the class bytes and bandwidth each profile printed.
`python critical.py` prints one table per profile."""
import re
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[2]))
import profile_step as ps  # noqa: E402

KEYS = {"routed experts": "routed_experts", "attention and caches": "kv", "dense GEMMs and head": "non_expert_weights"}


def parse(part: str) -> tuple[str, list[dict], dict, float]:
    """One profile's title, timeline rows, class bytes (step_bytes keys) and copy bandwidth (bytes/s)."""
    title = part.split("\n")[0]
    full = part[part.index("== full"):]
    rows = [dict(name=m[0].strip(), start=float(m[1]), us=float(m[2]), gap=float(m[3]))
            for m in re.findall(r"^\| ([^|]+) \| ([-0-9.]+) \| ([-0-9.]+) \| ([-0-9.]+) \|$", full, re.M)]
    sb, bw = {"head": 0.0}, 0.0
    for cls, mb, gbs, share in re.findall(r"^\| (routed experts|attention and caches|dense GEMMs and head) \| "
                                          r"\d+ \| \d+ \| ([0-9.]+) \| (\d+) \| (\d+)% \|$", part, re.M):
        sb[KEYS[cls]] = float(mb) * 1e6
        if cls == "dense GEMMs and head":  # its share is printed to the percent; the largest, so the closest
            bw = float(gbs) * 1e9 / (float(share) / 100)
    return title, rows, sb, bw


def main() -> int:
    for part in re.split(r"^### ", (HERE / "out" / "profiles.txt").read_text(), flags=re.M)[1:]:
        title, rows, sb, bw = parse(part)
        crit = ps.class_table(ps.critical_rows(rows), 1, sb, bw)
        print(f"\n{title}: {sum(c['us'] for c in crit):.0f} us of kernels on the critical path "
              f"(copy bandwidth {bw / 1e9:.0f} GB/s)")
        ps.print_classes(crit)
    return 0


if __name__ == "__main__":
    sys.exit(main())
