"""Checks shared by the deploy and serve configs."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

__all__ = ["require_finite"]


def _numbers(value: Any) -> list[float]:
    if isinstance(value, bool) or value is None:
        return []
    if isinstance(value, int | float):
        return [float(value)]
    if isinstance(value, list | tuple):
        return [v for item in value for v in _numbers(item)]
    return []


def require_finite(config: Any, section: str) -> None:
    """Raise ``ValueError`` naming ``section.key`` when a numeric field of the dataclass
    ``config`` (a number or a list of numbers) is NaN or infinite. Nested dataclasses check
    themselves."""
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if any(not math.isfinite(v) for v in _numbers(value)):
            key = f"{section}.{f.name}" if section else f.name
            raise ValueError(f"{key} must be finite, got {value!r}")
