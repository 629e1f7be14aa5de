"""AdamW with decoupled weight decay on weight matrices only, and a warmup + cosine learning-rate schedule
(``lr_factor``: it decays toward ``min_lr_ratio * lr``, reached one step past the last).

Decay / no-decay split (see ``titans.training.config``): the ``weight`` of every ``nn.Linear`` and
``nn.Conv1d`` is decayed; nothing else is — embeddings (and a head tied to them), norm weights, biases,
gate scalars, persistent-memory tokens and the neural memory's learned initial weights W_0.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from titans.training.config import TrainConfig


def parameter_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Two AdamW groups: decayed weight matrices, and everything else (each parameter exactly once)."""
    decay_ids = {
        id(m.weight)
        for m in model.modules()
        if isinstance(m, (nn.Linear, nn.Conv1d)) and m.weight is not None
    }
    decay_ids -= {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}  # tied head
    decay, no_decay = [], []
    for p in model.parameters():  # .parameters() yields a shared (tied) tensor once
        if p.requires_grad:
            (decay if id(p) in decay_ids else no_decay).append(p)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def build_optimizer(model: nn.Module, cfg: TrainConfig) -> torch.optim.AdamW:
    return torch.optim.AdamW(
        parameter_groups(model, cfg.weight_decay), lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps
    )


def lr_factor(step: int, *, warmup_steps: int, total_steps: int, min_lr_ratio: float) -> float:
    """Multiplier of the peak lr for optimizer step ``step`` (0-based): linear warmup over
    ``warmup_steps`` (the first step already has lr / warmup_steps), then a cosine from 1 decaying toward
    ``min_lr_ratio``, which it reaches at step ``total_steps``: one past the run's last step
    (``total_steps - 1``), so no step of the run takes that lr. Flat after it. This is nanoGPT's
    schedule: warmup ``(step + 1) / warmup_steps``, then the cosine of progress
    ``(step - warmup_steps) / (total_steps - warmup_steps)``."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def warmup_cosine(
    optimizer: torch.optim.Optimizer, *, warmup_steps: int, total_steps: int, min_lr_ratio: float
) -> torch.optim.lr_scheduler.LambdaLR:
    """The ``lr_factor`` schedule on ``optimizer`` (call ``.step()`` once per optimizer step)."""
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda step: lr_factor(
            step, warmup_steps=warmup_steps, total_steps=total_steps, min_lr_ratio=min_lr_ratio
        ),
    )


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: TrainConfig) -> torch.optim.lr_scheduler.LambdaLR:
    return warmup_cosine(
        optimizer, warmup_steps=cfg.warmup_steps, total_steps=cfg.total_steps, min_lr_ratio=cfg.min_lr_ratio
    )
