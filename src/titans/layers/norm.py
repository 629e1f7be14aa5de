"""RMSNorm that keeps torch's fused kernel under autocast."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn


class RMSNorm(nn.RMSNorm):
    """`nn.RMSNorm` whose float32 weight follows a lower-precision input (bf16 under autocast).

    `F.rms_norm` with a bf16 input and a float32 weight falls back to its unfused implementation (and warns
    on every call); the fused kernel accumulates in float32 either way. Same parameters and state dict as
    `nn.RMSNorm`; with matching dtypes (float32 on CPU) it is exactly `nn.RMSNorm`.
    """

    def forward(self, x: Tensor) -> Tensor:
        weight = self.weight
        if weight is not None and weight.dtype != x.dtype:
            weight = weight.to(x.dtype)
        return F.rms_norm(x, self.normalized_shape, weight, self.eps)
