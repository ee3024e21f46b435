"""A table of named functions filled by a decorator: the allocation strategies and the CoBA solvers.

SOLVERS = Registry[SolverFn]("CoBA solver")
@SOLVERS.register("heap")
def heap(...): ...
SOLVERS.get("heap"), SOLVERS.names()   # the function (None if unknown), the sorted names
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

F = TypeVar("F", bound=Callable)


class Registry(Generic[F]):
    """Functions by name; ``kind`` names them in the error when a name is registered twice."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._fns: dict[str, F] = {}

    def register(self, name: str) -> Callable[[F], F]:
        """Decorator: register a function under ``name``; a name taken already is refused."""

        def wrap(fn: F) -> F:
            if name in self._fns:
                raise ValueError(f"{self.kind} {name!r} is already registered")
            self._fns[name] = fn
            return fn

        return wrap

    def names(self) -> list[str]:
        """The registered names, sorted."""
        return sorted(self._fns)

    def get(self, name: str) -> F | None:
        """The function registered under ``name``, or None."""
        return self._fns.get(name)

    def __getitem__(self, name: str) -> F:
        return self._fns[name]
