"""Configuration fields that carry their own documentation.

Every key of a run's configuration is a field of a frozen dataclass, made with ``setting``:
its ``doc`` is the one description of the key. docs/config.md's reference is generated from
these (diloco/cli/config_doc.py, scripts/gen_config_doc.py), and a test checks conf/*.yaml
against the dataclasses, so a key is described once and cannot drift.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any, TypeVar

E = TypeVar("E", bound=enum.Enum)


def setting(default: Any = dataclasses.MISSING, *, doc: str, factory: Any = dataclasses.MISSING) -> Any:
    """A dataclass field documented by ``doc`` (what the key means, its unit, what null means)."""
    if factory is not dataclasses.MISSING:
        return dataclasses.field(default_factory=factory, metadata={"doc": doc})
    return dataclasses.field(default=default, metadata={"doc": doc})


def doc_of(cls: type, name: str) -> str:
    """The ``doc`` of field ``name`` of dataclass ``cls`` ("" when it has none)."""
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        if f.name == name:
            return str(f.metadata.get("doc", ""))
    raise KeyError(f"{cls.__name__} has no field {name!r}")


def choice(kind: type[E], value: object, key: str) -> E:
    """``value`` as a member of the enum ``kind`` (from the member or its string value), or
    ValueError naming ``key`` and the allowed values."""
    if isinstance(value, kind):
        return value
    try:
        return kind(value)
    except ValueError:
        allowed = ", ".join(str(m.value) for m in kind)
        raise ValueError(f"{key}={value!r}: must be one of {allowed}") from None


def integer(value: object, key: str, low: int, high: int | None = None) -> int:
    """``value`` if it is an int (not a bool) in [low, high], else ValueError naming ``key``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < low or (high is not None and value > high):
        bound = f">= {low}" if high is None else f"in {low}..{high}"
        raise ValueError(f"{key}={value!r}: must be an integer {bound}")
    return value


def fraction(value: object, key: str, *, none: str | None = None) -> float | None:
    """``value`` as a float in [0, 1] (None allowed when ``none`` says what it means), else
    ValueError naming ``key``."""
    if value is None and none is not None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
        also = f"null ({none}) or " if none is not None else ""
        raise ValueError(f"{key}={value!r}: must be {also}a number in [0, 1]")
    return float(value)
