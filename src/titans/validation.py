"""Argument checks shared by the configs and the public layers and ops (the lowest level of the package)."""

from __future__ import annotations

from typing import Any


def check_int(name: str, value: Any, minimum: int = 1, *, none_ok: bool = False) -> None:
    """Raise a ValueError naming `name` unless `value` is an int (not a bool) >= `minimum`, or None where
    `none_ok`. `name` is the value as the user knows it, e.g. "TitansConfig.dim"."""
    if value is None and none_ok:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        what = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
        raise ValueError(f"{name} must be {what}{' or None' if none_ok else ''}, got {value!r}")


__all__ = ["check_int"]
