"""Fixtures for the messenger tests: `make_harness` builds `Harness`es and closes them after."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from tests.disagg.kv_transfer.messenger_harness import Harness

MakeHarness = Callable[..., Harness]


@pytest.fixture
def make_harness() -> Iterator[MakeHarness]:
    """Factory: `make_harness(**Harness fields) -> Harness`; every one is closed at teardown."""
    made: list[Harness] = []

    def make(**kwargs: Any) -> Harness:
        made.append(Harness(**kwargs))
        return made[-1]

    yield make
    for harness in made:
        harness.close()
