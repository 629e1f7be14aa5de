"""A micro training run shared by the trainer and torchrun tests: a MAC small enough to take a step in well
under a second on a busy CPU, trained on the built-in prose with everything but metrics switched off."""

from __future__ import annotations

from pathlib import Path

from titans.training.config import TrainConfig

MICRO_MODEL = dict(dim=64, depth=1, heads=2, segment_len=32, window=32, chunk_size=8, mlp_mult=2.0)


def micro_config(run_dir: Path, cache_dir: Path, **overrides) -> TrainConfig:
    base = dict(
        preset="tiny",
        model=dict(MICRO_MODEL),
        data="builtin:prose",
        cache_dir=str(cache_dir),
        seq_len=32,
        lr=3e-3,
        log_every=1,
        eval_batch_size=2,
        progress=False,
        tensorboard=False,
        plot=False,
        sample_tokens=0,
        run_dir=str(run_dir),
        # the tests compare against models and tensors on the CPU; `auto` would pick a GPU where there is one
        device="cpu",
    )
    return TrainConfig(**{**base, **overrides})
