"""The check every args dataclass runs when it is built: a Literal-typed field holds one of its Literal's
values (an unknown kind is refused, never read as another). Its own module so that the args modules
beside models/args.py (mixer_args, hyper_args, ...) use it without importing models.args."""

from __future__ import annotations

import functools
import typing
from dataclasses import fields
from typing import Literal


def check_kinds(obj) -> None:
    """ValueError naming the field when a Literal-typed field of the dataclass `obj` holds a value
    outside its Literal (an unknown kind is refused when the args are built, never read as another)."""
    for name, allowed in _kinds(type(obj)).items():
        value = getattr(obj, name)
        if value not in allowed:
            raise ValueError(f"{type(obj).__name__}.{name}: {value!r} is not one of {', '.join(map(repr, allowed))}")


@functools.cache
def _kinds(cls) -> dict:
    hints = typing.get_type_hints(cls)
    return {f.name: typing.get_args(hints[f.name]) for f in fields(cls) if typing.get_origin(hints[f.name]) is Literal}
