"""Training metrics: a JSONL log (always), TensorBoard (when installed) and a PNG of the loss curves.

``run_dir/metrics.jsonl`` holds one JSON object per line: ``{"split": "train" | "eval", "step": int, ...}``
(train: loss, lr, grad_norm, tokens, tokens_per_s; eval: loss, ppl, bpb). TensorBoard event files go to
``run_dir/tb`` when the ``tensorboard`` package is there (extra ``titans[train]``) and are skipped with a
note otherwise. ``plot_losses`` draws ``run_dir/loss.png`` from the JSONL with matplotlib (imported only
then; skipped with a note when missing): the losses, held-out bits per byte and the learning rate.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import math
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from titans._fs import write_bytes_atomic, write_text_atomic

log = logging.getLogger(__name__)
METRICS_FILE = "metrics.jsonl"
PLOT_FILE = "loss.png"
TENSORBOARD_DIR = "tb"
_hooked = False


def _quiet_tensorboard_write_errors() -> None:
    """TensorBoard writes its events from a thread of its own: an OSError there (a full disk) was printed
    as the thread's traceback, then raised again, without a file name, by the next write. Threading's hook
    lets that one thread's OSError pass quietly; ``MetricsLogger`` raises it once, naming the folder."""
    global _hooked
    if _hooked:
        return
    previous = threading.excepthook

    def hook(args: threading.ExceptHookArgs) -> None:
        if type(args.thread).__name__ == "_AsyncWriterThread" and isinstance(args.exc_value, OSError):
            return
        previous(args)

    threading.excepthook = hook
    _hooked = True


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
                # from scratch (step 0) too: an attempt killed before its first checkpoint left events
                purge = resume_step + 1 if resume_step > 0 else 0
                self._tb_dir = Path(run_dir) / TENSORBOARD_DIR
                _quiet_tensorboard_write_errors()
                with self._naming(self._tb_dir):
                    self._tb = SummaryWriter(log_dir=str(self._tb_dir), purge_step=purge)

    def log(self, split: str, step: int, **values: float) -> None:
        if not self.enabled:
            return
        row: dict[str, Any] = {"split": split, "step": int(step)}
        row.update({k: _plain(v) for k, v in values.items()})
        with self._naming(self.path):
            self._file.write(json.dumps(row) + "\n")
            self._file.flush()
        if self._tb is not None:
            with self._naming(self._tb_dir):
                for k, v in values.items():
                    if isinstance(v, (int, float)) and math.isfinite(v):
                        self._tb.add_scalar(f"{split}/{k}", v, step)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._tb is not None:
            tb, self._tb = self._tb, None
            with self._naming(self._tb_dir):
                tb.close()

    @staticmethod
    @contextlib.contextmanager
    def _naming(path: Path) -> Iterator[None]:
        """An OSError without a file name (a full disk: a write to an open file, or TensorBoard's writer
        thread) raised again naming ``path``."""
        try:
            yield
        except OSError as e:
            if e.filename is not None or e.errno is None:
                raise
            raise OSError(e.errno, e.strerror, str(path)) from e


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
    does not log the same steps twice. The kept rows go to a temporary file in the same folder, renamed
    over ``path`` (``write_text_atomic``): a full disk or a kill part-way leaves the whole old file."""
    path = Path(path)
    if not path.is_file():
        return
    keep = [r for r in read_metrics(path) if int(r.get("step", 0)) <= last_step]
    write_text_atomic(path, "".join(json.dumps(r) + "\n" for r in keep))


def plot_or_skip(draw: Callable[[], object], png_path: Path) -> bool:
    """Run ``draw`` (which saves ``png_path``); without matplotlib print one line and go on. True if drawn.
    A command whose work is done (a study, an evaluation) must not fail at its figure."""
    try:
        import matplotlib  # noqa: F401  (the figures need it; it is an optional extra)
    except ImportError:
        print(f"matplotlib is not installed (pip install 'titans[train]'): skipped the plot {png_path}")
        return False
    draw()
    return True


def save_plot(fig, path: str | Path, *, dpi: float | None = None) -> Path:
    """Lay out and save the matplotlib Figure `fig` as `path`, every text in it drawn as written: paths and
    names a user chose go into titles and legends, where a ``$`` would start a formula that fails to parse
    and a file name's undecodable bytes (lone surrogates) fail in the font renderer, losing the plot."""
    from matplotlib.text import Text

    # tick labels are the formatters' own (a log axis writes 10^k as a formula): left as they are
    ticks = {
        id(label)
        for ax in fig.axes
        for axis in (ax.xaxis, ax.yaxis)
        for tick in (*axis.get_major_ticks(), *axis.get_minor_ticks())
        for label in (tick.label1, tick.label2)
    }
    for text in fig.findobj(Text):
        if id(text) not in ticks and text.get_text():
            escaped = text.get_text().encode("utf-8", "backslashreplace").decode("utf-8")
            text.set_text(escaped.replace("$", r"\$"))
    fig.tight_layout()
    path = Path(path)
    # drawn in memory, then written whole: a full disk or a kill mid-write left a truncated image in place
    # of the previous good one
    image = io.BytesIO()
    fig.savefig(image, dpi=dpi, format=path.suffix.lstrip(".").lower() or None)
    write_bytes_atomic(path, image.getvalue())
    return path


