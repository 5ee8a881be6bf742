"""Layer-by-layer streaming, seen from the decoder (S3, S3b), and small layers in groups (X9a).

A layer's pages leave the prefiller while the forward is still running: the first layer's
writes have landed on the decoder before the prefiller's last layer starts. The test looks at
what the decoder's transfer engine counted (the same immediates `expect_imm_count` waits for),
not at when the prefiller's poller saw a bump, so a prefiller that held every write back until
the forward ended would fail it. With `min_post_bytes` above what a layer carries, the layers
of a forward leave together after its last one: one post per peer and rank pair, each page
under its own value, and one report of the poller for the whole group.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from disagg.kv_transfer.messages import KVRequest
from disagg.kv_transfer.transfer_plan import num_pages
from tests.disagg.kv_transfer.conftest import MakeHarness
from tests.disagg.kv_transfer.messenger_harness import (
    CACHE,
    PREFILL_CHUNK,
    Harness,
    arrivals_of,
    random_prompt,
    single_node_tokens,
    tiny_model,
)
from transfer_core.transport import PagedWrite

WAIT_S = 2.0  # how long the last layer waits for the first layer's writes


def kv_request_imms(h: Harness, request_id: str) -> tuple[int, int]:
    """The immediates the decoder asked `request_id`'s writes to carry, from the wire."""
    (imms,) = [(m.imm, m.tail_imm) for m in h.to_prefiller
               if isinstance(m, KVRequest) and m.request_id == request_id]
    return imms


def count_at_last_layer(h: Harness, request_id: str, wait_s: float = WAIT_S
                        ) -> list[tuple[int, int]]:
    """Before each prefiller forward's last layer, wait (up to `wait_s`) until the decoder
    counted a write of `request_id`; the list gets the arrivals under the body's and the
    tail's immediates each forward saw when it went on."""
    counts: list[tuple[int, int]] = []
    arrivals = arrivals_of(h.decode_transfer)

    def before_last_layer(*_: Any) -> None:
        body, tail = kv_request_imms(h, request_id)
        deadline = time.monotonic() + wait_s
        while arrivals[body] == 0 and time.monotonic() < deadline:
            time.sleep(0.001)  # the poller thread posts; give it the core
        counts.append((arrivals[body], arrivals[tail]))

    h.prefill_engine.model.layers[-1].self_attn.register_forward_pre_hook(before_last_layer)
    return counts


def test_layer_zero_lands_on_the_decoder_before_the_last_layer_runs(
        make_harness: MakeHarness) -> None:
    """A prompt prefilled in one chunk (5 tokens, 2 pages): when the prefiller's last layer
    starts, the decoder has counted exactly layer 0's page writes (one per page, under the
    body's immediate; nothing of the last layer yet, no context); the request then decodes the
    single-node tokens."""
    h = make_harness()
    prompt = random_prompt(PREFILL_CHUNK + 1, seed=4)  # every prompt token but the last: 1 chunk
    counts = count_at_last_layer(h, "r0")
    request = h.submit(prompt)
    h.run_to_end(request)
    assert counts == [(num_pages(PREFILL_CHUNK, CACHE.page_size), 0)], (
        f"decoder counted {counts} writes when the prefiller's last layer started")
    assert request.output_token_ids == single_node_tokens(prompt)
    h.check_clean()


GROUPED = 1 << 20  # more than a layer of the tiny model carries: the forward is one group


def test_small_layers_leave_together_after_the_last_layer(make_harness: MakeHarness) -> None:
    """Grouped, nothing has landed when the last layer starts; one post per forward carries
    both layers, the first under the body's value and the last under the tail's; the request
    decodes the single-node tokens."""
    h = make_harness(min_post_bytes=GROUPED)
    prompt = random_prompt(PREFILL_CHUNK + 1, seed=4)  # one chunk
    counts = count_at_last_layer(h, "r0", wait_s=0.2)  # ungrouped, layer 0 lands in ms
    posts: list[PagedWrite] = []
    post = h.prefill_transfer.post_paged_writes

    def spy(write: PagedWrite, *args: Any, **kwargs: Any) -> None:
        posts.append(write)
        post(write, *args, **kwargs)

    h.prefill_transfer.post_paged_writes = spy  # type: ignore[method-assign]
    request = h.submit(prompt)
    h.run_to_end(request)
    assert counts == [(0, 0)]
    body, tail = kv_request_imms(h, "r0")
    pages = num_pages(PREFILL_CHUNK, CACHE.page_size)
    num_layers = tiny_model().config.num_layers
    kv_posts = [w for w in posts if w.imms is not None]
    assert len(kv_posts) == 1
    imms = np.asarray(kv_posts[0].imms).tolist()
    assert imms == [body] * pages * (num_layers - 1) + [tail] * pages
    assert request.output_token_ids == single_node_tokens(prompt)
    h.check_clean()


def test_the_poller_reports_a_group_once(make_harness: MakeHarness) -> None:
    """The streamer holds the poller's reports until a group's last layer, so the poller's
    thread stays in its C wait (off the GIL) through the layers that ride along: one report
    per forward here, spanning all its layers."""
    h = make_harness(min_post_bytes=GROUPED)
    poller = h.prefill.streamer._poller
    reports: list[tuple[int, int]] = []
    on_change = poller._on_change

    def record(index: int, old: int, new: int) -> None:
        reports.append((old, new))
        on_change(index, old, new)

    poller._on_change = record  # type: ignore[method-assign]
    # The last layer starts late, so a poller that reported each bump would have reported the
    # first one alone by then.
    h.prefill_engine.model.layers[-1].self_attn.register_forward_pre_hook(
        lambda *_: time.sleep(0.05))
    prompts = [random_prompt(PREFILL_CHUNK + 1, seed=s) for s in (5, 6)]
    for i, prompt in enumerate(prompts):
        request = h.submit(prompt, f"r{i}")
        h.run_to_end(request)
        assert request.output_token_ids == single_node_tokens(prompt)
    num_layers = tiny_model().config.num_layers
    assert len(reports) == 2, reports
    assert all(new - old == num_layers for old, new in reports), reports
    h.check_clean()
