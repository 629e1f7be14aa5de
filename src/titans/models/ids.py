"""Checks on token ids, shared by the model, streaming, the static decoder and the graphed trainer."""

from __future__ import annotations

import torch
from torch import Tensor

_NO_AMINMAX = (torch.uint16, torch.uint32, torch.uint64)  # checked as int64 by `check_token_ids`


def check_token_dtype(tokens: Tensor, caller: str = "TitansLM", what: str = "tokens") -> None:
    """Refuse tokens that are not integer ids (float, complex, bool: a cast would truncate or reinterpret
    them); every integer dtype is taken, its values checked by `check_token_ids`. `what` names the
    argument in the message."""
    if tokens.is_floating_point() or tokens.is_complex() or tokens.dtype == torch.bool:
        raise TypeError(f"{caller}: {what} must hold integer token ids, got dtype {tokens.dtype}")


def check_token_ids(tokens: Tensor, vocab_size: int, caller: str = "TitansLM") -> None:
    """Raise if any id in ``tokens`` (any integer dtype) lies outside [0, vocab_size) (one host sync for
    both bounds)."""
    if tokens.numel():
        wide = tokens.dtype == torch.uint64
        if tokens.dtype in _NO_AMINMAX:  # torch has no aminmax for these: the exact int64 values
            tokens = tokens.long()  # (uint64 past 2**63 comes out negative, refused below)
        lo, hi = torch.stack(torch.aminmax(tokens)).tolist()
        if lo < 0 or hi >= vocab_size:
            got = "an id >= 2**63 (uint64)" if wide and lo < 0 else f"[{lo}, {hi}]"
            raise ValueError(f"{caller}: token ids must lie in [0, {vocab_size}), got {got}")
