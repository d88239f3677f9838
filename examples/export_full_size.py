"""Time and peak memory of exporting a full-size config on the meta device (no weights).

Run: python examples/export_full_size.py v4-flash decode
"""
from __future__ import annotations

import resource
import sys
import time

from dsv4c import ModelConfig
from dsv4c.export import GraphSpec, export_graph
from dsv4c.model import build_model


def main(argv: list[str]) -> int:
    name = argv[0] if argv else "v4-flash"
    kind = argv[1] if len(argv) > 1 else "decode"
    t0 = time.perf_counter()
    model = build_model(ModelConfig.preset(name), device="meta")
    built = time.perf_counter() - t0
    eg = export_graph(model, GraphSpec(kind, n_slots=8, max_len=4096))
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"{name} {kind}: build {built:.1f}s, export {eg.seconds:.1f}s, {len(eg.program.graph.nodes)} nodes, "
          f"peak RSS {peak_mb:.0f} MB")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
