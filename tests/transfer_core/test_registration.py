"""A `TransferEngine`'s registered memory (`transfer_core.registration`, S5): each region
registered with every domain and named, the only sources a write may take, and all closed
with the engine."""

from __future__ import annotations

import numpy as np
import pytest

from transfer_core.engine import TransferEngine

PAGE = 4096


def test_regions_are_named_in_order_and_registered_with_every_domain() -> None:
    with TransferEngine("shm", num_domains=2) as engine:
        first, desc = engine.register_memory(np.zeros(PAGE, np.uint8))
        second, _ = engine.register_memory(np.zeros(PAGE, np.uint8))
        named, _ = engine.register_memory(np.zeros(PAGE, np.uint8), "kv")
        assert [first.name, second.name, named.name] == ["mr0", "mr1", "kv"]
        assert len(first.registrations) == len(desc.domains) == 2


def test_an_unregistered_region_is_closed_and_no_write_source() -> None:
    with TransferEngine("shm") as a, TransferEngine("shm") as b:
        src, _ = a.register_memory(np.zeros(PAGE, np.uint8))
        _, dst = b.register_memory(np.zeros(PAGE, np.uint8))
        a.unregister_memory(src)
        assert src.closed
        with pytest.raises(ValueError, match="'mr0' is not registered"):
            a.post_write(src, 0, PAGE, 1, dst, 0)
        with pytest.raises(ValueError, match="'mr0' is not registered"):
            a.unregister_memory(src)


def test_a_region_of_another_engine_is_no_write_source() -> None:
    with TransferEngine("shm") as a, TransferEngine("shm") as b:
        theirs, _ = b.register_memory(np.zeros(PAGE, np.uint8))
        ours, _ = a.register_memory(np.zeros(PAGE, np.uint8))  # also named mr0
        _, dst = b.register_memory(np.zeros(PAGE, np.uint8))
        with pytest.raises(ValueError, match="not registered with this engine"):
            a.post_write(theirs, 0, PAGE, 1, dst, 0)
        assert ours.name == theirs.name


def test_closing_the_engine_closes_every_region_left() -> None:
    engine = TransferEngine("shm", num_domains=2)
    regions = [engine.register_memory(np.zeros(PAGE, np.uint8))[0] for _ in range(3)]
    engine.unregister_memory(regions[1])
    engine.close()
    assert all(region.closed for region in regions)
