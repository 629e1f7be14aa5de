"""Shared helpers of the benchmarks: isolated worker runs, timing, FLOP counts, tables.

Every measured configuration runs in a fresh subprocess (`run_worker`) so its peak RSS is its own and
one run's allocations, caches and threads cannot pollute the next.
"""

from __future__ import annotations

import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


# ------------------------------------------------------------------------------------------ processes
def run_worker(script: str, spec: dict, timeout: float = 1800) -> dict:
    """Run `python script --worker JSON` in a fresh interpreter; return the JSON dict it prints last.

    A worker that fails (e.g. killed for memory) yields {"error": ...} instead of stopping the benchmark.
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


def peak_rss_gib() -> float:
    """Peak resident set size of this process so far (Linux reports ru_maxrss in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def current_rss_gib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**30


def random_pieces(n: int, vocab: int, piece: int, seed: int):
    """n random token ids as (1, <= piece) tensors, generated piece by piece (a long stream never exists)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    for start in range(0, n, piece):
        yield torch.randint(0, vocab, (1, min(piece, n - start)), generator=gen)


def time_runs(
    fn, reps: int, warmup: int = 1, cpu_times: list[float] | None = None, sys_times: list[float] | None = None
) -> list[float]:
    """Wall-clock seconds of `reps` calls of fn after `warmup` untimed ones.

    cpu_times, if given, receives each call's process CPU time (all threads): on a shared machine, with
    one thread, it is what the call would take on a core of its own. sys_times, if given, receives the
    kernel's share of it (mostly page faults, when a call touches memory it has not used before).
    """
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start, cpu_start, sys_start = time.perf_counter(), time.process_time(), os.times().system
        fn()
        times.append(time.perf_counter() - start)
        if cpu_times is not None:
            cpu_times.append(time.process_time() - cpu_start)
        if sys_times is not None:
            sys_times.append(os.times().system - sys_start)
    return times


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


# ------------------------------------------------------------------------------------------ reporting
def machine_info() -> dict:
    import torch

    cpu = platform.processor()
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
    return {
        "cpu": cpu,
        "logical_cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "memory_gib": mem,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "loadavg_start": os.getloadavg(),
    }


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


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


def save_json(name: str, payload: dict) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    payload.setdefault("machine", {})["loadavg_end"] = os.getloadavg()
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(payload, indent=2) + "\n")
    return path
