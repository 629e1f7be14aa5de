"""Argument checks shared by the configs and the public layers and ops (the lowest level of the package)."""

from __future__ import annotations

import difflib
from collections.abc import Iterable
from typing import Any


def did_you_mean(word: str, choices: Iterable[str]) -> str:
    """'; did you mean 'X'?' for the choice closest to a mistyped `word`, or '' if none is close.
    Appended to "unknown ..." errors. Swapped letters ('mca') win over other close spellings; otherwise
    difflib's closest match."""
    word, names = str(word), [str(c) for c in choices]
    swapped = [c for c in names if sorted(c.lower()) == sorted(word.lower())]
    close = swapped or difflib.get_close_matches(word, names, n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else ""


def check_int(name: str, value: Any, minimum: int = 1, *, none_ok: bool = False) -> None:
    """Raise a ValueError naming `name` unless `value` is an int (not a bool) >= `minimum`, or None where
    `none_ok`. `name` is the value as the user knows it, e.g. "TitansConfig.dim"."""
    if value is None and none_ok:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        what = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
        raise ValueError(f"{name} must be {what}{' or None' if none_ok else ''}, got {value!r}")


__all__ = ["check_int", "did_you_mean"]
