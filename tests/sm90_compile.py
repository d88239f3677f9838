"""Compile (not run) Triton kernels for sm_90 on a machine without a GPU: a script run in a subprocess
with the real compiler (the tests import the kernels under TRITON_INTERPRET=1). The scripts print one
line per compiled variant, starting with "kernel"."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def run_sm90_script(tmp_path: Path, script: str, *args: str, timeout: int = 300) -> list[list[str]]:
    """Run `script` with TRITON_INTERPRET=0 and a private Triton cache; -> the fields after "kernel" of
    each line it printed that starts with it. Fails the test with the script's stderr on an error."""
    path = tmp_path / "sm90.py"
    path.write_text(script)
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_CACHE_DIR": str(tmp_path / "cache")}
    res = subprocess.run([sys.executable, str(path), *args], env=env, capture_output=True, text=True,
                         timeout=timeout)
    assert res.returncode == 0, res.stderr[-3000:]
    return [ln.split()[1:] for ln in res.stdout.splitlines() if ln.startswith("kernel")]
