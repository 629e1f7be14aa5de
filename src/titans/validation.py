"""Argument checks shared by the configs and the public layers and ops (the lowest level of the package),
and `option`, the one place a config field's help text and bounds are written."""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import math
from collections.abc import Callable, Iterable
from typing import Any

_BOUNDS = ("min", "above", "max", "below")


def did_you_mean(word: str, choices: Iterable[str]) -> str:
    """'; did you mean 'X'?' for the choice closest to a mistyped `word`, or '' if none is close.
    Appended to "unknown ..." errors. Swapped letters ('mca') win over other close spellings; otherwise
    difflib's closest match."""
    word, names = str(word), [str(c) for c in choices]
    swapped = [c for c in names if sorted(c.lower()) == sorted(word.lower())]
    close = swapped or difflib.get_close_matches(word, names, n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else ""


def path_arg(text: str) -> str:
    """An argparse ``type`` for a path option: refuses an empty or blank path, which would otherwise mean the
    current folder (a run, checkpoint or output written or read there by accident)."""
    if not text.strip():
        raise argparse.ArgumentTypeError("an empty path; give a file or folder (. for the current folder)")
    return text


SEED_LIMIT = 2**32  # seeds are in [0, 2**32): numpy's range, and the trainer's


def seed_arg(text: str) -> int:
    """An argparse ``type`` for a ``--seed``: an integer in [0, 2**32). A larger one failed mid-run with
    torch's "Overflow when unpacking long long", after the work before it had run."""
    try:
        seed = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer seed, got {text!r}") from None
    if not 0 <= seed < SEED_LIMIT:
        raise argparse.ArgumentTypeError(f"a seed must be in [0, 2**32), got {seed}")
    return seed


def utf8(text: str) -> bytes:
    """`text` as UTF-8, or a ValueError naming the first character that has none: a lone surrogate, which is
    how Python holds a byte of a command-line argument that was not UTF-8 (0xff in ``--prompt caf\\xff``)."""
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError as e:
        char = ord(text[e.start])
        what = f"byte 0x{char - 0xDC00:02x}" if 0xDC80 <= char <= 0xDCFF else f"lone surrogate U+{char:04X}"
        raise ValueError(f"the text is not valid UTF-8 ({what} at character {e.start})") from None


def text_arg(text: str) -> str:
    """An argparse ``type`` for text a tokenizer will read (``--prompt``): refused unless valid UTF-8."""
    try:
        utf8(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def seed_list(text: str) -> list[int]:
    """An argparse ``type`` for a ``--seeds``: distinct comma-separated seeds, each as `seed_arg` takes."""
    seeds = [seed_arg(v.strip()) for v in text.split(",") if v.strip()]
    if not seeds:
        raise argparse.ArgumentTypeError(f"expected comma-separated seeds, got {text!r}")
    if len(set(seeds)) != len(seeds):
        raise argparse.ArgumentTypeError(f"expected distinct seeds, got {text!r}")
    return seeds


def check_distinct(name: str, values: Iterable[Any]) -> None:
    """ValueError naming ``name`` when a value repeats (an axis of a study given twice)."""
    values = list(values)
    if len(set(values)) != len(values):
        raise ValueError(f"{name} has duplicates: {values}")


def check_int(name: str, value: Any, minimum: int = 1, *, none_ok: bool = False) -> None:
    """Raise a ValueError naming `name` unless `value` is an int (not a bool) >= `minimum`, or None where
    `none_ok`. `name` is the value as the user knows it, e.g. "TitansConfig.dim"."""
    if value is None and none_ok:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        what = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
        raise ValueError(f"{name} must be {what}{' or None' if none_ok else ''}, got {value!r}")


def check_bool(name: str, value: Any) -> None:
    """Raise a ValueError naming `name` unless `value` is a bool: a string "false" is truthy, so a switch
    given one would silently be on."""
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be a bool (true or false), got {value!r}")


def option(
    default: Any = dataclasses.MISSING,
    *,
    help: str,
    factory: Callable[[], Any] | None = None,
    min: float | None = None,
    above: float | None = None,
    max: float | None = None,
    below: float | None = None,
    compare: bool = True,
    **extra: Any,
) -> Any:
    """A dataclass field that carries its one-line ``help`` and its bounds in its metadata (``min`` /
    ``max``: inclusive, ``above`` / ``below``: exclusive; `check_bounds` enforces them, None passes where
    the field's type allows it). ``extra`` goes into the metadata too (e.g. ``memory_arg``)."""
    bounds = {"min": min, "above": above, "max": max, "below": below}
    metadata = {"help": help, **{k: v for k, v in bounds.items() if v is not None}, **extra}
    if factory is not None:
        return dataclasses.field(default_factory=factory, compare=compare, metadata=metadata)
    return dataclasses.field(default=default, compare=compare, metadata=metadata)


def field_help(cls: type) -> dict[str, str]:
    """{field name: its one-line help} of a dataclass whose fields are all `option`s."""
    return {f.name: f.metadata["help"] for f in dataclasses.fields(cls)}


def describe_bounds(meta: Any) -> str:
    """``>= 0``, ``> 0``, ``in (0, 1)``, ``in [0, 1]``, ... from a field's metadata ("" where unbounded)."""
    low = ("[", meta["min"]) if "min" in meta else ("(", meta["above"]) if "above" in meta else None
    high = ("]", meta["max"]) if "max" in meta else (")", meta["below"]) if "below" in meta else None
    if low and high:
        return f"in {low[0]}{low[1]}, {high[1]}{high[0]}"
    if low:
        return f"{'>=' if low[0] == '[' else '>'} {low[1]}"
    if high:
        return f"{'<=' if high[0] == ']' else '<'} {high[1]}"
    return ""


def _declared(f: dataclasses.Field) -> list[str]:
    """The parts of a field's declared type: ``["int", "None"]`` for ``int | None`` (the annotation's text
    under postponed annotations)."""
    tp = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
    return tp.replace(" ", "").replace("Optional[", "").rstrip("]").split("|")


def check_bounds(obj: Any) -> None:
    """Raise a ValueError naming the field (``Class.field must be ..., got value``) for the first field of
    the dataclass ``obj`` outside the bounds its metadata gives (`option`), or declared ``bool`` and not
    holding one (a string "false" is truthy). A bounded value must be a finite number (an int where the
    field is declared one); None passes where the type allows it."""
    owner = type(obj).__name__
    for f in dataclasses.fields(obj):
        if _declared(f) == ["bool"]:
            check_bool(f"{owner}.{f.name}", getattr(obj, f.name))
        if not any(k in f.metadata for k in _BOUNDS):
            continue
        value = getattr(obj, f.name)
        declared = _declared(f)
        none_ok = "None" in declared
        if value is None and none_ok:
            continue
        whole = "int" in declared
        lo = f.metadata.get("min", f.metadata.get("above"))
        hi = f.metadata.get("max", f.metadata.get("below"))
        ok = (
            not isinstance(value, bool)
            and isinstance(value, int if whole else (int, float))
            and math.isfinite(value)
            and (lo is None or (value >= lo if "min" in f.metadata else value > lo))
            and (hi is None or (value <= hi if "max" in f.metadata else value < hi))
        )
        if not ok:
            if whole and f.metadata.get("min") == 1 and hi is None:
                what = "a positive integer"
            else:
                what = f"{'an integer' if whole else 'a number'} {describe_bounds(f.metadata)}"
            raise ValueError(f"{owner}.{f.name} must be {what}{' or null' if none_ok else ''}, got {value!r}")


__all__ = [
    "check_bool",
    "check_bounds",
    "check_int",
    "describe_bounds",
    "did_you_mean",
    "field_help",
    "option",
]
