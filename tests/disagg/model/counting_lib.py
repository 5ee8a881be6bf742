"""A kernel module's cffi library for tests that count what reaches C (X8)."""

from __future__ import annotations

from typing import Any


class CountingLib:
    """Stands in for a module's `lib`: each call of `function` is recorded as the arguments
    `shape` picks (the sizes it was handed) and passed on to the real library; every other
    name is the real library's."""

    def __init__(self, lib: Any, function: str, shape: slice) -> None:  # noqa: ANN401
        self._lib, self._function, self._shape = lib, function, shape
        self.calls: list[tuple[Any, ...]] = []

    def __getattr__(self, name: str) -> Any:  # noqa: ANN401 - a cffi function
        real = getattr(self._lib, name)
        if name != self._function:
            return real

        def counted(*args: Any) -> Any:  # noqa: ANN401
            self.calls.append(args[self._shape])
            return real(*args)
        return counted
