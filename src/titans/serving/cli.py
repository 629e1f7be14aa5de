"""`titans serve`: the memory server over a trained checkpoint.

    titans serve --checkpoint runs/main --api-keys keys.txt                       # SQLite store, loopback
    titans serve --checkpoint runs/main --store redis://10.0.0.5:6379/0 --api-keys keys.txt --host 0.0.0.0

Without --api-keys the server has no keys (every request is one anonymous owner): it then only starts on
a loopback host, unless --no-auth says that anyone who can reach it may use it.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import math
import multiprocessing.util
import os
import sys
from pathlib import Path

import torch

from titans.inference.session import DEFAULT_GUARD_MAX_RISE
from titans.runtime.device import max_cpu_threads, resolve_device, set_cpu_threads
from titans.runtime.loading import checkpoint_of, load_trained
from titans.serving import limits as d  # its defaults; it needs the serve extra only to serve
from titans.serving.auth import is_loopback, load_api_keys
from titans.serving.errors import redact, redact_url
from titans.serving.session import DEFAULT_MAX_SNAPSHOTS, Engine
from titans.serving.stores import StoreError, open_store
from titans.serving.workers import reuse_freed_memory
from titans.validation import path_arg

DEFAULT_STORE = "sqlite:///titans-sessions.db"


def check_serve_args(args: argparse.Namespace) -> None:
    """Option errors of `titans serve`, found before the model is loaded."""
    if args.api_keys and args.no_auth:
        raise ValueError("--api-keys and --no-auth contradict each other: give one")
    if not args.api_keys and not args.no_auth and not is_loopback(args.host):
        raise ValueError(
            f"refusing to serve without API keys on --host {args.host}, which other machines can reach: "
            "give --api-keys FILE (one key per line), or --no-auth to let anyone who reaches it in"
        )
    if not 0 <= args.port < 65536:
        raise ValueError(f"--port must be in [0, 65535], got {args.port}")
    if args.workers < 0:
        raise ValueError(f"--workers must be >= 0 (0: one per CPU core), got {args.workers}")
    if args.workers > max_cpu_threads():  # 1,000,000 set about starting as many worker processes
        raise ValueError(
            f"--workers {args.workers}: give at most {max_cpu_threads()} (4 per CPU core, at least 64)"
        )
    for name in ("max_body_bytes", "max_tokens", "torch_threads"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.torch_threads > max_cpu_threads():
        raise ValueError(f"--torch-threads {args.torch_threads}: give at most {max_cpu_threads()}")
    for name in ("max_new_tokens", "snapshots"):
        if getattr(args, name) < 0:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(args, name)}")
    if not 0 <= args.guard_max_rise < math.inf:
        raise ValueError(f"--guard-max-rise must be a number >= 0, got {args.guard_max_rise}")
    check_limit_args(args)


def check_limit_args(args: argparse.Namespace) -> None:
    """The per-key limits and timeouts (0: no limit, where a flag says so)."""
    for name in ("max_sessions_per_key", "max_bytes_per_key", "max_concurrent_per_key", "workers_per_key"):
        if getattr(args, name) < 0:
            raise ValueError(
                f"--{name.replace('_', '-')} must be >= 0 (0: no limit), got {getattr(args, name)}"
            )
    for name in ("session_ttl", "body_timeout", "keep_alive_timeout", "header_timeout", "shutdown_timeout"):
        if not 0 <= getattr(args, name) < math.inf:
            raise ValueError(
                f"--{name.replace('_', '-')} must be a number of seconds >= 0, got {getattr(args, name)}"
            )
    if args.max_import_bytes < 1:
        raise ValueError(f"--max-import-bytes must be >= 1, got {args.max_import_bytes}")
    if args.store_pool < 1:
        raise ValueError(f"--store-pool must be >= 1, got {args.store_pool}")


def quotas_from(args: argparse.Namespace):
    """`Quotas` of the parsed flags (0: no limit)."""
    return d.Quotas(
        max_sessions=args.max_sessions_per_key or None,
        max_bytes=args.max_bytes_per_key or None,
        max_concurrent=args.max_concurrent_per_key or None,
        session_ttl_s=args.session_ttl or None,
        body_timeout_s=args.body_timeout or None,
        workers_per_key=args.workers_per_key or None,
    )


def build_app(args: argparse.Namespace):
    """(FastAPI app, store) for parsed `titans serve` options: the model loaded, the store opened."""
    try:  # the optional `serve` extra
        from titans.serving.app import create_app
    except ModuleNotFoundError as e:
        raise ImportError(f"titans serve needs the serve extra (pip install 'titans[serve]'): {e}") from e
    set_cpu_threads(args.torch_threads, "--torch-threads")
    reuse_freed_memory()  # here too: without worker processes, the model work runs in this process
    keys = load_api_keys(args.api_keys) if args.api_keys else None
    device = resolve_device(args.device)
    checkpoint = checkpoint_of(args.checkpoint)
    model, tokenizer = load_trained(checkpoint, map_location=device)
    probe = None
    if args.guard_probe:
        try:
            probe = Path(args.guard_probe).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"--guard-probe {args.guard_probe}: cannot read it as UTF-8 text ({e})") from e
    engine = Engine(
        model,
        tokenizer,
        max_snapshots=args.snapshots,
        probe=probe,
        guard_max_rise=args.guard_max_rise,
        decode_graph=args.decode_graph,
        weights=checkpoint.weights_id,  # a session stored by a server of other weights is refused
    )
    try:
        store = open_store(args.store, pool_size=args.store_pool)
    except (StoreError, ValueError) as e:  # one line on stderr, without the URL's password
        raise OSError(redact(str(e))) from None
    limits = d.Limits(
        max_body_bytes=args.max_body_bytes,
        max_tokens=args.max_tokens,
        max_new_tokens=args.max_new_tokens,
        max_import_bytes=args.max_import_bytes,
    )
    workers = args.workers or cpu_cores()
    app = create_app(
        engine,
        store,
        key_hashes=keys,
        limits=limits,
        workers=workers,
        model_name=str(args.checkpoint),
        quotas=quotas_from(args),
        worker_processes=worker_processes(args.worker_processes, device, store),
        torch_threads=args.torch_threads,
    )
    return app, store


def cpu_cores() -> int:
    """CPU cores this process may run on."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


