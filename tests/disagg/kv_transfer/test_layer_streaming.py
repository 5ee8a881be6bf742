"""Layer-by-layer streaming, seen from the decoder (S3, S3b).

A layer's pages leave the prefiller while the forward is still running: the first layer's
writes have landed on the decoder before the prefiller's last layer starts. The test looks at
what the decoder's transfer engine counted (the same immediates `expect_imm_count` waits for),
not at when the prefiller's poller saw a bump, so a prefiller that held every write back until
the forward ended would fail it.
"""

from __future__ import annotations

import time
from typing import Any

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
)

WAIT_S = 2.0  # how long the last layer waits for the first layer's writes


def kv_request_imms(h: Harness, request_id: str) -> tuple[int, int]:
    """The immediates the decoder asked `request_id`'s writes to carry, from the wire."""
    (imms,) = [(m.imm, m.tail_imm) for m in h.to_prefiller
               if isinstance(m, KVRequest) and m.request_id == request_id]
    return imms


def count_at_last_layer(h: Harness, request_id: str) -> list[tuple[int, int]]:
    """Before each prefiller forward's last layer, wait (bounded) until the decoder counted a
    write of `request_id`; the list gets the arrivals under the body's and the tail's
    immediates each forward saw when it went on."""
    counts: list[tuple[int, int]] = []
    arrivals = arrivals_of(h.decode_transfer)

    def before_last_layer(*_: Any) -> None:
        body, tail = kv_request_imms(h, request_id)
        deadline = time.monotonic() + WAIT_S
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
