"""The fine-tuning recipe of the long-context tasks: train on generated samples, loss on the answers only.

    cfg = TaskTrainConfig(task="niah", train_length=1024, steps=300)
    history = train_on_task(model, tokenizer, cfg)

Every step draws a fresh batch from the generators' "train" stream (disjoint from the evaluation samples):
NIAH pass-key prompts with the needle at a uniform random depth, or BABILong stories. The loss is the
cross-entropy of the answer tokens alone (``TrainingExample.target_mask``). AdamW with linear warm-up then a
cosine decay, gradient clipping. With ``hold_lr`` the learning rate stays at its peak until the curriculum
has reached ``train_length``, and the cosine decay then spans the steps that are left: a model whose onset
comes late still learns the longer lengths at the peak rate, instead of meeting them on a decayed one.

Length curriculum: the longest length used ramps linearly from ``start_length`` to ``train_length`` over
the first ``curriculum`` share of the steps, or, with ``curriculum_loss`` set, grows by 25% whenever the
running answer loss is under that value (lengths grow once the task is solved at the current ones). Every
step draws its length uniformly between the task's minimum and that maximum (a batch shares one length, so
no padding is needed). Short samples put the needle near the question: the model first learns *what* to
retrieve, then to keep it over more and more haystack.

The steps run on the package's one training loop (``titans.training.loop.TrainLoop``) with this recipe's
batch source (the curriculum's length, the generated examples) and loss (``masked_loss``) injected: a NaN
or inf loss stops training with ``FloatingPointError`` naming the step, the gradient norm is clipped to
``grad_clip``, and with ``handle_signals`` a SIGTERM / SIGINT stops it after the current step (recorded in
the history as ``stopped_by``). The weight-decay split (``parameter_groups``) and the warm-up + cosine
schedule (``warmup_cosine``) are the LM trainer's, from ``titans.training.optim``. Unlike the LM trainer
it fine-tunes a model it is handed, in place, in float32 and in one process.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.optim.lr_scheduler import LambdaLR

from titans.evaluation.babilong import TASKS as BABI_TASKS
from titans.evaluation.babilong import babilong_training_example, make_babilong_sample
from titans.evaluation.haystack import HAYSTACK_NAMES, TextTokenizer, TrainingExample
from titans.evaluation.niah import NEEDLE_KINDS, make_niah_sample, niah_training_example
from titans.training.loop import TrainLoop
from titans.training.optim import lr_factor, parameter_groups, warmup_cosine
from titans.validation import check_int

TASK_NAMES = ("niah", "babilong")


@dataclass
class TaskTrainConfig:
    """How to train on a generated task. Lengths are in tokens, prompt + answer.

    task: "niah" (``kind``: passkey | number | uuid) or "babilong" (``babi_tasks``, mixed evenly;
        ``num_facts`` facts per story, None for each task's default).
    haystack: the haystack name, None for the task's default (noise for passkey, moby_dick for babilong), or
        several names: example ``seed`` then draws its haystack from ``haystack[seed % len(haystack)]`` (so a
        batch mixes them evenly).
    distractors: NIAH only: decoy numbers per 1,000 haystack tokens in every training prompt (half of them
        the key with a digit or two changed; ``make_niah_sample``), 0 for none.
    length_multiple: every drawn length is rounded down to a multiple of it (and kept >= the minimum).
    curriculum_loss: None for the linear length ramp, else the adaptive curriculum's loss threshold.
    hold_lr: keep the peak learning rate (after warm-up) until the curriculum's cap reaches ``train_length``,
        then decay by the cosine over the remaining steps; if it never does, the whole run is at the peak.
    lm_loss_weight: adds this times the next-token loss of *every* position (haystack, needle, question) to
        the answer loss; 0 (the default) is the answer-only recipe. A small weight gives the model the local
        text features it needs before retrieval can be learned (a stand-in for LM pre-training).
    """

    task: str = "niah"
    kind: str = "passkey"
    babi_tasks: tuple[str, ...] = ("qa1", "qa2")
    num_facts: int | None = None
    haystack: str | tuple[str, ...] | None = None
    distractors: float = 0.0
    train_length: int = 1024
    start_length: int = 256
    curriculum: float = 0.5
    curriculum_loss: float | None = None
    length_multiple: int = 16
    steps: int = 300
    batch_size: int = 8
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 20
    hold_lr: bool = False
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = 1.0
    lm_loss_weight: float = 0.0
    seed: int = 0
    log_every: int = 25

    def __post_init__(self) -> None:
        if self.task not in TASK_NAMES:
            raise ValueError(f"TaskTrainConfig.task must be one of {TASK_NAMES}, got {self.task!r}")
        if self.task == "niah" and self.kind not in NEEDLE_KINDS:
            raise ValueError(f"TaskTrainConfig.kind must be one of {tuple(NEEDLE_KINDS)}, got {self.kind!r}")
        self.babi_tasks = tuple(self.babi_tasks)
        bad = [t for t in self.babi_tasks if t not in BABI_TASKS]
        if self.task == "babilong" and (bad or not self.babi_tasks):
            raise ValueError(
                f"TaskTrainConfig.babi_tasks must be a non-empty subset of {BABI_TASKS}, got {bad}"
            )
        if isinstance(self.haystack, (list, tuple)):
            self.haystack = tuple(self.haystack)
            unknown = [h for h in self.haystack if h not in HAYSTACK_NAMES]
            if unknown or not self.haystack:
                raise ValueError(
                    f"TaskTrainConfig.haystack must name one or more of {HAYSTACK_NAMES}, "
                    f"got {self.haystack!r}"
                )
        if not self.distractors >= 0:
            raise ValueError(f"TaskTrainConfig.distractors must be >= 0, got {self.distractors!r}")
        if self.distractors and self.task != "niah":
            raise ValueError("TaskTrainConfig.distractors (decoy numbers) applies to task='niah' only")
        for name in ("train_length", "start_length", "steps", "batch_size", "length_multiple"):
            check_int(f"TaskTrainConfig.{name}", getattr(self, name))
        check_int("TaskTrainConfig.warmup_steps", self.warmup_steps, minimum=0)
        if not 0.0 <= self.curriculum <= 1.0:
            raise ValueError(f"TaskTrainConfig.curriculum must lie in [0, 1], got {self.curriculum}")
        # NaN fails every comparison: a bare `< 0` test would let it through, to a NaN loss at step 0
        if not (math.isfinite(self.lr) and self.lr > 0):
            raise ValueError(f"TaskTrainConfig.lr must be a finite number > 0, got {self.lr!r}")
        if not (math.isfinite(self.lm_loss_weight) and self.lm_loss_weight >= 0):
            raise ValueError(
                f"TaskTrainConfig.lm_loss_weight must be a finite number >= 0, got {self.lm_loss_weight!r}"
            )

    def to_dict(self) -> dict:
        return asdict(self)

    def haystack_for(self, seed: int) -> str | None:
        """The haystack of training example ``seed``: the one named, or one of several in turn."""
        if isinstance(self.haystack, tuple):
            return self.haystack[seed % len(self.haystack)]
        return self.haystack

    def babilong_for(self, seed: int) -> tuple[str, str]:
        """The bAbI task and haystack of training example ``seed``: tasks in turn, and the haystacks crossed
        with them so that every task meets every haystack (moby_dick when none is named)."""
        n = len(self.babi_tasks)
        return self.babi_tasks[seed % n], self.haystack_for(seed // n) or "moby_dick"


def task_example(
    tokenizer: TextTokenizer, cfg: TaskTrainConfig, *, length: int, seed: int
) -> TrainingExample:
    """One training sequence of exactly ``length`` tokens for ``cfg.task`` (seeded, from the train stream)."""
    if cfg.task == "niah":
        return niah_training_example(
            tokenizer,
            length=length,
            kind=cfg.kind,
            haystack=cfg.haystack_for(seed),
            seed=seed,
            distractors=cfg.distractors,
        )
    task, haystack = cfg.babilong_for(seed)
    return babilong_training_example(
        tokenizer,
        length=length,
        task=task,
        haystack=haystack,
        seed=seed,
        num_facts=cfg.num_facts,
    )


def min_task_length(tokenizer: TextTokenizer, cfg: TaskTrainConfig, probes: int = 64) -> int:
    """A length every sample of the task fits in (preamble, needle or facts, question, answer): the most
    non-haystack tokens over ``probes`` training seeds per task, plus a margin of a tenth (at least one
    ``length_multiple``), rounded up to a multiple of it (stories vary in length from seed to seed, and
    training draws many more of them than are probed)."""
    fixed = 0
    tasks = 1 if cfg.task == "niah" else len(cfg.babi_tasks)
    for seed in range(probes * tasks):
        if cfg.task == "niah":
            sample = make_niah_sample(
                tokenizer,
                length=4096,
                depth=0.5,
                kind=cfg.kind,
                haystack=cfg.haystack_for(seed),
                seed=seed,
                split="train",
            )
        else:
            task, haystack = cfg.babilong_for(seed)
            sample = make_babilong_sample(
                tokenizer,
                length=4096,
                task=task,
                haystack=haystack,
                seed=seed,
                num_facts=cfg.num_facts,
                split="train",
            )
        fixed = max(fixed, sample.length - sample.haystack_tokens)
    m = cfg.length_multiple
    return (-(-(fixed + max(m, fixed // 10)) // m)) * m


def collate(examples: Sequence[TrainingExample]) -> tuple[Tensor, Tensor, Tensor]:
    """Examples of one length -> inputs, targets (B, T-1) int64 and the target mask (B, T-1) bool."""
    lengths = {len(e.tokens) for e in examples}
    if len(lengths) != 1:
        raise ValueError(f"collate: examples of one batch must share a length, got {sorted(lengths)}")
    inputs = torch.tensor([e.input_ids for e in examples], dtype=torch.long)
    targets = torch.tensor([e.target_ids for e in examples], dtype=torch.long)
    mask = torch.tensor([e.target_mask for e in examples], dtype=torch.bool)
    return inputs, targets, mask


def masked_loss(
    model: nn.Module, inputs: Tensor, targets: Tensor, mask: Tensor, lm_weight: float = 0.0
) -> tuple[Tensor, Tensor]:
    """Mean cross-entropy of the targets where ``mask`` is set (inputs, targets, mask: (B, T)), plus
    ``lm_weight`` times the mean over all positions. Returns (loss to minimise, answer-only loss)."""
    logits, _ = model(inputs)
    picked = logits[mask]  # (n, vocab): only the answer positions
    if picked.shape[0] == 0:
        raise ValueError("masked_loss: the mask selects no target")
    answer = F.cross_entropy(picked.float(), targets[mask])
    if lm_weight == 0:
        return answer, answer
    lm = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
    return answer + lm_weight * lm, answer


def make_optimizer(
    model: nn.Module, cfg: TaskTrainConfig, hold: HoldThenCosine | None = None
) -> tuple[torch.optim.AdamW, LambdaLR]:
    """AdamW and its warm-up + cosine schedule, with the LM trainer's weight-decay policy (matrices of
    linear and conv layers only) and schedule (both from ``titans.training.optim``); ``hold`` replaces the
    schedule (``cfg.hold_lr``; the caller releases it)."""
    opt = torch.optim.AdamW(parameter_groups(model, cfg.weight_decay), lr=cfg.lr, betas=cfg.betas)
    if hold is not None:
        return opt, LambdaLR(opt, hold)
    sched = warmup_cosine(
        opt, warmup_steps=cfg.warmup_steps, total_steps=cfg.steps, min_lr_ratio=cfg.min_lr_ratio
    )
    return opt, sched


@dataclass
class HoldThenCosine:
    """Learning-rate factor: linear warm-up, then 1.0 until ``release(step)``, then a cosine from 1.0 to
    ``min_lr_ratio`` between that step and ``total_steps`` (flat after it)."""

    warmup_steps: int
    total_steps: int
    min_lr_ratio: float
    released_at: int | None = None

    def release(self, step: int) -> None:
        """Start the decay at the next optimizer step (no earlier than the end of the warm-up); once only."""
        if self.released_at is None:
            self.released_at = max(step + 1, self.warmup_steps)

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        if self.released_at is None or step < self.released_at:
            return 1.0
        span = self.total_steps - self.released_at
        return lr_factor(
            step - self.released_at, warmup_steps=0, total_steps=span, min_lr_ratio=self.min_lr_ratio
        )


@dataclass
class LengthCurriculum:
    """Per-step sequence length: uniform in [min_length, cap], rounded down to ``multiple``.

    Linear mode (``loss_threshold`` None): the cap ramps from ``start_length`` to ``max_length`` over
    ``ramp_steps``. Adaptive mode: the cap starts at ``start_length`` and grows by ``growth`` each time
    ``update`` sees a running loss under ``loss_threshold`` (at most once every ``patience`` steps): lengths
    grow only once the task is solved at the current ones.
    """

    min_length: int
    start_length: int
    max_length: int
    ramp_steps: int
    multiple: int = 16
    rng: random.Random = field(default_factory=lambda: random.Random(0))
    loss_threshold: float | None = None
    growth: float = 1.25
    patience: int = 10
    _cap: int = field(init=False, default=0)
    _last_growth: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        self._cap = max(self.min_length, min(self.start_length, self.max_length))

    def cap(self, step: int) -> int:
        if self.loss_threshold is not None:
            return self._cap
        if self.ramp_steps <= 0 or step >= self.ramp_steps:
            return self.max_length
        return int(self._cap + (self.max_length - self._cap) * step / self.ramp_steps)

    def update(self, step: int, running_loss: float) -> None:
        """Adaptive mode: grow the cap when the running loss is under the threshold."""
        if self.loss_threshold is None or running_loss >= self.loss_threshold:
            return
        if step - self._last_growth >= self.patience and self._cap < self.max_length:
            self._cap = min(self.max_length, max(self._cap + self.multiple, int(self._cap * self.growth)))
            self._last_growth = step

    def length(self, step: int) -> int:
        cap = self.cap(step)
        length = self.rng.randint(min(self.min_length, cap), cap)
        return max(self.min_length, length // self.multiple * self.multiple)


def check_train_length(tokenizer: TextTokenizer, cfg: TaskTrainConfig) -> int:
    """The task's minimum length (``min_task_length``); raises if ``cfg.train_length`` is under it. A
    study that trains something else first calls it up front, so the error comes before any training."""
    min_length = min_task_length(tokenizer, cfg)
    if cfg.train_length < min_length:
        raise ValueError(f"train_length={cfg.train_length} is shorter than the task's minimum {min_length}")
    return min_length


def train_on_task(
    model: nn.Module,
    tokenizer: TextTokenizer,
    cfg: TaskTrainConfig,
    *,
    log: Callable[[str], None] | None = print,
    max_seconds: float | None = None,
    handle_signals: bool = False,
    checkpoint: Callable[[int, list[dict]], object] | None = None,
    ckpt_every: int | None = None,
) -> list[dict]:
    """Train ``model`` in place on ``cfg.task``; returns the logged history (step, length, loss, lr, s).

    ``max_seconds`` stops early (the schedule still spans ``cfg.steps``); the last record then says
    ``stopped_early``. ``handle_signals`` (main thread only): a SIGTERM / SIGINT stops training after the
    current step as well (the last record says ``stopped_by``), for a caller that keeps what was trained;
    without it a signal has its usual effect (KeyboardInterrupt), which ends a study of many runs as a
    whole. ``checkpoint(step, history)`` saves the model after ``step`` steps: every ``ckpt_every`` steps
    (None: never in between) and once after the last step or the step a stop came after.
    """
    min_length = check_train_length(tokenizer, cfg)
    torch.manual_seed(cfg.seed)
    curriculum = LengthCurriculum(
        min_length,
        cfg.start_length,
        cfg.train_length,
        int(cfg.curriculum * cfg.steps),
        cfg.length_multiple,
        random.Random(f"curriculum-{cfg.seed}"),
        loss_threshold=cfg.curriculum_loss,
    )
    hold = HoldThenCosine(cfg.warmup_steps, cfg.steps, cfg.min_lr_ratio) if cfg.hold_lr else None
    opt, sched = make_optimizer(model, cfg, hold)
    device = next(model.parameters()).device
    history: list[dict] = []
    t0 = time.perf_counter()
    now: dict = {"running": None}  # the current step's length and the running answer loss

    def batches(step: int) -> tuple[Tensor, Tensor, Tensor]:
        now["length"] = length = curriculum.length(step)
        seeds = range(step * cfg.batch_size, (step + 1) * cfg.batch_size)
        seeds = [cfg.seed * 10_000_019 + s for s in seeds]  # distinct training streams per seed
        batch = collate([task_example(tokenizer, cfg, length=length, seed=s) for s in seeds])
        return tuple(t.to(device) for t in batch)

    def loss_fn(model: nn.Module, batch: tuple[Tensor, Tensor, Tensor]) -> tuple[Tensor, dict]:
        loss, answer_loss = masked_loss(model, *batch, cfg.lm_loss_weight)
        return loss, {"answer_loss": answer_loss}

    def on_step(step: int, loss: Tensor, grad_norm: Tensor | None, aux: dict) -> None:
        value = float(aux["answer_loss"].detach())
        running = now["running"] = value if now["running"] is None else 0.9 * now["running"] + 0.1 * value
        curriculum.update(step, running)
        if hold is not None and curriculum.cap(step) >= cfg.train_length:
            hold.release(step)
        record = {
            "step": step + 1,  # steps done, as the LM trainer's metrics and the checkpoints count them
            "length": now["length"],
            "max_length": curriculum.cap(step),
            "loss": value,
            "loss_avg": running,
            "grad_norm": float(grad_norm),
            "lr": loop.step_lr,  # not the scheduler's: it has moved on to the next step's
            "seconds": time.perf_counter() - t0,
        }
        if hold is not None:
            record["lr_released_at"] = hold.released_at
        now["record"] = record
        if (step + 1) % cfg.log_every == 0 or step == 0 or step == cfg.steps - 1:
            _keep(record)

    def _keep(record: dict) -> None:
        history.append(record)
        if log is not None:
            log(
                f"step {record['step']:5d}  len {record['length']:5d}/{record['max_length']:5d}  "
                f"loss {record['loss']:.3f} (avg {record['loss_avg']:.3f})  "
                f"gnorm {record['grad_norm']:.2f}  lr {record['lr']:.2e}  {record['seconds']:.0f}s"
            )

    loop = TrainLoop(
        model,
        opt,
        total_steps=cfg.steps,
        batches=batches,
        loss_fn=loss_fn,
        scheduler=sched,
        grad_clip=cfg.grad_clip,
        on_step=on_step,
        time_budget_s=max_seconds,
        handle_signals=handle_signals,
        ckpt_every=ckpt_every,
        checkpoint=None if checkpoint is None else lambda step: checkpoint(step, history),
        failure_hint=lambda: f"task training of {cfg.task} (try a lower lr or memory_max_lr)",
    )
    done = loop.run()
    if done.stopped_early and done.step > 0:
        if not history or history[-1] is not now["record"]:
            _keep(now["record"])
        history[-1]["stopped_early"] = True
        if done.stopped_by is not None:
            history[-1]["stopped_by"] = done.stopped_by
        if log is not None:
            why = done.stopped_by or f"time budget {max_seconds:.0f}s spent"
            log(f"stopped after {done.step} of {cfg.steps} steps: {why}")
    model.eval()
    return history