# the stores a worker process opens from their URL and shares with the server: a store added with
# `register_store` is unknown to a worker's fresh interpreter (and one in this process's memory is its own)
WORKER_STORES = ("sqlite", "redis")


def worker_processes(choice: str, device: torch.device, store) -> bool:
    """Whether the model work runs in worker processes (--worker-processes): auto, on a CPU with a store
    that opens from its URL (SQLite, Redis), in a process that may start others (not a daemonic one)."""
    if choice == "yes" and store.kind not in WORKER_STORES:
        raise ValueError(
            f"--worker-processes yes: each worker opens the store from its URL, and a {store.kind!r} store "
            "is not one it can open and share (only sqlite:// and redis:// are): use --worker-processes no"
        )
    if choice != "auto":
        return choice == "yes"
    import multiprocessing

    daemonic = multiprocessing.current_process().daemon
    return device.type == "cpu" and store.kind in WORKER_STORES and not daemonic


def run_serve(args: argparse.Namespace) -> int:
    check_serve_args(args)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    app, store = build_app(args)
    import uvicorn  # the optional `serve` extra, installed with fastapi

    log = logging.getLogger("titans.serving")
    log.info(
        "store %s (%d sessions); keys: %s",
        redact_url(store.url),
        store.count(),
        args.api_keys or "none (no auth)",
    )
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        timeout_graceful_shutdown=args.shutdown_timeout,
        timeout_keep_alive=args.keep_alive_timeout,
        **({"http": d.head_timeout_protocol(args.header_timeout)} if args.header_timeout else {}),
    )
    server = stopping_server(config, lambda: app.state.stop(args.shutdown_timeout))
    try:
        server.run()
    finally:
        store.close()
    left = app.state.service.calls_in_threads
    if left:
        # their requests were answered 503 ("may or may not have been applied"); a thread cannot be ended,
        # and the interpreter would wait for them (a long read kept the process for its whole length,
        # past --shutdown-timeout) to write to a closed store. Worker processes are killed instead.
        log.warning("%d model call(s) still running at exit: ended unfinished", left)
        # os._exit skips multiprocessing's exit handlers, which remove the quota locks' and the worker
        # pool's named semaphores: the resource tracker warned of "leaked semaphore objects" and removed them
        multiprocessing.util._run_finalizers(0)
        logging.shutdown()
        sys.stdout.flush()
        os._exit(128 + int(server.stopped_by) if server.stopped_by is not None else 1)
    if server.stopped_by is not None:  # the shell's convention, as `titans train`: 143 (SIGTERM), 130
        return 128 + int(server.stopped_by)
    return 0 if server.started else 1  # not started: uvicorn logged why (the port taken, ...)


