"""`layer_groups` (X9a): the groups a forward's layers post in cover every layer once, in
order; each but the last carries at least the minimum and is no longer than it needs to be;
the last layer always closes a group."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from disagg.kv_transfer.layer_groups import layer_groups


@given(layer_bytes=st.integers(0, 1 << 22), num_layers=st.integers(1, 96),
       min_bytes=st.integers(0, 1 << 24))
def test_groups_tile_the_layers_and_each_carries_the_minimum(
        layer_bytes: int, num_layers: int, min_bytes: int) -> None:
    groups = layer_groups(layer_bytes, num_layers, min_bytes)
    assert [layer for group in groups for layer in group] == list(range(num_layers))
    assert groups[-1][-1] == num_layers - 1
    for group in groups[:-1]:
        assert len(group) * layer_bytes >= min_bytes  # worth its post
        # ... and no longer than that: one layer less would not be
        assert len(group) == 1 or (len(group) - 1) * layer_bytes < min_bytes


@given(layer_bytes=st.integers(1, 1 << 22), num_layers=st.integers(1, 96))
def test_no_minimum_posts_every_layer_alone(layer_bytes: int, num_layers: int) -> None:
    assert layer_groups(layer_bytes, num_layers, 0) == tuple(
        range(layer, layer + 1) for layer in range(num_layers))


def test_a_forward_with_nothing_to_send_posts_once_at_its_end() -> None:
    assert layer_groups(0, 30, 256 * 1024) == (range(30),)


def test_a_short_smollm2_prompt_posts_three_times_not_thirty() -> None:
    """A 6-token prompt's page (16 tokens x 3 KV heads x 64 x K and V x fp32 = 24 KiB a layer)
    over SmolLM2's 30 layers, at the default 256 KiB."""
    assert layer_groups(24_576, 30, 256 * 1024) == (range(0, 11), range(11, 22), range(22, 30))


@pytest.mark.parametrize(("layer_bytes", "num_layers", "min_bytes"),
                         [(-1, 4, 0), (1, 0, 0), (1, 4, -1)])
def test_impossible_arguments_are_refused(layer_bytes: int, num_layers: int,
                                          min_bytes: int) -> None:
    with pytest.raises(ValueError, match="need num_layers >= 1"):
        layer_groups(layer_bytes, num_layers, min_bytes)
