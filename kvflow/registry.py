"""The one registry shape: a name -> `"module:attribute"` table, imported on first lookup.

Every pluggable part of kvflow (executors, models, attention backends, and what comes next: structured-output
backends, tool parsers, reasoning parsers, speculative proposers, quantization methods) is a `LazyRegistry`. A
registry module holds only names and import paths, never imports what it names at module level, so registries can
never take part in an import cycle and an optional dependency (Ray, xgrammar) is imported only when its entry is used.

Invariants: names are unique; `get(name)` either returns the attribute the table names or raises ValueError naming
the registry's `kind`, the unknown name and every registered one; a failed import of a registered entry is an
ImportError naming the entry (never a silent fallback).
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator, Mapping
from typing import Generic, TypeVar

T = TypeVar("T")


class LazyRegistry(Generic[T]):
    """Names of one `kind` of part (e.g. "attention backend") -> "module:attribute", imported when looked up."""

    def __init__(self, kind: str, entries: Mapping[str, str]) -> None:
        self.kind = kind
        self._targets: dict[str, str] = {}
        for name, target in entries.items():
            self.register(name, target)

    def register(self, name: str, target: str) -> None:
        """Add `name` -> `target` ("package.module:attribute"); a name is registered once."""
        module_name, sep, attribute = target.partition(":")
        if not sep or not module_name or not attribute:
            raise ValueError(
                f"{self.kind} {name!r}: target must be 'module:attribute', got {target!r}"
            )
        existing = self._targets.get(name)
        if existing is not None and existing != target:
            raise ValueError(f"{self.kind} {name!r} is already registered ({existing})")
        self._targets[name] = target

    def names(self) -> tuple[str, ...]:
        """The registered names, in registration order."""
        return tuple(self._targets)

    def __contains__(self, name: object) -> bool:
        return name in self._targets

    def __iter__(self) -> Iterator[str]:
        return iter(self._targets)

    def target(self, name: str) -> str:
        """The "module:attribute" string `name` is registered as (ValueError for an unknown name)."""
        target = self._targets.get(name)
        if target is None:
            raise ValueError(self.unknown_message(name))
        return target

    def get(self, name: str) -> T:
        """The attribute `name` is registered as, imported now (ValueError for an unknown name)."""
        module_name, _, attribute = self.target(name).partition(":")
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:
            raise ImportError(
                f"{self.kind} {name!r} needs {module_name!r}, which failed to import: {exc}"
            ) from exc
        return getattr(module, attribute)

    def unknown_message(self, name: object) -> str:
        """The error text for a name this registry does not hold."""
        return f"unknown {self.kind} {name!r}; available: {', '.join(self._targets)}"
