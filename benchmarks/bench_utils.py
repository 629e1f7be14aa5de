"""The benchmarks' harness: timing, resident memory, the machine description, one JSON result writer,
isolated worker runs, FLOP counts and tables.

Every script in `benchmarks/` takes these from here instead of keeping its own: its times come from
`Timer` / `time_runs` / `time_cuda` (summarised by `timing_summary`), its memory from `peak_rss_*` /
`current_rss_*`, its result file from `save_json`, which records the command line and `machine_info()`
(CPU model, threads, memory, torch, the GPU when there is one) next to the results. A script in
`benchmarks/diagnostics/` puts `benchmarks/` on `sys.path` before importing this module.

A measured configuration that must not share a process with the next runs in a fresh interpreter
(`run_worker`, answered by `reply`), so that its peak RSS is its own and one run's allocations, caches and
threads cannot pollute the next.
"""

from __future__ import annotations

import json
import os
import platform
import resource
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from titans._fs import write_text_atomic

RESULTS = Path(__file__).resolve().parent / "results"


# ------------------------------------------------------------------------------------------ processes
def run_worker(script: str, spec: dict, timeout: float = 1800) -> dict:
    """Run `python script --worker JSON` in a fresh interpreter; return the JSON dict it prints last.

    A worker that fails (e.g. killed for memory) or runs past `timeout` seconds yields {"error": ...}
    instead of stopping the benchmark.
    """
    cmd = [sys.executable, script, "--worker", json.dumps(spec)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        return {"error": f"exit {proc.returncode}: " + " | ".join(tail)}
    return json.loads(lines[-1])


def finished_run(run_dir: Path, train_args: list[str]) -> bool:
    """Whether ``run_dir`` holds a finished run of what ``titans train *train_args`` trains (its report is
    then read, not trained again); False when it holds none. A finished run of other settings is refused:
    its numbers would be recorded under this call's steps, seed or options."""
    from titans.cli import build_parser
    from titans.training.cli import overrides_from_args
    from titans.training.config import TrainConfig
    from titans.training.trainer import CONFIG_FILE, REPORT_FILE

    if not (Path(run_dir) / REPORT_FILE).is_file():
        return False
    # a run a signal stopped wrote its report at the step it reached: it is not finished (trained again)
    if json.loads((Path(run_dir) / REPORT_FILE).read_text()).get("stopped_by") is not None:
        return False
    args = build_parser().parse_args(["train", *train_args])
    want = TrainConfig.from_file(args.config, overrides_from_args(args)).to_dict()
    have = json.loads((Path(run_dir) / CONFIG_FILE).read_text())
    differ = sorted(k for k in want.keys() | have.keys() if want.get(k) != have.get(k))
    if differ:
        raise SystemExit(
            f"{run_dir} holds a finished run with other settings ({', '.join(differ)}): delete it, or give "
            "another --out-dir"
        )
    return True


def reply(result: dict) -> None:
    """A worker's answer to `run_worker`: its result as one JSON line on stdout."""
    print(json.dumps(result), flush=True)


# ------------------------------------------------------------------------------------------ timing
class Timer:
    """Seconds of one interval: `with Timer() as t: ...`, then `t.wall`, `t.cpu` (process CPU time, all
    threads: with one thread on a shared machine, what the interval takes on a core of its own) and
    `t.sys` (the kernel's share of it: mostly page faults, when the work touches memory it has not used
    before). `sync`, if given, runs before each reading (e.g. `torch.cuda.synchronize`). `elapsed()` reads
    the wall time so far without leaving the block."""

    def __init__(self, sync: Callable[[], object] | None = None):
        self.sync = sync
        self.wall = self.cpu = self.sys = 0.0

    @classmethod
    def started(cls, sync: Callable[[], object] | None = None) -> Timer:
        """A clock already running, for `elapsed()` readings across a whole benchmark."""
        return cls(sync).__enter__()

    def __enter__(self) -> Timer:
        if self.sync is not None:
            self.sync()
        self._start = (time.perf_counter(), time.process_time(), os.times().system)
        return self

    def elapsed(self) -> float:
        return time.perf_counter() - self._start[0]

    def __exit__(self, *exc) -> None:
        if self.sync is not None:
            self.sync()
        wall, cpu, sys_ = self._start
        self.wall = time.perf_counter() - wall
        self.cpu = time.process_time() - cpu
        self.sys = os.times().system - sys_


def time_runs(
    fn: Callable[[], object],
    reps: int,
    warmup: int = 1,
    cpu_times: list[float] | None = None,
    sys_times: list[float] | None = None,
    sync: Callable[[], object] | None = None,
) -> list[float]:
    """Wall-clock seconds of `reps` calls of fn after `warmup` untimed ones.

    cpu_times / sys_times, if given, receive each call's process CPU time and its kernel share (`Timer`).
    """
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        with Timer(sync) as t:
            fn()
        times.append(t.wall)
        if cpu_times is not None:
            cpu_times.append(t.cpu)
        if sys_times is not None:
            sys_times.append(t.sys)
    return times


def time_alternating(
    calls: dict[str, Callable[[], object]], reps: int, warmup: int = 0
) -> dict[str, list[float]]:
    """Wall-clock seconds of `reps` calls of each function, taking turns repetition by repetition (the
    machine's load falls on all of them alike), after `warmup` untimed rounds."""
    times = {name: [] for name in calls}
    for rep in range(warmup + reps):
        for name, fn in calls.items():
            with Timer() as clock:
                fn()
            if rep >= warmup:
                times[name].append(clock.wall)
    return times


def time_cuda(fn: Callable[[], object], reps: int, warmup: int = 2) -> list[float]:
    """Seconds of `reps` calls of fn on the current CUDA device, read with CUDA events (the GPU's own clock:
    host-side gaps between calls are not counted), after `warmup` untimed calls."""
    import torch

    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return times


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def timing_summary(times: list[float]) -> dict:
    """Median, min, max and spread ((max - min) / median) of a list of seconds."""
    if not times:
        return {
            "n": 0,
            "median_s": float("nan"),
            "min_s": float("nan"),
            "max_s": float("nan"),
            "spread": None,
        }
    mid = statistics.median(times)
    spread = (max(times) - min(times)) / mid if mid > 0 else None
    return {"n": len(times), "median_s": mid, "min_s": min(times), "max_s": max(times), "spread": spread}


# ------------------------------------------------------------------------------------------ memory
def peak_rss_bytes() -> int:
    """Peak resident set size of this process so far (ru_maxrss is KiB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def current_rss_bytes() -> int:
    """Resident set size of this process now (Linux: /proc/self/statm; elsewhere the peak so far)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return peak_rss_bytes()


def peak_rss_gib() -> float:
    return peak_rss_bytes() / 2**30


def peak_rss_mib() -> float:
    return peak_rss_bytes() / 2**20


def current_rss_gib() -> float:
    return current_rss_bytes() / 2**30


def current_rss_mib() -> float:
    return current_rss_bytes() / 2**20


# ------------------------------------------------------------------------------------------ workloads
def random_pieces(n: int, vocab: int, piece: int, seed: int):
    """n random token ids as (1, <= piece) tensors, generated piece by piece (a long stream never exists)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    for start in range(0, n, piece):
        yield torch.randint(0, vocab, (1, min(piece, n - start)), generator=gen)


def matmul_gflops(n: int = 4096, reps: int = 5) -> dict:
    """fp32 (n x n) @ (n x n) rate with the current torch thread count: the practical peak to compare to."""
    import torch

    a, b = torch.randn(n, n), torch.randn(n, n)
    cpu = []
    times = time_runs(lambda: a @ b, reps, warmup=2, cpu_times=cpu)
    rates = [2 * n**3 / t / 1e9 for t in times]
    # per CPU-second of all threads: with one thread, the rate of a core of its own
    cpu_rate = statistics.median(2 * n**3 / t / 1e9 for t in cpu)
    return {
        "n": n,
        "gflops_median": statistics.median(rates),
        "gflops_max": max(rates),
        "gflops_cpu": cpu_rate,
    }


# ------------------------------------------------------------------------------------------ FLOP counts
def fast_path_flops_per_token(head_dim: int, hidden: int, heads: int, depth: int = 2) -> dict:
    """Matmul FLOPs per token of `neural_memory_chunked` (independent of the chunk size).

    Per chunk of n tokens and per head, with P_l = d_in * d_out of layer l and L = depth:
      forward:  reads of keys+queries 4nP_l, inner backprop e = delta W^T 2nP_l (l >= 1), the two
                weighted gradient sums a^T(gamma delta), a^T(beta delta) 4nP_l;
      backward: dL/dG and dL/da of those sums 4nP_l each, the weight gradient (2n + n[l >= 1]) 2P_l,
                dL/dh of the reads 4nP_l, the inner backprop 2nP_l (l >= 1).
    """
    sizes = [head_dim] + [hidden] * (depth - 1) + [head_dim]
    fwd = bwd = 0
    for layer in range(depth):
        p = sizes[layer] * sizes[layer + 1]
        inner = 1 if layer > 0 else 0
        fwd += 4 * p + 2 * p * inner + 4 * p
        bwd += 4 * p + 4 * p + 2 * p * (2 + inner) + 4 * p + 2 * p * inner
    return {"forward": fwd * heads, "backward": bwd * heads, "total": (fwd + bwd) * heads}


def projection_flops_per_token(dim: int, heads: int, head_dim: int) -> dict:
    """The NeuralMemory layer's own linear maps (q/k/v, gates, output gate, output), forward and backward."""
    inner = heads * head_dim
    fwd = 2 * dim * 3 * inner + 2 * dim * 3 * heads + 2 * dim * inner + 2 * inner * dim
    return {"forward": fwd, "backward": 2 * fwd, "total": 3 * fwd}


# ------------------------------------------------------------------------------------------ machine
def machine_info() -> dict:
    """What the numbers were measured on: CPU model, logical CPUs, torch threads, memory, torch and Python
    versions, the GPU (name and CUDA version; None without one) and the load average now."""
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name"))
    except (OSError, StopIteration):
        pass
    mem = None
    try:
        with open("/proc/meminfo") as f:
            mem = round(int(f.readline().split()[1]) / 2**20, 1)
    except OSError:
        pass
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    return {
        "cpu": cpu,
        "logical_cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "memory_gib": mem,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "gpu": gpu,
        "cuda": torch.version.cuda if gpu else None,
        "loadavg_start": os.getloadavg(),
    }


def describe(machine: dict) -> str:
    """One line of a machine description, for a benchmark's header."""
    where = f"{machine['cpu']}, {machine['logical_cpus']} CPUs, torch {machine['torch']}"
    if machine.get("gpu"):
        where += f", {machine['gpu']}"
    return where + f", load {machine['loadavg_start']}"


# ------------------------------------------------------------------------------------------ results
def result_path(target: str | Path) -> Path:
    """Where `save_json` writes: benchmarks/results/<target>.json for a bare name, target itself for a path
    (one with a folder or a .json suffix)."""
    text = str(target)
    if "/" in text or os.sep in text or text.endswith(".json"):
        return Path(target)
    return RESULTS / f"{text}.json"


def save_json(target: str | Path, payload: dict, machine: dict | None = None) -> Path:
    """Write one result file (`result_path(target)`): the command line that ran, the machine description
    (payload["machine"], else `machine`, else `machine_info()` now) with the load average at the end, and
    the payload's results. Returns the path written."""
    payload = dict(payload)
    machine = dict(payload.pop("machine", None) or machine or machine_info())
    machine["loadavg_end"] = os.getloadavg()
    record = {"command": shlex.join(["python", *sys.argv]), "machine": machine, **payload}
    path = result_path(target)
    write_text_atomic(path, json.dumps(record, indent=2) + "\n")  # whole or not at all (a full disk)
    return path


def print_table(rows: list[dict], columns: list[tuple[str, str]]) -> None:
    """columns: (key, header). Floats are shown with sensible precision; missing values as '-'."""

    def fmt(v):
        if v is None:
            return "-"
        if isinstance(v, float):
            return f"{v:.3g}" if abs(v) < 100 else f"{v:,.0f}"
        return str(v)

    cells = [[fmt(r.get(k)) for k, _ in columns] for r in rows]
    widths = [max(len(h), *(len(c[i]) for c in cells)) for i, (_, h) in enumerate(columns)]
    print("  ".join(h.ljust(w) for (_, h), w in zip(columns, widths)))
    print("  ".join("-" * w for w in widths))
    for c in cells:
        print("  ".join(v.ljust(w) for v, w in zip(c, widths)))
