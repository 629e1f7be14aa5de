"""Test-suite settings: one intra-op thread per pytest worker (the suite runs with -n 2 on 2 cores;
more threads than cores makes OpenMP spin-waits dominate the many tiny ops these tests run). Without a GPU,
Triton kernels run in Triton's interpreter: the setting must be in place before any module imports triton
(it is read when a kernel is defined), and which test module does so first depends on the test order.

A shell without job control starts a background job (`make test &`, `nohup`, some CI runners) with SIGINT
ignored, and a process and the commands it starts keep an ignored signal ignored: the tests that send
SIGINT to a training loop or to a `titans` command they start would then test nothing. Python's own
handler is put back here, so the suite's result does not depend on how it was started."""

import os
import signal

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

torch.set_flush_denormal(True)  # as the `titans` commands do (see titans/cli.py)
torch.set_num_threads(1)

if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture(scope="session", autouse=True)
def _token_cache(tmp_path_factory):
    """Token caches in this run's temporary folder (shared by its xdist workers), not the user's
    ~/.cache/titans: commands that read data through the default cache (and the documented commands the
    suite runs, which inherit the environment) wrote tens of MB there."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent
    os.environ["TITANS_CACHE_DIR"] = str(root / "titans-cache")
