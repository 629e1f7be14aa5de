"""Human-readable summaries of training runs: one run's report and a comparison table of several."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from titans.runtime.checkpoint import CHECKPOINTS
from titans.runtime.loading import TOKENIZER_DIR
from titans.training.metrics import METRICS_FILE, PLOT_FILE, TENSORBOARD_DIR
from titans.training.trainer import CONFIG_FILE, REPORT_FILE, TrainResult

# What a run folder holds, in the order the report names them: (name, what it is).
RUN_FILES = (
    (REPORT_FILE, "this summary as JSON (config, steps, losses, held-out bpb, sample)"),
    (METRICS_FILE, "JSON lines: train loss, lr, grad norm, tokens/s; held-out loss, bpb; memory stats"),
    (PLOT_FILE, "loss, held-out bits per byte and learning rate vs step"),
    (TENSORBOARD_DIR + "/", "TensorBoard logs (tensorboard --logdir)"),
    (
        CHECKPOINTS + "/",
        "the newest checkpoints (weights, optimizer, data position): --resume, eval, generate",
    ),
    (CONFIG_FILE, "the TrainConfig of the run"),
    (TOKENIZER_DIR + "/", "a copy of the tokenizer file (a file tokenizer only)"),
)


def _fmt(v: float | None, spec: str) -> str:
    return format(v, spec) if v is not None else "n/a"


def format_report(
    result: TrainResult, title: str, run_dir: str | Path | None = None, resumed: bool = False
) -> str:
    """A short block of text: steps, tokens, throughput, losses, held-out bpb, the sample and, given
    ``run_dir``, what the run wrote there and how to continue a run its time budget stopped."""
    ev = result.eval
    stopped = result.stopped_early and result.step < result.total_steps
    lines = [
        f"== {title}",
        f"parameters      {result.num_parameters:,}",
        f"steps           {result.step:,} / {result.total_steps:,}"
        + (f"  (stopped by {result.stopped_by})" if result.stopped_by else "")
        + ("  (stopped by the time budget)" if stopped and not result.stopped_by else ""),
        f"tokens          {result.tokens:,}",
        f"throughput      {result.tokens_per_s:,.0f} tokens/s "
        f"({result.train_time_s / 60:.1f} min of training)",
        f"train loss      {_fmt(result.train_loss, '.4f')}",
    ]
    if ev is not None:
        lines.append(
            f"held-out        loss {ev.loss:.4f}  ppl {ev.ppl:.3f}  bpb {_fmt(ev.bpb, '.4f')}  "
            f"({ev.windows} windows x {ev.seq_len} tokens)"
        )
    if result.checkpoint:
        lines.append(f"checkpoint      {result.checkpoint}")
    if run_dir is not None:
        lines.append(f"wrote to        {run_dir}/")
        for name, what in RUN_FILES:
            if (Path(run_dir) / name.rstrip("/")).exists():
                lines.append(f"  {name:<15}{what}")
    if stopped:
        again = "the same command" if resumed else "the same command with --resume"
        lines.append(f"continue        {again} trains on from step {result.step:,}")
    if result.sample is not None:
        lines += ["sample:", "-" * 60, result.sample, "-" * 60]
    return "\n".join(lines)


def read_report(run_dir: str | Path) -> dict[str, Any]:
    path = Path(run_dir) / REPORT_FILE
    if not path.is_file():
        raise FileNotFoundError(f"no {REPORT_FILE} in {str(run_dir)!r}: has the run finished?")
    return json.loads(path.read_text())


def compare_table(run_dirs: list[str | Path]) -> str:
    """A fixed-width table (variant, parameters, steps, tokens/s, train loss, held-out loss and bpb)."""
    header = (
        f"{'variant':<12} {'params':>10} {'steps':>7} {'tok/s':>9} {'train':>8} {'held-out':>9} {'bpb':>7}"
    )
    rows = [header, "-" * len(header)]
    for run_dir in run_dirs:
        r = read_report(run_dir)
        ev = r.get("eval") or {}
        train, loss, bpb = (
            _fmt(r.get("train_loss"), ".4f"),
            _fmt(ev.get("loss"), ".4f"),
            _fmt(ev.get("bpb"), ".4f"),
        )
        rows.append(
            f"{r['config']['variant']:<12} {r['num_parameters']:>10,} {r['step']:>7,} "
            f"{r['tokens_per_s']:>9,.0f} {train:>8} {loss:>9} {bpb:>7}"
        )
    return "\n".join(rows)
