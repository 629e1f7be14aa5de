"""The projections whose outputs are added to the residual stream mark themselves, so a model can scale
their initial weights with its depth (GPT-2's 1 / sqrt(2 depth)) without knowing the layers' names."""

from __future__ import annotations

from torch import nn

_MARK = "residual_output"


def residual_output(linear: nn.Linear) -> nn.Linear:
    """Mark `linear` as a residual output projection; returns it."""
    setattr(linear, _MARK, True)
    return linear


def is_residual_output(module: nn.Module) -> bool:
    return bool(getattr(module, _MARK, False))


__all__ = ["is_residual_output", "residual_output"]
