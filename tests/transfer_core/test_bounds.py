"""Bounds checks: a write outside its registered region is refused before posting (S5)."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

from transfer_core.engine import TransferEngine
from transfer_core.errors import BoundsError
from transfer_core.memory import MemoryRegion, MemoryRegionDescriptor, check_pages, check_range
from transfer_core.transport import PagedWrite

PAGE = 4096
NUM_PAGES = 16
Regions = tuple[MemoryRegion, MemoryRegionDescriptor]


def test_check_range_accepts_exact_fit() -> None:
    """An access ending exactly at the region end is inside."""
    check_range("r", 100, 60, 40)


@pytest.mark.parametrize(("offset", "length"), [(61, 40), (-1, 1), (0, 101)])
def test_check_range_names_region_and_offset(offset: int, length: int) -> None:
    """The error names the region and the offending offset."""
    with pytest.raises(BoundsError, match=rf"'kv'.*offset {offset}"):
        check_range("kv", 100, offset, length)


def test_check_pages_accepts_last_page() -> None:
    """Page indices up to the last whole page fit, few of them or many."""
    check_pages("r", NUM_PAGES * PAGE, np.arange(NUM_PAGES), PAGE, 0, PAGE)
    check_pages("r", NUM_PAGES * PAGE, np.arange(100) % NUM_PAGES, PAGE, 0, PAGE)


@pytest.mark.parametrize(
    ("indices", "offset", "bad_entry"),
    [([0, 3, 16, 2], 0, 2), ([5, -1], 0, 1), ([0, 15], 1, 1)],
    ids=["past-end", "negative", "offset-pushes-out"],
)
@pytest.mark.parametrize("pad", [0, 96], ids=["few-ids", "many-ids"])
def test_check_pages_names_first_bad_page(indices: list[int], offset: int, bad_entry: int,
                                          pad: int) -> None:
    """The first offending entry of the index array is named with its byte offset, whether
    the ids are few (checked in Python) or many (numpy), valid ids before it or not."""
    arr = np.array([0] * pad + indices, dtype=np.int64)
    bad_entry += pad
    page = int(arr[bad_entry])
    with pytest.raises(
        BoundsError, match=rf"page {page} \(entry {bad_entry}\).*offset {offset + page * PAGE}"
    ):
        check_pages("dst", NUM_PAGES * PAGE, arr, PAGE, offset, PAGE)


def test_check_pages_strided_slices() -> None:
    """Head slices inside a page (offset + length <= stride) fit; one byte more does not."""
    check_pages("r", NUM_PAGES * PAGE, np.arange(NUM_PAGES), PAGE, PAGE - 512, 512)
    with pytest.raises(BoundsError):
        check_pages("r", NUM_PAGES * PAGE, np.arange(NUM_PAGES), PAGE, PAGE - 511, 512)


@pytest.fixture(scope="module")
def engine() -> Iterator[TransferEngine]:
    with TransferEngine("tcp") as eng:
        yield eng


@pytest.fixture(scope="module")
def regions(engine: TransferEngine) -> Regions:
    src, _ = engine.register_memory(np.zeros(NUM_PAGES * PAGE, np.uint8), name="src")
    _, dst = engine.register_memory(np.zeros(NUM_PAGES * PAGE, np.uint8), name="dst")
    return src, dst


def _posted(engine: TransferEngine) -> int:
    return sum(s.writes_posted for s in engine.stats())


@pytest.mark.parametrize("side", ["src", "dst"])
def test_engine_refuses_out_of_bounds_pages(
    engine: TransferEngine, regions: Regions, side: str
) -> None:
    """A paged write out of bounds raises BoundsError naming the region and posts nothing."""
    src, dst = regions
    good, bad = np.arange(4), np.array([0, 1, NUM_PAGES, 2])
    before = _posted(engine)
    with pytest.raises(BoundsError, match=f"'{side}'"):
        engine.post_paged_writes(
            PagedWrite(
                src,
                bad if side == "src" else good,
                PAGE,
                0,
                dst,
                bad if side == "dst" else good,
                PAGE,
                0,
                PAGE,
                1,
            )
        )
    assert _posted(engine) == before


def test_engine_refuses_out_of_bounds_single_write(
    engine: TransferEngine, regions: Regions
) -> None:
    """post_write past the destination end raises BoundsError before posting."""
    src, dst = regions
    with pytest.raises(BoundsError, match=r"'dst'.*offset 61440"):
        engine.post_write(src, 0, 2 * PAGE, None, dst, (NUM_PAGES - 1) * PAGE)


def test_engine_refuses_mismatched_page_lists(engine: TransferEngine, regions: Regions) -> None:
    """Source and destination page lists must pair up one to one."""
    src, dst = regions
    with pytest.raises(ValueError, match="3 source pages but 2"):
        PagedWrite(src, [0, 1, 2], PAGE, 0, dst, [0, 1], PAGE, 0, PAGE, 1)


def test_a_moved_write_shares_its_checked_pages(regions: Regions) -> None:
    """`PagedWrite.at` moves the base offsets (a later layer's) and keeps the page ids and
    immediates checked when the write was made."""
    src, dst = regions
    write = PagedWrite(src, [3, 1], PAGE, 0, dst, [0, 2], PAGE, PAGE, PAGE, None, imms=[7, 9])
    moved = write.at(2 * PAGE, 5 * PAGE)
    assert (moved.src_offset, moved.dst_offset) == (2 * PAGE, 5 * PAGE)
    assert moved.src_page_ids is write.src_page_ids and moved.imms is write.imms
    np.testing.assert_array_equal(moved.dst_byte_offsets(), [5 * PAGE, 7 * PAGE])
    assert (write.src_offset, write.dst_offset) == (0, PAGE)  # the original is unchanged


def test_a_moved_write_can_carry_other_immediates(regions: Regions) -> None:
    """`at(..., imms=)` keeps the pages and takes other per-page values, checked as when a
    write is made; a write with one value for every page takes none."""
    src, dst = regions
    write = PagedWrite(src, [3, 1], PAGE, 0, dst, [0, 2], PAGE, 0, PAGE, None, imms=[7, 9])
    moved = write.at(PAGE, PAGE, imms=[11, 13])
    assert moved.imms.tolist() == [11, 13] and write.imms.tolist() == [7, 9]
    assert moved.src_page_ids is write.src_page_ids
    with pytest.raises(ValueError, match="imms has 1 values for 2 pages"):
        write.at(0, 0, imms=[11])
    with pytest.raises(ValueError, match="per-page imms"):
        PagedWrite(src, [0], PAGE, 0, dst, [0], PAGE, 0, PAGE, 5).at(0, 0, imms=[6])


@pytest.mark.parametrize("side", ["src", "dst"])
def test_a_write_moved_out_of_its_region_is_refused(regions: Regions, side: str) -> None:
    """Moved so that its highest page passes the region's end, a write raises BoundsError
    naming the region and that page, as a write made there would."""
    src, dst = regions
    write = PagedWrite(src, [0, 4], PAGE, 0, dst, [1, 4], PAGE, 0, PAGE, 1)
    shift = (NUM_PAGES - 4) * PAGE  # page 4 lands one page past the end
    with pytest.raises(BoundsError, match=f"'{side}'.*page 4 \\(entry 1\\)"):
        write.at(shift if side == "src" else 0, shift if side == "dst" else 0)
    write.at(shift - PAGE, shift - PAGE)  # the last page exactly fits
