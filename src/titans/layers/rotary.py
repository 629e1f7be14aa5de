"""Rotary position embedding (RoPE) for (batch, heads, seq, head_dim) tensors."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from titans.validation import check_int


class RotaryEmbedding(nn.Module):
    """Rotates channel pairs of queries/keys by position-dependent angles (Su et al., RoFormer).

    Channels are paired "half-split" (channel c with channel c + head_dim // 2, as in Llama / GPT-NeoX).
    With an odd ``head_dim`` the last channel is left unrotated.

    cos/sin tables are cached per module for positions below ``max_cached_positions`` (grown by doubling,
    kept in float32 and outside the state dict, so ``model.to(torch.bfloat16)`` does not round them);
    larger positions (very long streams) are computed on the fly, so memory stays bounded. Angles are
    computed in float64 because ``position * frequency`` loses whole radians in float32 past ~1e6 tokens.
    """

    def __init__(self, head_dim: int, base: float = 10000.0, max_cached_positions: int = 8192):
        super().__init__()
        check_int("head_dim", head_dim)
        if not base > 1.0:
            raise ValueError(f"rope base must be > 1, got {base!r}")
        if max_cached_positions < 0:
            raise ValueError(f"max_cached_positions must be >= 0, got {max_cached_positions}")
        self.head_dim = head_dim
        self.base = float(base)
        self.max_cached_positions = max_cached_positions
        self.half = head_dim // 2  # number of rotated channel pairs
        self._cos: Tensor | None = None  # (cached_len, half) float32
        self._sin: Tensor | None = None

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, base={self.base}"

    def _angles_cos_sin(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        # frequencies base^(-2i / rotated_dims), i = 0 .. half - 1
        exponent = torch.arange(self.half, dtype=torch.float64, device=positions.device) / self.half
        inv_freq = self.base**-exponent
        angles = positions.to(torch.float64)[:, None] * inv_freq[None, :]
        return angles.cos().float(), angles.sin().float()

    def cos_sin(self, positions: Tensor, max_position: int | None = None) -> tuple[Tensor, Tensor]:
        """cos and sin, each (T, head_dim // 2) float32, for integer ``positions`` (T,).

        ``max_position`` (an upper bound on ``positions``, exclusive) lets the cache be used without reading
        the positions back from the device; without it, the cache is used only for CPU positions.
        """
        if positions.dim() != 1 or positions.dtype.is_floating_point or positions.dtype == torch.bool:
            raise ValueError(
                f"positions must be a 1-D integer tensor, got {positions.dtype} {tuple(positions.shape)}"
            )
        if torch.compiler.is_compiling():
            # computed in the graph (fused there): filling the cache would be a change of the module's
            # attributes, and so a second compile of every compiled block
            return self._angles_cos_sin(positions)
        if max_position is None and positions.device.type == "cpu" and positions.numel() > 0:
            if int(positions.min()) < 0:
                raise ValueError("positions must be >= 0")
            max_position = int(positions.max()) + 1
        if max_position is None or max_position > self.max_cached_positions:
            return self._angles_cos_sin(positions)
        cached = 0 if self._cos is None else self._cos.shape[0]
        if self._cos is None or self._cos.device != positions.device or cached < max_position:
            length = min(self.max_cached_positions, max(256, 1 << (max_position - 1).bit_length()))
            self._cos, self._sin = self._angles_cos_sin(torch.arange(length, device=positions.device))
        return self._cos[positions], self._sin[positions]

    def forward(self, x: Tensor, positions: Tensor, max_position: int | None = None) -> Tensor:
        """Rotate x: (B, H, T, head_dim) at integer ``positions`` (T,). Returns x's shape and dtype.

        The rotation is done in float32 (or float64 for float64 input) and cast back, so bf16 works.
        """
        if x.dim() != 4 or x.shape[-1] != self.head_dim:
            raise ValueError(
                f"expected x of shape (batch, heads, seq, {self.head_dim}), got {tuple(x.shape)}"
            )
        if positions.shape != (x.shape[2],):
            raise ValueError(f"positions must be ({x.shape[2]},) to match x, got {tuple(positions.shape)}")
        if self.half == 0:
            return x
        cos, sin = self.cos_sin(positions, max_position)
        compute_dtype = torch.promote_types(x.dtype, torch.float32)
        cos, sin = cos.to(compute_dtype), sin.to(compute_dtype)
        xf = x.to(compute_dtype)
        # split(), not slices: the backward is one cat, not a zero-filled full-size tensor per slice
        x1, x2, rest = xf.split([self.half, self.half, xf.shape[-1] - 2 * self.half], dim=-1)
        rotated = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], dim=-1)
        return rotated.to(x.dtype)