def stopping_server(config, stop):
    """A uvicorn server that calls `stop()` when it begins to shut down (SIGINT, SIGTERM), before it
    waits up to the config's timeout_graceful_shutdown for the requests in flight.

    uvicorn raises the signal again once it has shut down, so that the default action ends the process:
    that would end it before the store is closed and before Python's exit handlers run (multiprocessing's
    among them, which remove the worker pool's and the quota locks' semaphores: "leaked semaphore
    objects" at every stop). The signal is kept in `stopped_by` instead, and the command exits with
    128 + its number."""
    import uvicorn

    class StoppingServer(uvicorn.Server):
        stopped_by: int | None = None

        async def shutdown(self, sockets=None) -> None:
            stop()
            await super().shutdown(sockets)

        @contextlib.contextmanager
        def capture_signals(self):
            with super().capture_signals():
                try:
                    yield
                finally:
                    caught = getattr(self, "_captured_signals", None)  # what uvicorn would raise again
                    if caught:
                        self.stopped_by = caught[0]
                        caught.clear()

    return StoppingServer(config)


def add_limit_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--max-sessions-per-key",
        type=int,
        default=d.DEFAULT_MAX_SESSIONS,
        help="sessions a key may hold (0: no limit)",
    )
    p.add_argument(
        "--max-bytes-per-key",
        type=int,
        default=d.DEFAULT_MAX_BYTES,
        help="bytes a key's sessions may take in the store (0: no limit)",
    )
    p.add_argument(
        "--max-concurrent-per-key",
        type=int,
        default=d.DEFAULT_MAX_CONCURRENT,
        help="requests of one key in the server at once, running or waiting; more get 429 (0: no limit)",
    )
    p.add_argument(
        "--workers-per-key",
        type=int,
        default=0,
        help="a key's fair share of the workers (0: half of --workers, at least 1): waiting keys take turns, "
        "those running fewer first",
    )
    p.add_argument(
        "--session-ttl",
        type=float,
        default=d.DEFAULT_SESSION_TTL_S,
        help="seconds a session may go unchanged before it is deleted (0: never)",
    )
    p.add_argument(
        "--body-timeout",
        type=float,
        default=d.DEFAULT_BODY_TIMEOUT_S,
        help="seconds a client has to send a request body; slower ones get 408 (0: no limit)",
    )
    p.add_argument(
        "--header-timeout",
        type=float,
        default=d.DEFAULT_HEADER_TIMEOUT_S,
        help="seconds a client has to send a request's line and headers; slower ones are cut off "
        "(0: no limit)",
    )
    p.add_argument(
        "--keep-alive-timeout",
        type=float,
        default=5.0,
        help="seconds an idle keep-alive connection stays open",
    )
    p.add_argument(
        "--shutdown-timeout",
        type=float,
        default=10.0,
        help="seconds the requests running at a SIGTERM or Ctrl-C have to finish; those still running "
        "then, and those waiting for a worker at once, get 503 with Retry-After",
    )
    p.add_argument(
        "--store-pool",
        type=int,
        default=8,
        help="connections to the store at most in the server process (each worker process opens 2 more)",
    )
    p.add_argument(
        "--max-import-bytes",
        type=int,
        default=d.Limits.max_import_bytes,
        help="larger bodies of POST /v1/sessions/import (a whole session's bytes) get 413",
    )


