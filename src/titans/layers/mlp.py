"""The position-wise feed-forward network of the Titans blocks."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn

from titans.layers.residual import residual_output
from titans.validation import check_int


class SwiGLU(nn.Module):
    """Bias-free SwiGLU MLP (Shazeer 2020, as in Llama): ``W_down(silu(x W_gate) * (x W_up))``.

    x: (..., dim) -> (..., dim).
    """

    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        check_int("SwiGLU dim", dim)
        check_int("SwiGLU hidden_dim", hidden_dim)
        self.dim = dim
        self.hidden_dim = hidden_dim
        self.gate_proj = nn.Linear(dim, hidden_dim, bias=False)
        self.up_proj = nn.Linear(dim, hidden_dim, bias=False)
        self.down_proj = residual_output(nn.Linear(hidden_dim, dim, bias=False))

    def forward(self, x: Tensor) -> Tensor:
        if x.shape[-1] != self.dim:
            raise ValueError(f"SwiGLU expects last dim {self.dim}, got shape {tuple(x.shape)}")
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
