"""One registry helper for every name -> thing table (jobs, optimizers, schedules, ...).

An unknown name is a `ConfigError` that lists the known names. A name of the form
``package.module:Attribute`` (or ``package.module.Attribute``) is imported instead, so users
can plug their own classes in from config without touching runner.
"""

from __future__ import annotations

import importlib
from typing import Callable, Generic, Iterator, TypeVar

from runner.errors import ConfigError

T = TypeVar("T")


def plural(kind: str) -> str:
    """'model family' -> 'model families', 'optimizer' -> 'optimizers'."""
    return kind[:-1] + "ies" if kind.endswith("y") else kind + "s"


class Registry(Generic[T]):
    """A named table of things of one kind, filled with the ``register`` decorator."""

    def __init__(self, kind: str, key: str, allow_import_paths: bool = True) -> None:
        self.kind = kind  # e.g. "optimizer"
        self.key = key  # the config key that selects from it, e.g. "optimizer.name"
        self.allow_import_paths = allow_import_paths
        self._items: dict[str, T] = {}

    def register(self, name: str) -> Callable[[T], T]:
        def add(thing: T) -> T:
            if name in self._items and self._items[name] is not thing:
                raise ValueError(f"{self.kind} {name!r} is registered twice")
            self._items[name] = thing
            return thing

        return add

    def names(self) -> list[str]:
        return sorted(self._items)

    def __contains__(self, name: object) -> bool:
        return name in self._items

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def is_import_path(self, name: str) -> bool:
        return self.allow_import_paths and (":" in name or "." in name)

    def get(self, name: str) -> T:
        if name in self._items:
            return self._items[name]
        if self.is_import_path(name):
            return self._import(name)
        raise ConfigError(
            self.key,
            name,
            f"there is no {self.kind} of that name.",
            f"use one of: {', '.join(self.names())}"
            + (" (or an import path such as `my_pkg.module:MyClass`)." if self.allow_import_paths else "."),
        )

    def _import(self, path: str) -> T:
        module_name, _, attr = path.partition(":") if ":" in path else path.rpartition(".")
        try:
            module = importlib.import_module(module_name)
        except ImportError as err:
            raise ConfigError(
                self.key, path, f"module {module_name!r} cannot be imported ({err}).",
                "check the import path and that the module is on PYTHONPATH.",
            ) from None
        try:
            return getattr(module, attr)
        except AttributeError:
            raise ConfigError(
                self.key, path, f"module {module_name!r} has no attribute {attr!r}.",
                f"name one of the {plural(self.kind)} defined there, or one of: {', '.join(self.names())}.",
            ) from None
