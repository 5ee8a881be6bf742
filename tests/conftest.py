"""Settings every test session under `tests/` shares."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator

import pytest

# pytest rewrites the asserts of every test module it imports (about 500 here) and keeps the
# result in __pycache__ only where Python may write bytecode. Where PYTHONDONTWRITEBYTECODE is
# set (some containers set it) every session, and every xdist worker of it, redid all of it:
# about 6 s of each collection on 2 cores. __pycache__ is ignored by git. The node processes
# the tests spawn inherit the environment, so they keep their bytecode too.
sys.dont_write_bytecode = False
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)


def pytest_configure(config: object) -> None:
    """Under xdist, each worker's torch gets its share of the cores, not all of them: two
    workers of two threads each on two cores made every GEMM-heavy test wait on the other's
    threads (the HF reference tests ran 5 s alone and 26 s beside another worker). Only this
    process: the node processes a test spawns choose their own threads."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        import torch

        torch.set_num_threads(max(1, (os.cpu_count() or 1) // workers))


# Files whose tests mostly wait (faults held for seconds, requests at a fixed rate): run first,
# so that their waiting overlaps the CPU-bound tests. Collected where they sort (near the end),
# the last of them ran alone for the suite's last minute with the machine ~10% busy.
WAITING_FIRST = ("tests/test_load.py", "tests/test_load_http.py")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Move WAITING_FIRST's tests to the front (xdist hands out files in this order)."""
    def waits(item: pytest.Item) -> bool:
        return item.nodeid.split("::")[0] in WAITING_FIRST

    items[:] = [i for i in items if waits(i)] + [i for i in items if not waits(i)]


KERNEL_TEST_THREADS = 4  # more than this 2-core machine has: the split is what is tested


@pytest.fixture
def several_threads() -> Iterator[int]:
    """torch's thread count at KERNEL_TEST_THREADS for one test, restored after: the C kernels
    split their rows over that many OpenMP threads, and a test of the split must not depend on
    how many xdist workers share the machine (each gets its share above). Returns the count."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(KERNEL_TEST_THREADS)
    try:
        yield KERNEL_TEST_THREADS
    finally:
        torch.set_num_threads(before)
