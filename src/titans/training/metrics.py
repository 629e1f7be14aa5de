"""Training metrics: a JSONL log (always), TensorBoard (when installed) and a PNG of the loss curves.

``run_dir/metrics.jsonl`` holds one JSON object per line: ``{"split": "train" | "eval", "step": int, ...}``
(train: loss, lr, grad_norm, tokens, tokens_per_s; eval: loss, ppl, bpb). TensorBoard event files go to
``run_dir/tb`` when the ``tensorboard`` package is there (extra ``titans[train]``) and are skipped with a
note otherwise. ``plot_losses`` draws ``run_dir/loss.png`` from the JSONL with matplotlib (imported only
then; skipped with a note when missing).
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)
METRICS_FILE = "metrics.jsonl"
PLOT_FILE = "loss.png"


class MetricsLogger:
    """Writes metrics for one run; a no-op when ``enabled`` is false (ranks other than 0)."""

    def __init__(
        self, run_dir: str | Path, *, enabled: bool = True, tensorboard: bool = True, resume_step: int = 0
    ):
        """``resume_step``: a resumed run's step; TensorBoard drops events logged after it (as the JSONL
        does, see ``truncate_metrics``), so a resumed run shows each step once."""
        self.path = Path(run_dir) / METRICS_FILE
        self.enabled = enabled
        self._file = None
        self._tb = None
        if not enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 (closed in close())
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                log.info(
                    "tensorboard is not installed (pip install 'titans[train]'): skipping TensorBoard logs"
                )
            else:
                purge = resume_step + 1 if resume_step > 0 else None
                self._tb = SummaryWriter(log_dir=str(Path(run_dir) / "tb"), purge_step=purge)

    def log(self, split: str, step: int, **values: float) -> None:
        if not self.enabled:
            return
        row: dict[str, Any] = {"split": split, "step": int(step)}
        row.update({k: _plain(v) for k, v in values.items()})
        self._file.write(json.dumps(row) + "\n")
        self._file.flush()
        if self._tb is not None:
            for k, v in values.items():
                if isinstance(v, (int, float)) and math.isfinite(v):
                    self._tb.add_scalar(f"{split}/{k}", v, step)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None


def _plain(v: Any) -> Any:
    """JSON-safe scalar (NaN/inf become strings, which json would otherwise write as invalid tokens)."""
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    return v


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """The rows of a metrics JSONL file (a torn last line, from a kill mid-write, is skipped)."""
    rows = []
    path = Path(path)
    if not path.is_file():
        return rows
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


def truncate_metrics(path: str | Path, last_step: int) -> None:
    """Drop rows after ``last_step`` (written after the checkpoint a run resumes from), so a resumed run
    does not log the same steps twice."""
    path = Path(path)
    if not path.is_file():
        return
    keep = [r for r in read_metrics(path) if int(r.get("step", 0)) <= last_step]
    path.write_text("".join(json.dumps(r) + "\n" for r in keep), encoding="utf-8")


def plot_losses(metrics_path: str | Path, png_path: str | Path, title: str = "") -> Path | None:
    """Train and held-out loss vs step as a PNG; None (with a note) when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # no display needed
        import matplotlib.pyplot as plt
    except ImportError:
        log.warning("matplotlib is not installed (pip install 'titans[train]'): no loss plot")
        return None
    rows = read_metrics(metrics_path)
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=110)
    for split, style in (("train", dict(lw=1.0, alpha=0.8)), ("eval", dict(marker="o", lw=1.5))):
        pts = [(r["step"], r["loss"]) for r in rows if r.get("split") == split and _is_number(r.get("loss"))]
        if pts:
            xs, ys = zip(*pts)
            ax.plot(xs, ys, label="held-out" if split == "eval" else split, **style)
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats / token)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend()
    fig.tight_layout()
    png_path = Path(png_path)
    fig.savefig(png_path)
    plt.close(fig)
    return png_path


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and math.isfinite(v)
