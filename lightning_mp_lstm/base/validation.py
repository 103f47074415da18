"""The checks every option of the library needs, written once: the message names the option, the value and what is
allowed."""

from __future__ import annotations

import math
from typing import Any

__all__ = ["check_bool", "check_positive_int", "check_positive_number"]


def check_positive_int(name: str, value: Any, error: type[Exception] = ValueError, also: tuple[Any, ...] = ()) -> Any:
    """``value`` if it is an integer >= 1 (``bool`` is not) or one of ``also`` (e.g. ``"auto"``); else raise
    ``error`` naming ``name``, the value and what is allowed."""
    if value in also and not isinstance(value, bool):
        return value
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        extra = "".join(f" or {option!r}" for option in also)
        raise error(f"{name} must be a positive integer{extra}, got {value!r}")
    return value


def check_positive_number(name: str, value: Any, error: type[Exception] = ValueError) -> float:
    """``value`` as a float if it is a finite number > 0 (``bool`` is not); else raise ``error`` naming it."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise error(f"{name} must be a positive number, got {value!r}")
    return float(value)


def check_bool(name: str, value: Any, error: type[Exception] = ValueError) -> bool:
    """``value`` if it is ``True`` or ``False``; else raise ``error`` naming ``name`` and the value."""
    if not isinstance(value, bool):
        raise error(f"{name} must be True or False, got {value!r}")
    return value
