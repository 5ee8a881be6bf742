"""A CPU model's weights moved into transparent huge pages (X8f): same values, same outputs,
memory the kernel backs with 2 MiB pages, sharing kept."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from torch import nn

from disagg.model.huge_pages import huge_pages_available, into_huge_pages

needs_thp = pytest.mark.skipif(not huge_pages_available(),
                               reason="no transparent huge pages on this kernel")


def mapping_of(address: int) -> dict[str, int]:
    """The /proc/self/smaps counters (kB) of the mapping holding `address`, plus "asked" (1
    where the mapping was asked for huge pages: VmFlags holds "hg")."""
    fields: dict[str, int] = {}
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        bounds = re.match(r"^([0-9a-f]+)-([0-9a-f]+) ", line)
        if bounds:
            if inside:
                break
            inside = int(bounds.group(1), 16) <= address < int(bounds.group(2), 16)
        elif inside and line.startswith("VmFlags:"):
            fields["asked"] = int("hg" in line.split()[1:])
        elif inside and ":" in line:
            name, value = line.split(":", 1)
            if value.split() and value.split()[0].isdigit():
                fields[name] = int(value.split()[0])
    return fields


def two_layers() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(1024, 2048), nn.Linear(2048, 1024, bias=False))


@needs_thp
def test_values_and_outputs_keep_their_bits() -> None:
    model, x = two_layers(), torch.randn(3, 1024)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    expected = model(x)
    moved = into_huge_pages(model)
    assert moved >= sum(p.numel() * 4 for p in before.values())
    assert all(torch.equal(p, before[name]) for name, p in model.named_parameters())
    assert torch.equal(model(x), expected)


@needs_thp
def test_the_weights_sit_in_huge_pages() -> None:
    model = two_layers()  # 16 MiB of weights: several whole huge pages
    assert mapping_of(model[0].weight.data_ptr())["asked"] == 0  # torch's own memory
    into_huge_pages(model)
    where = mapping_of(model[0].weight.data_ptr())
    assert where["asked"] == 1 and where["THPeligible"] == 1
    assert where["AnonHugePages"] >= 2048


@needs_thp
def test_views_of_a_loaded_buffer_move_and_overlapping_ones_keep_their_tie() -> None:
    """Parameters side by side in one buffer (as a checkpoint loads them) each move; two that
    overlap (one a view of the other) stay, still tied; one that two modules hold moves once,
    still shared."""
    loaded = torch.randn(8192)
    model = nn.Module()
    model.a, model.b = (nn.Parameter(loaded[:4096]), nn.Parameter(loaded[4096:]))
    tie = torch.randn(2048)
    model.whole, model.part = nn.Parameter(tie), nn.Parameter(tie[:1024])
    model.one, model.other = nn.Linear(8, 8), nn.Linear(8, 8)
    model.other.weight = model.one.weight
    into_huge_pages(model)
    assert mapping_of(model.a.data_ptr())["asked"] == 1
    assert mapping_of(model.b.data_ptr())["asked"] == 1
    assert torch.equal(torch.cat([model.a.detach(), model.b.detach()]), loaded)
    assert (model.whole.data_ptr(), model.part.data_ptr()) == (tie.data_ptr(), tie.data_ptr())
    assert model.other.weight is model.one.weight
    assert mapping_of(model.one.weight.data_ptr())["asked"] == 1
