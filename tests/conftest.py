import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))  # tests/oracle.py and other helpers

# The test models are tiny: one thread avoids oversubscription on 2-core CI machines.
torch.set_num_threads(1)

# Triton kernels run under the interpreter on CPU-only machines. triton.jit decides interpreter vs
# compiler when a kernel module is imported, and any test may import them first (register_ops loads
# the quantised-expert op), so the switch is set here, before every test module.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
