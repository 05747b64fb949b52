"""A name -> object registry, filled where each object is defined.

Usage:

    ADVANTAGES = Registry("advantage estimator")

    @ADVANTAGES.register("gae")
    def gae(...): ...

    ADVANTAGES["gae"]    # the function
    ADVANTAGES["gea"]    # UnknownNameError: unknown advantage estimator 'gea'
                         # (did you mean 'gae'?); known: gae, grpo, reinforce_pp, rloo
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

T = TypeVar("T")


class UnknownNameError(KeyError, ValueError):
    """A name that is not in a registry. Both a ``KeyError`` and a ``ValueError``."""

    def __str__(self) -> str:  # KeyError would print the message quoted
        return str(self.args[0])


class Registry(Generic[T]):
    """Maps names to objects (functions, presets).

    Args:
        kind: what the entries are, used in error messages ("advantage estimator", ...).
    """

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._entries: dict[str, T] = {}

    def add(self, name: str, obj: T) -> T:
        """Registers ``obj`` under ``name``; a name can be registered only once."""
        if name in self._entries:
            raise ValueError(f"{self.kind} {name!r} is already registered")
        self._entries[name] = obj
        return obj

    def register(self, name: str) -> Callable[[T], T]:
        """Decorator form of :meth:`add`: ``@REGISTRY.register("name")``."""

        def decorator(obj: T) -> T:
            return self.add(name, obj)

        return decorator

    def names(self) -> list[str]:
        """The registered names, sorted."""
        return sorted(self._entries)

    def __getitem__(self, name: str) -> T:
        if name in self._entries:
            return self._entries[name]
        close = difflib.get_close_matches(name, self.names(), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        known = ", ".join(self.names()) or "none"
        raise UnknownNameError(f"unknown {self.kind} {name!r}{hint}; known: {known}")

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}, names={self.names()})"
