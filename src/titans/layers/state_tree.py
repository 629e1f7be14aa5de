"""One walk over the tensors of a streaming state (nested dataclasses, tuples and lists of tensors)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from torch import Tensor


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
