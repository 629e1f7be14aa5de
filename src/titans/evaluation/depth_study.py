"""Memory depth study (paper Figures 7-8): L_M = 1..4, quality vs sequence length and throughput.

For each memory depth the same model (``--variant``, default the memory alone, LMM, as in the paper) is
trained as a language model with the project's ``Trainer`` (same data, seed, steps and schedule), then:

- quality: mean held-out next-token loss over windows of each ``--eval-lengths`` length (a longer window
  gives every token more context; a memory that uses it well keeps lowering the loss as windows grow);
- throughput: training tokens per second (forward + backward on random tokens) at each
  ``--throughput-lengths`` length, measured on fresh models of every depth timed in turn, the fastest of
  ``--throughput-repeats`` rounds each (robust to other jobs on a shared machine).
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path
from typing import Any

import torch

from titans.data.loader import EvalWindows
from titans.data.stream import load_token_streams
from titans.data.tokenizers import load_tokenizer
from titans.evaluation.args import (
    add_model_args,
    add_runtime_args,
    int_list,
    model_overrides,
    positive_int,
    positive_int_list,
    set_threads,
)
from titans.evaluation.lm_study import add_lm_args, lm_train_config, run_root
from titans.evaluation.reporting import write_study
from titans.evaluation.scoring import new_figure, render_table, save_figure
from titans.models import TitansConfig, TitansLM
from titans.models.variants import VARIANT_SPECS
from titans.training.perplexity import evaluate_perplexity
from titans.training.signals import exit_if_stopped
from titans.training.trainer import Trainer
from titans.validation import check_distinct


def _train_step_seconds(model: torch.nn.Module, seq_len: int, batch_size: int) -> float:
    """Seconds for one training step (forward, cross-entropy, backward) on random (batch, seq_len) tokens."""
    device = next(model.parameters()).device
    tokens = torch.randint(0, model.config.vocab_size, (batch_size, seq_len + 1), device=device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    logits, _ = model(tokens[:, :-1])
    loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
    loss.backward()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - t0
    model.zero_grad(set_to_none=True)
    return seconds


def measure_throughput(
    models: dict[Any, torch.nn.Module], seq_lens: list[int], batch_size: int, repeats: int = 3
) -> dict[Any, dict[str, float]]:
    """Training tokens/s of each model at each length: {key: {str(seq_len): tokens/s}}.

    The models are timed in turn, round after round (after one warm-up round), and each keeps its *fastest*
    step: on a machine shared with other jobs, load changes over time, so interleaving spreads it evenly
    over the models and the minimum is the least disturbed measurement.
    """
    best: dict[Any, dict[int, float]] = {key: {n: math.inf for n in seq_lens} for key in models}
    for model in models.values():
        model.train()
    for round_ in range(repeats + 1):
        for n in seq_lens:
            for key, model in models.items():
                seconds = _train_step_seconds(model, n, batch_size)
                if round_ > 0:
                    best[key][n] = min(best[key][n], seconds)
    return {key: {str(n): batch_size * n / t for n, t in times.items()} for key, times in best.items()}


def heldout_loss_by_length(model, heldout, lengths: list[int], windows: int, batch_size: int, device) -> dict:
    """{length: mean held-out loss over up to ``windows`` windows of that length} (``None`` where the
    held-out text is too short for even one window)."""
    out: dict[str, float | None] = {}
    for length in lengths:
        if len(heldout) < length + 1:
            out[str(length)] = None
            continue
        ev = EvalWindows(heldout, seq_len=length, num_windows=windows, batch_size=batch_size)
        out[str(length)] = evaluate_perplexity(model, ev, device=device).loss
    return out


def run_depth(args: argparse.Namespace, depth: int, root: Path, heldout) -> dict[str, Any]:
    overrides = {**args.base_overrides, "memory_depth": depth}
    record: dict[str, Any] = {"memory_depth": depth, "overrides": overrides}
    trainer = Trainer(lm_train_config(args, root / f"depth{depth}", overrides))
    result = trainer.train()
    exit_if_stopped(result.stopped_by, f"while L_M={depth} trained (step {result.step})")
    model = trainer.model
    record.update(
        vocab_size=model.config.vocab_size,
        parameters=model.num_parameters(),
        train_loss=result.train_loss,
        heldout_loss_at_train_length=result.eval.loss,
        lm_tokens_per_s=result.tokens_per_s,
    )
    record["heldout_loss"] = heldout_loss_by_length(
        model, heldout, args.eval_lengths, args.heldout_windows, args.eval_batch_size, args.device
    )
    losses = ", ".join(f"{k}: {'-' if v is None else f'{v:.3f}'}" for k, v in record["heldout_loss"].items())
    print(f"[L_M={depth}] held-out loss by length {{{losses}}}")
    return record


def format_rows(rows: list[dict], eval_lengths: list[int], throughput_lengths: list[int]) -> str:
    head = (
        ["L_M", "params"] + [f"loss@{n}" for n in eval_lengths] + [f"tok/s@{n}" for n in throughput_lengths]
    )
    lines = [head]
    for r in rows:
        losses = [r["heldout_loss"].get(str(n)) for n in eval_lengths]
        speeds = [r["tokens_per_s"].get(str(n)) for n in throughput_lengths]
        lines.append(
            [str(r["memory_depth"]), f"{r['parameters']:,}"]
            + ["-" if v is None else f"{v:.4f}" for v in losses]
            + [f"{v:,.0f}" for v in speeds]
        )
    return render_table(lines)


def plot_rows(rows: list[dict], png_path: Path, title: str) -> Path:
    """Left: held-out loss vs window length per depth (Figure 7); right: throughput vs length (Figure 8)."""
    fig = new_figure((10, 3.8))
    ax_loss, ax_speed = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
    for r in rows:
        label = f"L_M={r['memory_depth']}"
        points = sorted((int(k), v) for k, v in r["heldout_loss"].items() if v is not None)
        if points:
            ax_loss.plot(*zip(*points), marker="o", label=label)
        speeds = sorted((int(k), v) for k, v in r["tokens_per_s"].items())
        ax_speed.plot(*zip(*speeds), marker="o", label=label)
    for ax, ylabel in ((ax_loss, "held-out loss (nats/token)"), (ax_speed, "training tokens/s")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("sequence length")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title)
    return save_figure(fig, png_path)


def run_depth_study(args: argparse.Namespace) -> int:
    set_threads(args)
    if any(d < 1 for d in args.depths):
        raise ValueError(f"--depths must be >= 1, got {args.depths}")
    check_distinct("--depths", args.depths)  # the second trained into the first's run folder
    spec = VARIANT_SPECS.get(args.variant)
    if spec is not None and not spec.memory:  # every row would be the same model under another label
        raise ValueError(f"--variant {args.variant} has no memory, so no memory depth to vary")
    if args.lm_steps < 1:  # the study's losses are those of the trained LMs: there is no LM stage to skip
        raise ValueError(
            f"--lm-steps must be >= 1 (every depth is trained as a language model), got {args.lm_steps}"
        )
    args.base_overrides = model_overrides(args)
    heldout = load_token_streams(
        args.data, load_tokenizer(args.tokenizer), heldout_fraction=args.heldout_fraction
    ).heldout
    with run_root(args, "titans-depth-", [f"depth{d}" for d in args.depths]) as root:
        rows = [run_depth(args, d, root, heldout) for d in args.depths]
    models = {}
    for row in rows:  # fresh models of each depth, same seed, timed together
        torch.manual_seed(args.seed)
        config = TitansConfig.preset(
            args.preset, variant=args.variant, vocab_size=row["vocab_size"], **row["overrides"]
        )
        models[row["memory_depth"]] = TitansLM(config).to(args.device)
    speeds = measure_throughput(
        models, args.throughput_lengths, args.throughput_batch, args.throughput_repeats
    )
    for row in rows:
        row["tokens_per_s"] = speeds[row["memory_depth"]]
    title = f"memory depth, {args.variant} ({args.preset}), {args.lm_steps} LM steps at {args.seq_len} tokens"
    table = format_rows(rows, args.eval_lengths, args.throughput_lengths)
    write_study(args, "depth", f"depth_{args.variant}", rows, title, plot_rows, table)
    return 0


def add_parser(evals) -> None:
    p = evals.add_parser("depth", help="memory depth 1-4: loss vs length and throughput (Figures 7-8)")
    p.add_argument("--variant", default="lmm", help="variant whose memory depth is varied")
    p.add_argument("--depths", type=int_list, default=[1, 2, 3, 4], help="memory depths L_M")
    add_lm_args(
        p, heldout_windows=16, lm_steps_help="LM steps per depth (>= 1: every depth is trained as an LM)"
    )
    p.add_argument(
        "--eval-lengths",
        type=positive_int_list,
        default=[256, 512, 1024, 2048],
        help="held-out loss at these lengths",
    )
    p.add_argument(
        "--eval-batch-size", type=positive_int, default=4, help="held-out windows per forward pass"
    )
    p.add_argument(
        "--throughput-lengths",
        type=positive_int_list,
        default=[256, 1024, 4096],
        help="tokens/s at these lengths",
    )
    p.add_argument(
        "--throughput-batch", type=positive_int, default=2, help="sequences per throughput measurement"
    )
    p.add_argument(
        "--throughput-repeats", type=positive_int, default=3, help="timed repeats (the best is kept)"
    )
    add_model_args(p)
    add_runtime_args(p)
    p.set_defaults(func=run_depth_study)
