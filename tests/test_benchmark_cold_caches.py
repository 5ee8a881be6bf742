"""benchmarks/cold_caches.py: a decode step's small operations timed hot and right after a read
of each size, the way a step reads its weights."""

from __future__ import annotations

import json
from types import ModuleType
from unittest import mock

import pytest

from tests.benchmark_modules import load_benchmark


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    load_benchmark("result_output")
    return load_benchmark("cold_caches")


def test_a_run_has_a_row_per_size_and_operation(bench: ModuleType,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    result = bench.main(["--sizes-mib", "0", "1", "--reps", "2", "--json"])
    names = list(bench.operations())
    assert [(row["streamed_mib"], row["operation"]) for row in result["rows"]] == \
        [(size, name) for size in (0, 1) for name in names]
    assert all(row["us_median"] > 0 for row in result["rows"])
    assert all(row["over_hot"] == 1.0 for row in result["rows"] if row["streamed_mib"] == 0)
    assert json.loads(capsys.readouterr().out)["rows"] == result["rows"]


def test_each_timed_run_follows_a_full_read_of_the_buffer(bench: ModuleType) -> None:
    buffer, order = mock.Mock(), []
    buffer.sum.side_effect = lambda: order.append("read")
    bench.time_after(lambda: order.append("op"), buffer, 3)
    assert order == ["read", "op"] * 3
