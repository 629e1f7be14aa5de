"""Streaming states as trees of tensors: one walk over them, and the registry of state types.

A layer's streaming state is a dataclass of tensors, ints, tuples and nested states. `map_tensors` is the
one walk over such a tree (moving, detaching, expanding a batch). `StateTree` gives a state class its
`map` / `detach` through that walk, and `register_state_type` records it by name so a saved state file
can name it (`titans.models.state`): each state class registers itself where it is defined.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, TypeVar

from torch import Tensor

T = TypeVar("T")

# Classes a state file may name, by class name (`register_state_type`).
STATE_TYPES: dict[str, type] = {}


def register_state_type(cls: type[T]) -> type[T]:
    """Allow a (dataclass) per-layer state type in state files; a class decorator."""
    if not dataclasses.is_dataclass(cls):
        raise TypeError(f"register_state_type: {cls.__name__} is not a dataclass")
    known = STATE_TYPES.get(cls.__name__)
    if known is not None and known is not cls:
        raise ValueError(
            f"register_state_type: another state type is already registered as {cls.__name__!r} "
            f"({known.__module__}.{known.__qualname__}); state files name types by class name"
        )
    STATE_TYPES[cls.__name__] = cls
    return cls


def map_tensors(obj: Any, fn: Callable[[Tensor], Tensor], done: dict[int, Tensor] | None = None) -> Any:
    """`obj` with `fn` applied to every tensor in it; ints, floats, strings and None are kept.

    A tensor reached twice maps to one result (keeps aliasing such as MAC's segment weights being the
    memory's weights, and does the work once); pass the same `done` to share that across several calls.
    """
    done = {} if done is None else done
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if isinstance(obj, Tensor):
        if id(obj) not in done:
            done[id(obj)] = fn(obj)
        return done[id(obj)]
    if isinstance(obj, tuple):
        return tuple(map_tensors(v, fn, done) for v in obj)
    if isinstance(obj, list):
        return [map_tensors(v, fn, done) for v in obj]
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        changes = {f.name: map_tensors(getattr(obj, f.name), fn, done) for f in dataclasses.fields(obj)}
        return dataclasses.replace(obj, **changes)
    raise TypeError(f"map_tensors: cannot map a {type(obj).__name__} inside a state")


class StateTree:
    """Base of the streaming-state dataclasses: `map` and `detach` through `map_tensors`."""

    def map(self: T, fn: Callable[[Tensor], Tensor]) -> T:
        """Apply `fn` to every tensor (e.g. `state.map(lambda t: t.to("cuda"))`)."""
        return map_tensors(self, fn)

    def detach(self: T) -> T:
        """A copy cut from the autograd graph (e.g. for truncated backprop across calls)."""
        return map_tensors(self, Tensor.detach)


__all__ = ["STATE_TYPES", "StateTree", "map_tensors", "register_state_type"]
