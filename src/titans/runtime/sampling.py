"""Sampling defaults: those of `titans generate`, of the server's generate request and of the sample
printed at the end of `titans train` (``TrainConfig.sample_temperature`` / ``sample_top_k``)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SamplingDefaults:
    temperature: float = 0.8  # 0: greedy
    top_k: int | None = 40  # None: sample from the whole vocabulary


SAMPLING = SamplingDefaults()

__all__ = ["SAMPLING", "SamplingDefaults"]