def plot_losses(metrics_path: str | Path, png_path: str | Path, title: str = "") -> Path | None:
    """The run as a PNG, three panels over the step: train and held-out loss, held-out bits per byte, and
    the learning rate. None (with a note) when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # no display needed
        import matplotlib.pyplot as plt
    except ImportError:
        log.warning("matplotlib is not installed (pip install 'titans[train]'): no loss plot")
        return None
    rows = read_metrics(metrics_path)

    def series(split: str, key: str) -> tuple[list, list]:
        pts = [(r["step"], r[key]) for r in rows if r.get("split") == split and _is_number(r.get(key))]
        return [x for x, _ in pts], [y for _, y in pts]

    fig, (loss_ax, bpb_ax, lr_ax) = plt.subplots(
        3, 1, figsize=(7, 6.4), dpi=110, sharex=True, gridspec_kw={"height_ratios": [3, 2, 1.2]}
    )
    xs, ys = series("train", "loss")
    if xs:
        loss_ax.plot(xs, ys, lw=1.0, alpha=0.8, label="train")
    xs, ys = series("eval", "loss")
    if xs:
        loss_ax.plot(xs, ys, marker="o", ms=3, lw=1.5, label="held-out")
    loss_ax.set_ylabel("loss (nats / token)")
    if loss_ax.get_legend_handles_labels()[0]:
        loss_ax.legend()
    xs, ys = series("eval", "bpb")
    if xs:
        bpb_ax.plot(xs, ys, marker="o", ms=3, lw=1.5, color="C1")
        bpb_ax.annotate(f"{ys[-1]:.3f}", (xs[-1], ys[-1]), textcoords="offset points", xytext=(-4, 6),
                        ha="right", fontsize=8, color="C1")  # fmt: skip
    else:
        bpb_ax.text(0.5, 0.5, "no bits per byte (tokenizer bytes unknown)", transform=bpb_ax.transAxes,
                    ha="center", va="center", color="gray")  # fmt: skip
    bpb_ax.set_ylabel("held-out\nbits / byte")
    xs, ys = series("train", "lr")
    if xs:
        lr_ax.plot(xs, ys, lw=1.2, color="C2")
    lr_ax.set_ylabel("learning\nrate")
    lr_ax.ticklabel_format(axis="y", style="sci", scilimits=(-2, 3))
    lr_ax.set_xlabel("step")
    for ax in (loss_ax, bpb_ax, lr_ax):
        ax.grid(alpha=0.3)
    loss_ax.set_title(title, fontsize=10)
    fig.align_ylabels()
    png_path = save_plot(fig, png_path)
    plt.close(fig)
    return png_path


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and math.isfinite(v)
