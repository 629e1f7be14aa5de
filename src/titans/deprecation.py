"""Deprecations: names that moved keep resolving where they were, and flags that gave way to a typed call
keep working, each with a DeprecationWarning that says where to go (the lowest level of the package)."""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Callable
from typing import Any


def warn_deprecated(message: str, stacklevel: int = 3) -> None:
    """A DeprecationWarning attributed to the caller of the function that calls this one."""
    warnings.warn(message, DeprecationWarning, stacklevel=stacklevel)


def moved_names(module: str, moved: dict[str, str]) -> Callable[[str], Any]:
    """A module `__getattr__` under which each name in `moved` (name -> the module that holds it now) still
    resolves in `module`, with a DeprecationWarning; other unknown names raise AttributeError."""

    def __getattr__(name: str) -> Any:
        if name not in moved:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        warn_deprecated(f"{module}.{name} moved to {moved[name]}.{name}")
        # the new home is imported on first use of the old name only
        return getattr(importlib.import_module(moved[name]), name)

    return __getattr__


__all__ = ["moved_names", "warn_deprecated"]
