"""Plot routing flips per MoE layer and top-k margins from examples/accuracy_slice.py's JSON (or the list
that `dsv4c compare --json` prints).

    python examples/plot_routing.py OUT/accuracy.json --out OUT/routing.png
    dsv4c compare v4-tiny-a --pin-routing --json > cmp.json && python examples/plot_routing.py cmp.json --out r.png

Left: per MoE layer, the share of tokens whose top-k expert set differs from eager's, free (solid) and
pinned (dashed), one line per expert format (or per graph's last pass for compare's JSON). Right: per
layer, the quantiles of eager's top-k margin (min, p1, p10, p50) on a log scale, one marker per model.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path


def series(data) -> tuple[dict, dict]:
    """({label: (layers, free shares, pinned shares)}, {model: [margin entries]}) from either JSON."""
    flips, margins = {}, {}
    if isinstance(data, list):  # dsv4c compare --json: the last measured row of each graph
        for graph in dict.fromkeys(r["graph"] for r in data):
            rows = [r for r in data if r["graph"] == graph]
            last = next((r for r in reversed(rows) if r.get("flips")), None)
            if last:
                flips[f"{graph} ({last['name']})"] = _flip_lists(last)
            if rows[0].get("margins"):
                margins[graph] = rows[0]["margins"]
        return flips, margins
    for r in data.get("formats", []):
        if r.get("flips"):
            flips[r["format"]] = _flip_lists(r)
    art = data.get("artifact") or {}
    if art.get("flips"):
        flips[f"artifact ({art.get('expert_format')})"] = _flip_lists(art)
    return flips, data.get("margins", {})


def _flip_lists(r: dict) -> tuple[list, list, list | None]:
    layers = [f["layer"] for f in r["flips"]]
    pinned = [f["share"] for f in r["pinned_flips"]] if r.get("pinned_flips") else None
    return layers, [f["share"] for f in r["flips"]], pinned


def plot(data, out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    flips, margins = series(data)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    for label, (layers, free, pinned) in flips.items():
        line, = ax1.plot(layers, [100 * v for v in free], marker="o", label=f"{label} free")
        if pinned is not None:
            ax1.plot(layers, [100 * v for v in pinned], marker="x", linestyle="--", color=line.get_color(),
                     label=f"{label} pinned")
    ax1.set_ylabel("tokens whose top-k expert set differs from eager's (%)")
    ax1.set_xlabel("MoE layer")
    ax1.set_title("Routing flips")
    ax1.legend(fontsize=7)
    markers = "osd^v"
    for i, (name, ms) in enumerate(margins.items()):
        xs, ys, qs = [], [], []
        for m in ms:
            if "quantiles" not in m:
                continue
            for q in ("p0", "p1", "p10", "p50"):
                xs.append(f"{m['layer']}")
                ys.append(max(m["quantiles"][q], 1e-9))
                qs.append(q)
        ax2.scatter(xs, ys, marker=markers[i % len(markers)], label=name, alpha=0.7)
    ax2.set_yscale("log")
    ax2.set_ylabel("top-k margin: k-th minus (k+1)-th score (min, p1, p10, p50)")
    ax2.set_xlabel("MoE layer (hash layers have none)")
    ax2.set_title("Top-k margins (eager)")
    ax2.legend(fontsize=7)
    for lab in ax1.get_xticklabels() + ax2.get_xticklabels():
        lab.set_rotation(30)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("json", type=Path)
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args(argv)
    print(plot(json.loads(a.json.read_text()), a.out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
