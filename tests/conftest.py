"""Test-suite settings: one intra-op thread per pytest worker (the suite runs with -n 2 on 2 cores;
more threads than cores makes OpenMP spin-waits dominate the many tiny ops these tests run)."""

import torch

torch.set_flush_denormal(True)  # as the `titans` commands do (see titans/cli.py)
torch.set_num_threads(1)
