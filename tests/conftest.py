"""Test-suite settings: one intra-op thread per pytest worker (the suite runs with -n 2 on 2 cores;
more threads than cores makes OpenMP spin-waits dominate the many tiny ops these tests run). Without a GPU,
Triton kernels run in Triton's interpreter: the setting must be in place before any module imports triton
(it is read when a kernel is defined), and which test module does so first depends on the test order."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

torch.set_flush_denormal(True)  # as the `titans` commands do (see titans/cli.py)
torch.set_num_threads(1)
