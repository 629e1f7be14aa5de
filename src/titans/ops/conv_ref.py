"""Reference for the causal depthwise convolution + SiLU of `titans.ops.conv`: ``F.conv1d`` with one group
per channel, written apart from the fast path (shares no code with it)."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor


def causal_conv_silu_ref(padded: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """silu(conv) over the K - 1 context rows and the rows together: padded (B, T + K - 1, C), weight
    (C, 1, K), bias (C,) or None -> (B, T, C)."""
    b = None if bias is None else bias.to(padded.dtype)
    out = F.conv1d(padded.transpose(1, 2), weight.to(padded.dtype), b, groups=weight.shape[0])
    return F.silu(out.transpose(1, 2))


__all__ = ["causal_conv_silu_ref"]
