"""The GPU checklist in one command, one JSON: the CUDA tests, the memory op alone, whole-model training
throughput of every variant at 2K and 8K, and decode speed, on whatever CUDA device is at hand.

    python benchmarks/gpu_suite.py
        [--parts tests,op,train2k,train8k,trainer,decode,profile,rows,batch,slowtests] [--budget 1200]
        [--cap train2k=300,...] [--out gpu_suite_h200]

Parts, in this order, each its own process with a time cap (`--cap`, seconds), cut to what is left of
`--budget`; a part cut short keeps the rows it measured (the benchmarks print each row as it is measured),
and its entry says it was cut:
- tests: `pytest -m cuda` over the test files with CUDA checks (the compiled kernels against the float64
  reference at the presets' sizes, the backward kernel never falling back there; CUDA-graph training and
  decoding equal to eager).
- op: `memory_kernels.py`, the memory op alone, Triton kernels against the torch chunk loop, depth 1 (64)
  and depth 2 (hidden 128), 2K and 8K, forward and forward + backward.
- train2k / train8k: `gpu_throughput.py` rows, 170M preset, batch 4, bf16 autocast, in the order the goals
  need them (Transformer++, then MAC and the LMM with kernels, compiled blocks and graphs, then the other
  variants and modes);
  at 8K MAC also with the memory's backward checkpointed every 4 chunks (mode "c4"), which fits in 80 GB, and
  with its blocks recomputed in the backward pass (mode "recompute": activation checkpointing).
- trainer: `titans train` as a user runs it on a GPU, a 170M MAC at 4 x 2048 for 12 steps with
  `--compile --cuda-graphs` (`TRAINER_ARGS`), its held-out evaluation and sample: the run's exit code and
  its metrics rows (each step's loss, gradient norm and tokens/s; the first step's time is the compile's),
  and, with `train2k` in the same call, its steps' tokens/s over the benchmark's row for the same model and
  mode (`trainer_vs_benchmark`, ~1 when the trainer runs what the benchmark times).
- decode: `decode_graph.py --device cuda`, MAC tiny and 170M, batch 1: the eager step against the step
  replayed as a CUDA graph.
- profile: one step at 2K under the torch profiler, of MAC with the kernels (eager and replayed) and of
  Transformer++ replayed: kernels launched, the GPU's busy time against the step's, and (eager) the ops
  whose kernels take most of it.
- rows: the depth-2 backward kernel's row block (`TITANS_MEMORY_TRITON_ROWS` 16 and 64; 32 is `op`'s).
- batch: the depth-2 op at 2K with batch 4 and 11 (`BATCHES`: 48 and 132 programs of one sequence-head
  each, against an H100's 132 multiprocessors): how far the kernels' time per call grows with the programs
  (flat: the chip was idle beside them).
- slowtests: the one CUDA test `tests` leaves out, whose kernels take minutes to compile (`SLOW_TEST`).

The summary at the end sets the goals against the measured rows: MAC >= 0.6x and LMM >= 0.8x
Transformer++'s training tokens/s at 2K, MAC >= 1x at 8K (each model in its fastest measured mode).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

from bench_utils import Timer, machine_info, result_path, save_json

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent

TEST_FILES = [
    "tests/test_memory_triton.py",
    "tests/test_memory.py",
    "tests/test_models.py",
    "tests/test_attention.py",
    "tests/test_cuda_graphs.py",
    "tests/test_decode_graph.py",
]
# (seq, variant, mode[, memory_checkpoint_every]) in the order the goals need them: a part cut short has
# measured the first ones. MAC at 4 x 8192 with the kernels needs 83 GB; checkpointed every 4 chunks, 76 GB
TRAIN_ROWS = {
    2048: [
        "transformer:graphs", "mac:kernels+compile+graphs", "transformer:compile+graphs",
        "mac:kernels+graphs", "lmm:kernels+compile+graphs", "lmm:kernels+graphs", "mac:kernels+compile",
        "mag:kernels+compile+graphs", "mal:kernels+compile+graphs", "transformer:eager", "mag:kernels+graphs",
        "mal:kernels+graphs", "swa:graphs", "mac:kernels", "lmm:kernels", "mac:graphs", "lmm:graphs",
        "mag:kernels", "mal:kernels", "mac:eager", "lmm:eager", "swa:eager", "mag:graphs", "mal:graphs",
        "mag:eager", "mal:eager",
    ],
    8192: [
        "transformer:graphs", "mac:kernels+compile+graphs:4", "mac:kernels+compile+graphs+recompute",
        "mac:kernels+graphs:4", "lmm:kernels+graphs",
        "transformer:compile+graphs", "mac:kernels+graphs", "transformer:eager", "mac:kernels", "lmm:kernels",
        "mag:kernels+graphs", "mal:kernels+graphs", "swa:graphs",
    ],
}  # fmt: skip
# `titans train` end to end: compiled blocks replayed as CUDA graphs, evaluated (8 windows) and sampled
TRAINER_ARGS = [
    "--preset", "170M", "--variant", "mac", "--seq-len", "2048", "--batch-size", "4", "--steps", "12",
    "--compile", "--cuda-graphs", "--device", "cuda", "--no-progress",
    "--set", "log_every=1", "--set", "eval_windows=8", "--set", "sample_tokens=32",
]  # fmt: skip
# the one CUDA test whose kernels take minutes to compile (float32 matmuls on a 128 x 256 state): last
SLOW_TEST = (
    "tests/test_memory_triton.py::test_compiled_kernel_matches_reference_on_cuda[2-shape3-options3-False]"
)
CAPS = {
    "tests": 240, "op": 150, "train2k": 360, "train8k": 180, "trainer": 360, "decode": 90, "profile": 60,
    "rows": 60, "batch": 90, "slowtests": 120,
}  # fmt: skip
BATCHES = (4, 11)  # 12 heads each: 48 and 132 programs


def _run(name: str, cmd: list[str], cap: float, log: Path, env: dict | None = None) -> dict:
    """Run `cmd` for at most `cap` seconds (its whole process group killed past that), its output appended
    to `log`; returns the part's entry: command, seconds, exit code, whether it was cut, and every line of
    output that is a JSON object (the benchmarks' rows)."""
    clock = Timer.started()
    part_log = Path(tempfile.mkstemp(suffix=".log")[1])
    base = {"PYTHONPATH": f"{ROOT / 'src'}:{HERE}", "PYTHONUNBUFFERED": "1", "TRITON_INTERPRET": "0"}
    env = {**os.environ, **base, **(env or {})}
    with part_log.open("w") as f:  # a file, not a pipe: a chatty part never blocks on a full pipe
        proc = subprocess.Popen(
            cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, text=True,
            env=env,
            start_new_session=True,
        )  # fmt: skip
        cut = False
        try:
            proc.wait(timeout=max(1.0, cap))
        except subprocess.TimeoutExpired:
            cut = True
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    out = part_log.read_text(errors="replace")
    part_log.unlink()
    with log.open("a") as f:
        f.write(f"\n===== {name}: {' '.join(cmd)} (cap {cap:.0f} s)\n{out}")
    rows = []
    for line in out.splitlines():
        if line.startswith("{"):
            with contextlib.suppress(json.JSONDecodeError):
                rows.append(json.loads(line))
    seconds = clock.elapsed()
    print(f"{name}: {seconds:.0f} s, exit {proc.returncode}{' (cut at its cap)' if cut else ''}", flush=True)
    return {
        "command": " ".join(cmd),
        "seconds": round(seconds, 1),
        "returncode": proc.returncode,
        "cut": cut,
        "rows": rows,
        "tail": out[-3000:] if proc.returncode else out[-600:],
    }


def _junit(path: Path) -> dict:
    """Counts and failures from pytest's JUnit XML."""
    if not path.exists():
        return {"error": "no report (pytest did not finish)"}
    cases = ET.parse(path).getroot().iter("testcase")
    out = {"passed": [], "failed": [], "skipped": []}
    for case in cases:
        name = f"{case.get('classname')}::{case.get('name')}"
        bad = case.find("failure") if case.find("failure") is not None else case.find("error")
        if bad is not None:
            out["failed"].append({"test": name, "message": (bad.get("message") or "")[:300]})
        elif case.find("skipped") is not None:
            out["skipped"].append({"test": name, "reason": (case.find("skipped").get("message") or "")[:120]})
        else:
            out["passed"].append(name)
    return out


# the benchmark row that times what `titans train` runs with TRAINER_ARGS
TRAINER_ROW = "mac:kernels+compile+graphs"


def _trainer_vs_benchmark(parts: dict) -> float | None:
    """tokens/s of `titans train`'s steps (the median of those after the first, which compiles) over the
    train2k part's TRAINER_ROW, where both were measured: ~1 when the trainer runs what the benchmark
    times."""
    steps = [r["tokens_per_s"] for r in parts.get("trainer", {}).get("rows", []) if r.get("split") == "train"]
    variant, mode = TRAINER_ROW.split(":")
    bench = [r["tokens_per_s"] for r in parts.get("train2k", {}).get("rows", [])
             if r.get("variant") == variant and r.get("mode") == mode and "tokens_per_s" in r]  # fmt: skip
    if len(steps) < 2 or not bench:
        return None
    return statistics.median(steps[1:]) / bench[0]


def _goals(parts: dict) -> list[dict]:
    """Each model's best tokens/s per sequence length over the measured modes, against Transformer++. A row
    whose weights came out of its steps not finite (`weights_finite: False`) does not count: its speed is not
    that of training."""
    best: dict[tuple[int, str], tuple[float, str]] = {}
    for key in ("train2k", "train8k"):
        for r in parts.get(key, {}).get("rows", []):
            if "tokens_per_s" in r and r.get("weights_finite", True):
                k = (r["seq"], r["variant"])
                if r["tokens_per_s"] > best.get(k, (0.0, ""))[0]:
                    best[k] = (r["tokens_per_s"], r["mode"])
    goals = []
    for seq, variant, target in ((2048, "mac", 0.6), (2048, "lmm", 0.8), (8192, "mac", 1.0)):
        ours, ref = best.get((seq, variant)), best.get((seq, "transformer"))
        ratio = ours[0] / ref[0] if ours and ref else None
        goals.append({
            "seq": seq, "variant": variant, "target_vs_transformer": target,
            "tokens_per_s": ours and ours[0], "mode": ours and ours[1],
            "transformer_tokens_per_s": ref and ref[0], "transformer_mode": ref and ref[1],
            "ratio": ratio, "met": ratio is not None and ratio >= target,
        })  # fmt: skip
    return goals


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--parts", default="tests,op,train2k,train8k,trainer,decode,profile,rows,batch,slowtests")
    p.add_argument("--budget", type=float, default=1200, help="seconds for all parts together")
    p.add_argument("--cap", default="", help="part=seconds,... overriding the parts' own caps")
    p.add_argument("--steps", type=int, default=5, help="timed steps per training row")
    p.add_argument("--out", default="gpu_suite", help="the JSON: a path, or a name in benchmarks/results/")
    p.add_argument("--log", default=None, help="the parts' output (default: beside the JSON, .log)")
    args = p.parse_args()
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("gpu_suite.py: needs a CUDA device")
    caps = dict(CAPS)
    for item in filter(None, args.cap.split(",")):
        name, seconds = item.split("=")
        caps[name] = float(seconds)
    out = result_path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    log = Path(args.log) if args.log else out.with_suffix(".log")
    log.write_text("")
    work = Path(tempfile.mkdtemp(prefix="gpu_suite_"))  # the parts' own files: their rows go into the JSON
    machine = machine_info()
    py = sys.executable
    clock = Timer.started()
    parts: dict[str, dict] = {}

    def left() -> float:
        return args.budget - clock.elapsed()

    def save() -> Path:
        payload = {"device": machine["gpu"], "args": vars(args), "parts": parts, "goals": _goals(parts),
                   "trainer_vs_benchmark": _trainer_vs_benchmark(parts)}  # fmt: skip
        return save_json(out, payload, machine)

    for name in args.parts.split(","):
        cap = min(caps[name], left())
        if cap < 10:
            parts[name] = {"skipped": "no budget left"}
            continue
        if name in ("tests", "slowtests"):
            junit = work / f"{name}.xml"
            which = ["--deselect", SLOW_TEST, *TEST_FILES] if name == "tests" else [SLOW_TEST]
            # workers in parallel where pytest-xdist is installed: the kernels' compiles take most of the time
            workers = ["-n", "8"] if name == "tests" and importlib.util.find_spec("xdist") else []
            cmd = [py, "-m", "pytest", "-m", "cuda", "-q", "-rfE", "-p", "no:cacheprovider", *workers,
                   f"--junitxml={junit}", *which]  # fmt: skip
            parts[name] = _run(name, cmd, cap, log)
            parts[name]["tests"] = _junit(junit)
        elif name == "op":
            cmd = [py, str(HERE / "memory_kernels.py"), "--cases", "2:128,1:64", "--seqs", "2048,8192",
                   "--out", str(work / "op.json")]  # fmt: skip
            parts[name] = _run(name, cmd, cap, log)
        elif name in ("train2k", "train8k"):
            seq = 2048 if name == "train2k" else 8192
            rows = ",".join(f"{seq}:{r}" for r in TRAIN_ROWS[seq])
            cmd = [py, str(HERE / "gpu_throughput.py"), "--rows", rows, "--steps", str(args.steps),
                   "--out", str(work / f"{name}.json")]  # fmt: skip
            parts[name] = _run(name, cmd, cap, log)
        elif name == "trainer":
            run_dir = work / "trainer"
            cmd = [py, "-m", "titans.cli", "train", *TRAINER_ARGS, "--run-dir", str(run_dir)]
            parts[name] = _run(name, cmd, cap, log)
            metrics = run_dir / "metrics.jsonl"
            if metrics.exists():  # the training and evaluation rows (not the memory monitor's)
                rows = map(json.loads, metrics.read_text().splitlines())
                parts[name]["rows"] = [r for r in rows if r.get("split") in ("train", "eval")]
        elif name == "decode":
            rows = []
            for preset in ("tiny", "170M"):
                cmd = [py, str(HERE / "decode_graph.py"), "--device", "cuda", "--preset", preset,
                       "--paths", "eager,cuda_graph", "--steps", "128", "--threads", "4",
                       "--json", str(work / f"decode_{preset}.json")]  # fmt: skip
                rows.append(_run(f"decode {preset}", cmd, min(cap / 2, left()), log))
                path = work / f"decode_{preset}.json"
                if path.exists():
                    rows[-1]["rows"] = json.loads(path.read_text())["rows"]
            parts[name] = {"runs": rows}
        elif name == "profile":
            rows = "2048:mac:kernels,2048:mac:kernels+graphs,2048:transformer:graphs"
            cmd = [py, str(HERE / "gpu_throughput.py"), "--rows", rows, "--steps", "2", "--profile", "15",
                   "--out", str(work / "profile.json")]  # fmt: skip
            parts[name] = _run(name, cmd, cap, log)
        elif name == "rows":
            runs = []
            for block in (16, 64):
                cmd = [py, str(HERE / "memory_kernels.py"), "--cases", "2:128", "--seqs", "2048",
                       "--out", str(work / f"rows{block}.json")]  # fmt: skip
                env = {"TITANS_MEMORY_TRITON_ROWS": str(block)}
                runs.append({"rows": block, **_run(f"rows {block}", cmd, min(cap / 2, left()), log, env)})
            parts[name] = {"runs": runs}
        elif name == "batch":
            runs = []
            for batch in BATCHES:
                cmd = [py, str(HERE / "memory_kernels.py"), "--cases", "2:128", "--seqs", "2048",
                       "--batch", str(batch), "--out", str(work / f"batch{batch}.json")]  # fmt: skip
                runs.append({"batch": batch, **_run(f"batch {batch}", cmd, min(cap / 2, left()), log)})
            parts[name] = {"runs": runs}
        else:
            raise SystemExit(f"gpu_suite.py: unknown part {name!r}")
        save()  # after every part: a suite stopped from outside keeps what it measured

    path = save()
    print(f"\n{machine['gpu']}: {clock.elapsed():.0f} s in all")
    for key in ("tests", "slowtests"):
        tests = parts.get(key, {}).get("tests", {})
        if "passed" in tests:
            print(f"cuda {key}: {len(tests['passed'])} passed, {len(tests['failed'])} failed, "
                  f"{len(tests['skipped'])} skipped")  # fmt: skip
            for f in tests["failed"]:
                print(f"  FAILED {f['test']}: {f['message'][:160]}")
    for r in parts.get("op", {}).get("rows", []):
        print(f"op depth {r['depth']} seq {r['seq']}: fwd {r['speedup_fwd']:.1f}x, fwd+bwd "
              f"{r['speedup_fwd_bwd']:.1f}x the torch loop, backward {r['triton_backward']}, "
              f"rel diff y {r['rel_diff_y']:.1e} grads {r['rel_diff_grads']:.1e}")  # fmt: skip
    print(f"{'seq':>6} {'variant':<12}{'mode':<16}{'step ms':>9}{'tok/s':>10}{'GiB':>7}  weights")
    for key in ("train2k", "train8k"):
        for r in parts.get(key, {}).get("rows", []):
            if "tokens_per_s" in r:
                mode = r["mode"] + (
                    f" c{r['memory_checkpoint_every']}" if r.get("memory_checkpoint_every") else ""
                )
                finite = "finite" if r.get("weights_finite", True) else "NOT finite: not in the goals"
                print(f"{r['seq']:>6} {r['variant']:<12}{mode:<16}{r['step_s'] * 1e3:>9.1f}"
                      f"{r['tokens_per_s']:>10,.0f}{r['peak_reserved_gib']:>7.1f}  {finite}")  # fmt: skip
            else:
                print(f"{' '.join(r.get('args', [])):<34} {r.get('error', '')[:80]}")
    trainer = parts.get("trainer", {})
    if "returncode" in trainer:
        steps = [r for r in trainer["rows"] if r["split"] == "train"]
        rates = ", ".join(f"{r['tokens_per_s']:,.0f}" for r in steps)
        print(f"titans train --compile --cuda-graphs: exit {trainer['returncode']}, {len(steps)} steps "
              f"logged, tok/s by step: {rates or 'none'}")  # fmt: skip
        ratio = _trainer_vs_benchmark(parts)
        if ratio is not None:
            print(f"titans train's steps after the first / the benchmark's {TRAINER_ROW}: {ratio:.2f}x tok/s")
    for run in parts.get("batch", {}).get("runs", []):
        for r in run.get("rows", []):
            print(f"op depth 2 at 2K, batch {r['batch']} ({r['batch'] * r['heads']} programs): kernels fwd "
                  f"{r['triton_fwd_ms']:.2f} ms, fwd+bwd {r['triton_fwd_bwd_ms']:.2f} ms")  # fmt: skip
    for g in _goals(parts):
        ratio = f"{g['ratio']:.2f}x" if g["ratio"] is not None else "not measured"
        print(
            f"goal {g['variant']} at {g['seq']} >= {g['target_vs_transformer']}x Transformer++: {ratio} "
            f"({g['mode']} vs {g['transformer_mode']}) {'met' if g['met'] else 'NOT met'}"
        )
    for run in parts.get("decode", {}).get("runs", []):
        for r in run.get("rows", []):
            print(
                f"decode: {run['command'].split('--preset ')[1].split()[0]} {r['path']}: "
                f"{r['ms_per_token']:.2f} ms/token"
            )
    for run in parts.get("rows", {}).get("runs", []):
        for r in run.get("rows", []):
            print(
                f"backward row block {run['rows']}: fwd+bwd {r['triton_fwd_bwd_ms']:.2f} ms "
                f"({r['triton_backward']})"
            )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