def register(commands, evals) -> None:
    p = commands.add_parser(
        "serve",
        help="serve per-session memories over HTTP (FastAPI; the API is described at /docs)",
        description="An HTTP API of sessions: each reads text into its own memory state, kept in a store.",
    )
    p.add_argument("--checkpoint", type=path_arg, required=True, help="checkpoint folder or run folder")
    p.add_argument(
        "--store",
        default=DEFAULT_STORE,
        help="sqlite:///PATH (sqlite:////abs/path), redis://HOST:PORT/DB, rediss://..., unix:///SOCKET?db=N",
    )
    p.add_argument(
        "--api-keys", type=path_arg, help="file of API keys, one per line (only their sha256 hashes are kept)"
    )
    p.add_argument("--no-auth", action="store_true", help="serve without keys on a non-loopback host")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=int, default=8000, help="port to listen on")
    limits = d.Limits
    p.add_argument(
        "--max-body-bytes", type=int, default=limits.max_body_bytes, help="larger request bodies get 413"
    )
    p.add_argument(
        "--max-tokens", type=int, default=limits.max_tokens, help="tokens of text or prompt per request (422)"
    )
    p.add_argument(
        "--max-new-tokens",
        type=int,
        default=limits.max_new_tokens,
        help="max_new_tokens a generate may ask for",
    )
    p.add_argument("--snapshots", type=int, default=DEFAULT_MAX_SNAPSHOTS, help="snapshots kept per session")
    p.add_argument(
        "--guard-probe",
        type=path_arg,
        metavar="FILE",
        help="a fixed probe text (UTF-8): new sessions are guarded; a write that raises its loss by more "
        "than --guard-max-rise is undone and the session frozen",
    )
    p.add_argument(
        "--guard-max-rise",
        type=float,
        default=DEFAULT_GUARD_MAX_RISE,
        help="the guard's limit on the probe loss's rise, a share (0.05: 5%%)",
    )
    p.add_argument(
        "--workers",
        type=int,
        default=0,
        help="model work running at once (sessions in parallel); 0: one per CPU core",
    )
    p.add_argument(
        "--worker-processes",
        choices=["auto", "yes", "no"],
        default="auto",
        help="run the model work in --workers processes, each with its own copy of the model (yes), or in "
        "threads of the server's process (no); auto: processes on a CPU with a SQLite or Redis store",
    )
    p.add_argument(
        "--decode-graph",
        nargs="?",
        const="compile",
        choices=("compile", "cuda_graph", "eager"),
        help="generate through fixed state buffers, each step compiled (torch.compile, the default) or a "
        "CUDA graph; compiled during the warm-up, before /v1/ready says ok",
    )
    add_limit_args(p)
    p.add_argument(
        "--torch-threads", type=int, default=1, help="torch intra-op threads (torch.set_num_threads)"
    )
    p.add_argument("--device", default="auto", help="auto (cuda if available, else cpu), cpu, cuda, cuda:1")
    p.add_argument(
        "--log-level", default="info", choices=["debug", "info", "warning", "error"], help="log level"
    )
    p.set_defaults(func=run_serve, check=check_serve_args)


__all__ = [
    "DEFAULT_STORE",
    "add_limit_args",
    "build_app",
    "check_limit_args",
    "check_serve_args",
    "quotas_from",
    "register",
    "run_serve",
    "stopping_server",
]
