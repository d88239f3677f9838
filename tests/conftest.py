import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))  # tests/oracle.py and other helpers

# The test models are tiny: one thread avoids oversubscription on 2-core CI machines.
torch.set_num_threads(1)
