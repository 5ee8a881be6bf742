"""The prefiller's KV checksum added up as layers are posted (X4c, X8d).

The parts of `LayerSums` over layers and over any split of the tokens add up to `kv_checksum`
(the number a decoder recomputes); the running record covers a prompt only once every token is
summed over every layer; and through the messengers, a prompt prefilled in several chunks
ships the running total (the whole-KV sum after the last forward is not run) and the decoder,
which checks it, decodes the single-node tokens.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from disagg.config import CacheConfig, ModelConfig
from disagg.kv_transfer import context_sender
from disagg.kv_transfer.kv_checksum import LayerSums, kv_checksum
from disagg.kv_transfer.running_checksum import RunningChecksum
from disagg.model import cpu_kernels
from disagg.model.kv_cache import PagedKVCache
from tests.disagg.kv_transfer.conftest import MakeHarness
from tests.disagg.kv_transfer.messenger_harness import random_prompt, single_node_tokens

pytestmark = pytest.mark.skipif(not cpu_kernels.ENABLED, reason="CPU kernels not built")


@pytest.mark.parametrize("name", ["tiny", "tiny-mla-moe"])
@pytest.mark.parametrize("kv_layout", ["NHD", "HND"])
def test_layer_parts_over_any_token_split_add_up_to_the_checksum(name: str,
                                                                 kv_layout: str) -> None:
    """Cuts mid-page and on page edges, a held first page: the same float64."""
    model = ModelConfig.from_name(name)
    cache = PagedKVCache(model, CacheConfig(page_size=4, num_pages=16, kv_layout=kv_layout))
    cache.buffer.copy_(torch.randn(cache.buffer.shape, generator=torch.Generator().manual_seed(2)))
    pages, num_tokens = [9, 2, 14, 5, 7, 1], 22
    cuts = [4, 5, 6, 11, 16, num_tokens]
    total = sum(LayerSums(cache, pages, a, b).of(layer)
                for a, b in zip(cuts, cuts[1:], strict=False) for layer in range(model.num_layers))
    assert float(total & ((1 << 52) - 1)) == kv_checksum(cache, pages, num_tokens, first_page=1)


@pytest.mark.parametrize("kv_layout", ["NHD", "HND"])
def test_a_run_of_layers_in_one_call_adds_up_as_its_layers_do(kv_layout: str) -> None:
    """`over(layers)` (one C call per part, X9a's groups) over any split of a 4-layer model's
    layers: the same number as the checksum, which sums layer by layer."""
    model = ModelConfig.from_name("small")
    cache = PagedKVCache(model, CacheConfig(page_size=4, num_pages=16, kv_layout=kv_layout))
    cache.buffer.copy_(torch.randn(cache.buffer.shape, generator=torch.Generator().manual_seed(3)))
    pages, num_tokens = [9, 2, 14, 5], 14
    sums = LayerSums(cache, pages, 0, num_tokens)
    want = kv_checksum(cache, pages, num_tokens)
    for cuts in ([0, 4], [0, 1, 4], [0, 3, 4], [0, 1, 2, 3, 4]):
        total = sum(sums.over(range(a, b)) for a, b in zip(cuts, cuts[1:], strict=False))
        assert float(total & ((1 << 52) - 1)) == want, cuts
    assert sums.over(range(2, 2)) == 0
    with pytest.raises(ValueError, match="not a run"):
        sums.over(range(0, 4, 2))


def test_the_running_total_counts_only_once_every_token_is_summed() -> None:
    running = RunningChecksum.from_token(4)
    first = running.plan(9)
    assert running.plan(9) is None  # a chunk that adds no token adds no range
    running.add(5)
    assert running.value(9) is None  # planned, not summed over every layer yet
    running.finish(first)
    second = running.plan(12)
    assert (first.start, first.end, second.start, second.end) == (4, 9, 9, 12)
    assert (running.value(9), running.value(12)) == (5.0, None)


def test_a_chunked_prompt_ships_the_running_checksum(make_harness: MakeHarness,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """12 prefilled tokens in chunks of 5: the context carries the running total (no whole-KV
    sum after the last forward), and the decoder, which checks it, decodes as a single node."""
    whole_sums: list[Any] = []
    real = context_sender.kv_checksum

    def spy(*args: Any, **kwargs: Any) -> float:
        whole_sums.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(context_sender, "kv_checksum", spy)
    h = make_harness()
    prompt = random_prompt(13, seed=31)
    request = h.submit(prompt)
    h.run_to_end(request)
    assert request.output_token_ids == single_node_tokens(prompt)
    assert whole_sums == []
    h.check_clean()
