"""The decoder's immediate counters fire on exactly the request's planned writes (S4c, S6b).

No message says "done": the decoder arms two counters for the writes it expects, the body's
(pages x every layer but the last x writes per page) and the tail's (pages x the last layer x
writes per page + 1 context write), and the prefiller must send exactly that many under each
value. Here the decoder's transfer engine is watched where the counters are armed and where
they fire: when a counter's callback runs, every write of its part the plan names has landed
and none more, and once the request has ended no further write lands for it. A decoder that
armed one write too few (it would decode before the context landed), or a prefiller that sent
one too many or too few, or the last layer under the body's value, fails.
The TP cases split one side's KV over two in-process shards (`sharded_stand_in`), so a page
costs several writes.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest

from disagg.config import ReliabilityConfig
from disagg.engine.request import RequestState
from tests.disagg.kv_transfer.conftest import MakeHarness
from tests.disagg.kv_transfer.messenger_harness import (
    CACHE,
    arrivals_of,
    random_prompt,
    single_node_tokens,
    tiny_model,
)
from transfer_core.testing.loopback import LoopbackEngine

# A missing write shows as a missed deadline, quickly; a whole request takes milliseconds.
QUICK = ReliabilityConfig(kv_timeout_s=2.0, quarantine_timeout_s=0.5, max_attempts=1)


@dataclass
class CounterWatch:
    """Arrivals of each immediate value on a transfer engine (seen before they are counted),
    and for each counter armed there, the arrivals of its value when it fired."""

    transfer: LoopbackEngine
    arrivals: Counter[int] = field(init=False)
    landed_at_fire: dict[int, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.arrivals = arrivals_of(self.transfer)
        arm = self.transfer.expect_imm_count

        def expect_imm_count(imm: int, count: int, on_reached: Callable[[], None]
                             ) -> tuple[int, int] | None:
            def reached() -> None:
                self.landed_at_fire[imm] = self.arrivals[imm]
                on_reached()
            return arm(imm, count, reached)

        self.transfer.expect_imm_count = expect_imm_count  # type: ignore[method-assign]


@pytest.mark.parametrize(("prefill_tp", "decode_tp", "kv_layout", "writes_per_page"), [
    (1, 1, "NHD", 1),  # matched: each page in one write
    (1, 2, "HND", 4),  # each decoder rank gets its 2 heads of K and of V: 2 x 2 writes
    (2, 1, "NHD", 16),  # each prefiller rank's 2 heads, per token, of K and of V: 2 x 4 x 2
], ids=["tp1-tp1", "tp1-tp2-hnd", "tp2-tp1-nhd"])
def test_the_counter_fires_on_exactly_the_planned_writes(
        make_harness: MakeHarness, prefill_tp: int, decode_tp: int, kv_layout: str,
        writes_per_page: int) -> None:
    """A 10-token prompt (9 prefilled: 3 pages in 2 chunks): when the body's counter fires, 3
    pages x (2 - 1) layers x writes per page have landed under its value, and when the tail's
    fires, 3 pages x 1 layer x writes per page + 1 context write under the tail's; none more
    after the request ends, and it decodes the single-node tokens."""
    h = make_harness(prefill_tp=prefill_tp, decode_tp=decode_tp, kv_layout=kv_layout,
                     reliability=QUICK)
    watch = CounterWatch(h.decode_transfer)
    prompt = random_prompt(10, seed=7)
    num_layers = tiny_model().config.num_layers
    assert CACHE.page_size == 4  # 9 prefilled tokens: 3 pages
    request = h.submit(prompt)
    pending = h.decode.pending["r0"]
    planned = {pending.imm: 3 * (num_layers - 1) * writes_per_page,
               pending.tail_imm: 3 * writes_per_page + 1}
    h.run_to_end(request)
    assert watch.landed_at_fire == planned, (
        f"the counters fired with {watch.landed_at_fire} of {planned} planned writes landed")
    assert h.fabric.quiesce(5.0)
    assert dict(watch.arrivals) == planned, "writes landed after a counter fired"
    assert h.decode_transfer.dropped_imms == 0
    assert [h.decode_transfer.imm_counted(imm) for imm in planned] == [0, 0]
    assert request.state is RequestState.FINISHED_LENGTH
    assert request.output_token_ids == single_node_tokens(prompt)
    h.check_clean()
