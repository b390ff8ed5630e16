"""Records looked up by name (model families, their torch halves): added once each, an unknown name a
ConfigError that names the key, the value and the names there are."""

from __future__ import annotations

from typing import Generic, TypeVar

from hp_tool.errors import ConfigError

R = TypeVar("R")


class Registry(Generic[R]):
    """Name -> record, in the order they were added."""

    def __init__(self, what: str):
        self.what = what  # what a record is, for messages ("model family")
        self._records: dict[str, R] = {}

    def add(self, name: str, record: R) -> R:
        """Add ``record`` under ``name``; a name added twice is a programming error."""
        if name in self._records:
            raise ValueError(f"{self.what} {name!r} is registered twice")
        self._records[name] = record
        return record

    def items(self) -> list[tuple[str, R]]:
        return list(self._records.items())

    def get(self, name: str, key: str, problem: str, fix_also: str = "") -> R:
        """The record of ``name``; a ConfigError naming ``key`` and the known names when there is none."""
        try:
            return self._records[name]
        except KeyError:
            raise ConfigError(key, name, problem, f"use one of {list(self._records)}{fix_also}") from None
