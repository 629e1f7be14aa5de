"""A new attentional bias for the memory's update rule, as one class: c ||M(k) - v||^2.

Importing this module registers the part (kind "scaled_l2"); then it is a rule like any other:

    from titans import NeuralMemory
    from titans.ops.memory import MemoryRule
    import scaled_l2_bias

    rule = MemoryRule(bias=scaled_l2_bias.ScaledL2Bias(c=0.5))
    mem = NeuralMemory(dim=64, heads=2, rule=rule)

docs/extending.md walks through it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from torch import Tensor

from titans.ops.memory import Bias


@dataclass(frozen=True)
class ScaledL2Bias(Bias, kind="scaled_l2"):
    """The inner loss c ||M(k) - v||^2: its error map is phi(e) = 2 c e (c = 1 is Titans' l2 bias)."""

    c: float = 1.0

    def __post_init__(self) -> None:
        # a NaN or infinite c would fill the memory with NaN; a bool is no scale
        if isinstance(self.c, bool) or not isinstance(self.c, (int, float)) or not math.isfinite(self.c):
            raise ValueError(f"ScaledL2Bias: c must be a finite number (not a bool), got {self.c!r}")
        if self.c < 0:  # the loss would reward errors
            raise ValueError(f"ScaledL2Bias: c must be >= 0, got {self.c!r}")

    def error_map(self, e: Tensor, aux: Tensor | None) -> Tensor:
        """phi(e) for the output error e (..., n, d): differentiable by autograd (the general path)."""
        return 2 * self.c * e

    def grad(self, g: Tensor, e: Tensor, aux: Tensor | None) -> tuple[Tensor, None]:
        """The error map's backward for dL/dphi = g (the fast path): (dL/de, no gate gradient)."""
        return 2 * self.c * g, None
