"""Typed config fields: the declared type of a dataclass field, a command-line text parsed against it, a JSON
value checked against it, and a one-line description for listings.

    parse_field_text(TrainConfig, "lr", "1e-3")         -> 0.001
    parse_field_text(TrainConfig, "lr", "true")         -> ValueError: ... expected a float, got 'true'
    check_field_value(TitansConfig, "memory_depth", 2)  -> 2

Types understood: ``int``, ``float`` (an int is fine, a bool is not a number), ``bool`` (true / false),
``str``, ``list[...]`` of those, ``dict[str, Any]`` (a JSON object) and ``X | None`` (``null`` for None).
On the command line a list is JSON (``[400, 600]``), comma-separated (``400,600``) or a single item
(``600``, the list ``[600]``).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import operator
import types
import typing
from functools import cache
from typing import Any

_NONE_WORDS = ("null", "none")
_BOOL_WORDS = {"true": True, "false": False}


@cache
def field_types(cls: type) -> dict[str, Any]:
    """{field name: resolved type annotation} of a dataclass."""
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _split_optional(tp: Any) -> tuple[Any, bool]:
    """(the type without None, whether None is allowed)."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        optional = len(args) < len(typing.get_args(tp))
        return (args[0] if len(args) == 1 else functools.reduce(operator.or_, args)), optional
    return tp, False


def type_name(tp: Any) -> str:
    """``int``, ``float or null``, ``list[int] or null``, ``bool``, ..."""
    inner, optional = _split_optional(tp)
    origin = typing.get_origin(inner)
    if origin is list:
        (item,) = typing.get_args(inner) or (Any,)
        name = f"list[{type_name(item)}]"
    elif origin is dict:
        name = "JSON object"
    elif inner is Any:
        name = "any"
    else:
        name = getattr(inner, "__name__", str(inner))
    return f"{name} or null" if optional else name


class FieldTypeError(ValueError):
    """A value that does not fit a field's declared type."""


def _fail(label: str, tp: Any, value: Any) -> FieldTypeError:
    name = type_name(tp)
    article = "an" if name[0] in "aeiou" else "a"
    return FieldTypeError(f"{label}: expected {article} {name}, got {value!r}")


def _check(tp: Any, value: Any) -> tuple[bool, Any]:
    """(fits, the value as the field holds it: an int for a float field becomes a float)."""
    inner, optional = _split_optional(tp)
    if value is None:
        return optional, None
    origin = typing.get_origin(inner)
    if inner is Any:
        return True, value
    if inner is bool:
        return isinstance(value, bool), value
    if inner is int:
        return isinstance(value, int) and not isinstance(value, bool), value
    if inner is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        return ok, float(value) if ok else value
    if inner is str:
        return isinstance(value, str), value
    if origin is list:
        (item,) = typing.get_args(inner) or (Any,)
        if not isinstance(value, (list, tuple)):
            return False, value
        checked = [_check(item, v) for v in value]
        return all(ok for ok, _ in checked), [v for _, v in checked]
    if origin is dict:
        return isinstance(value, dict), value
    return isinstance(value, inner) if isinstance(inner, type) else True, value


def check_field_value(cls: type, name: str, value: Any, label: str | None = None) -> Any:
    """``value`` (from JSON or Python) if it fits the declared type of ``cls.name``; an int given for a
    float field comes back as a float. Raises FieldTypeError naming the field, its type and the value."""
    tp = field_types(cls)[name]
    ok, value_out = _check(tp, value)
    if not ok:
        raise _fail(label or f"{cls.__name__}.{name}", tp, value)
    return value_out


def _parse_scalar(tp: Any, text: str) -> tuple[bool, Any]:
    s = text.strip()
    if tp is bool:
        word = s.lower()
        return (word in _BOOL_WORDS), _BOOL_WORDS.get(word)
    if tp is int:
        try:
            return True, int(s)
        except ValueError:
            pass
        try:  # 1e3: a whole number written as a float
            f = float(s)
        except ValueError:
            return False, None
        return (math.isfinite(f) and f.is_integer()), int(f) if math.isfinite(f) else None
    if tp is float:
        if s.lower() in _BOOL_WORDS:
            return False, None
        try:
            f = float(s)
        except ValueError:
            return False, None
        return math.isfinite(f), f
    if tp is str:
        if len(s) >= 2 and s[0] == s[-1] == '"':  # a JSON string: "text"
            try:
                return True, json.loads(s)
            except json.JSONDecodeError:
                pass
        return True, text
    return False, None


def parse_text(tp: Any, text: str) -> tuple[bool, Any]:
    """Parse command-line ``text`` as type ``tp``: (fits, value)."""
    inner, optional = _split_optional(tp)
    if optional and text.strip().lower() in _NONE_WORDS:
        return True, None
    origin = typing.get_origin(inner)
    if origin is list or origin is dict or inner is Any:
        # lists as JSON ([1, 2]), comma-separated (1,2) or one item (600: [600]); objects as JSON
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            if origin is not list:
                return (inner is Any), text
            (item,) = typing.get_args(inner) or (Any,)
            parts = [parse_text(item, p) for p in text.split(",") if p.strip()]
            return all(ok for ok, _ in parts), [v for _, v in parts]
        if origin is list and value is not None and not isinstance(value, (list, dict)):
            (item,) = typing.get_args(inner) or (Any,)
            ok, one = parse_text(item, text)  # a single item, read as the comma-separated items are
            return ok, [one]
        return _check(inner, value)
    return _parse_scalar(inner, text)


def parse_field_text(cls: type, name: str, text: str, label: str | None = None) -> Any:
    """The value of ``cls.name`` written as ``text`` on the command line (``null`` for None where the field
    allows it). Raises FieldTypeError naming the field, its type and the text."""
    tp = field_types(cls)[name]
    ok, value = parse_text(tp, text)
    if not ok:
        raise _fail(label or f"{cls.__name__}.{name}", tp, text)
    return value


def describe_fields(
    cls: type, descriptions: dict[str, str], prefix: str = "", skip: tuple[str, ...] = ()
) -> list[tuple[str, str, str, str]]:
    """(name, type, default, description) of every field of a dataclass, in declaration order."""
    rows = []
    types_ = field_types(cls)
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        if f.default is not dataclasses.MISSING:
            default = f.default
        elif f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        else:
            default = None
        rows.append((prefix + f.name, type_name(types_[f.name]), json.dumps(default), descriptions[f.name]))
    return rows


__all__ = [
    "FieldTypeError",
    "check_field_value",
    "describe_fields",
    "field_types",
    "parse_field_text",
    "parse_text",
    "type_name",
]
