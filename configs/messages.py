"""Pydantic's validation errors as one line for the user: the dotted key, the value as given, and what the
field allows in words (from its type, bounds and `Allowed` metadata). Used by configs/schema.py only."""

from __future__ import annotations

import contextlib
import math
import re
import types
from typing import Annotated, Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import ErrorDetails, PydanticCustomError

_FLOAT_RE = re.compile(r"[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?")


class Allowed(str):
    """Field metadata: what the field accepts, in words, where its bounds alone would not say it."""


def finite_number(value: Any) -> float:
    """A finite float from an int, a float or a numeric string (PyYAML reads "1e-3" as a string); no bool."""
    numeric = isinstance(value, int | float) and not isinstance(value, bool)
    if numeric or (isinstance(value, str) and _FLOAT_RE.fullmatch(value.strip())):
        with contextlib.suppress(OverflowError):  # an int too large for a float is not a number here
            if math.isfinite(out := float(value)):
                return out
    raise PydanticCustomError("config_number", "not a finite number")


def unwrap(annotation: Any, metadata: list[Any]) -> tuple[Any, list[Any], bool]:
    """(bare type, all its metadata, nullable) of a field's annotation: `X | None` and Annotated peeled."""
    tp, meta, nullable = annotation, list(metadata), False
    if get_origin(tp) in (Union, types.UnionType):
        inner = [a for a in get_args(tp) if a is not type(None)]
        tp, nullable = inner[0], len(inner) < len(get_args(tp))
    while get_origin(tp) is Annotated:
        tp, *extra = get_args(tp)
        for m in extra:
            meta.extend(m.metadata if isinstance(m, FieldInfo) else [m])
    return tp, meta, nullable


def _words(tp: Any, meta: list[Any]) -> str:
    """What a scalar field accepts, in words, from its type and bounds."""
    if tp is bool:
        return "true or false"
    if tp is str:
        return "a non-empty string" if any(getattr(m, "min_length", 0) for m in meta) else "a string"
    if get_origin(tp) is tuple:
        return f"a list of {len(get_args(tp))} values"
    noun = "an integer" if tp is int else "a number"
    b = {k: v for m in meta for k in ("gt", "ge", "lt", "le") if (v := getattr(m, k, None)) is not None}
    lo, hi = next((k for k in ("gt", "ge") if k in b), ""), next((k for k in ("lt", "le") if k in b), "")
    if lo and hi:
        if (lo, hi) == ("gt", "lt"):
            return f"{noun} in the open interval ({b[lo]}, {b[hi]})"
        return f"{noun} in {'(['[lo == 'ge']}{b[lo]}, {b[hi]}{')]'[hi == 'le']}"
    sign = {"gt": ">", "ge": ">=", "lt": "<", "le": "<="}
    return f"{noun} {sign[lo or hi]} {b[lo or hi]}" if lo or hi else noun


def expected(info: FieldInfo) -> str:
    """The "expected ..." / "allowed values are ..." part of a field's error message."""
    tp, meta, nullable = unwrap(info.annotation, info.metadata)
    if get_origin(tp) is Literal:
        return f"allowed values are {', '.join(map(repr, get_args(tp)))}"
    words = next((str(m) for m in meta if isinstance(m, Allowed)), None) or _words(tp, meta)
    words += " or null" if nullable else ""
    words += f" ({info.description})" if info.description else ""
    return f"expected {words}"


def message(e: ErrorDetails, data: dict[str, Any], root: type[BaseModel]) -> str:
    """One line for the first error: `key = value is invalid: expected ...`, or the unknown key."""
    model: type[BaseModel] = root
    path: list[str] = []
    info: FieldInfo | None = None
    raw: Any = data  # the value as given, walked along with the key
    for part in e["loc"]:
        if info is not None:
            break  # inside a field's value (an element of a list): the field is what gets reported
        name = str(part)
        if name not in model.model_fields:
            keys = ", ".join(sorted(model.model_fields))
            shown = ".".join([*path, name])
            if not name or not shown.isprintable() or " " in shown:  # an empty or odd key: quoted
                shown = repr(shown)
            return f"unknown key {shown}; allowed keys: {keys}"
        path.append(name)
        info, raw = (
            model.model_fields[name],
            raw.get(name, e["input"]) if isinstance(raw, dict) else e["input"],
        )
        if isinstance(sub := info.annotation, type) and issubclass(sub, BaseModel):
            model, info = sub, None  # a section: go on into it
    where = ".".join(path) or "config"
    if e["type"] == "config_rule":
        ctx = e.get("ctx") or {}
        return f"{'.'.join([*path, ctx['field']])} = {ctx['value']!r} is invalid: expected {ctx['allowed']}"
    if info is None:
        if e["type"] == "model_type":
            return f"{where} must be a mapping, got {type(e['input']).__name__}"
        return f"{where} is invalid: {e['msg']}"
    if unwrap(info.annotation, info.metadata)[0] is float:
        with contextlib.suppress(PydanticCustomError):
            raw = finite_number(raw)  # shown as the number it stands for: `algo.rho=0` -> 0.0
    return f"{where} = {raw!r} is invalid: {expected(info)}"
