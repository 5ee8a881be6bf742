"""The decoder's immediate counter fires on exactly the request's last write (S4c, S6b).

No message says "done": the decoder arms a counter for the writes it expects, pages x layers x
writes per page + 1 context write, and the prefiller must send exactly that many. Here the
decoder's transfer engine is watched where the counter is armed and where it fires: when the
ready callback runs, every write the plan names has landed and none more, and once the request
has ended no further write lands for it. A decoder that armed one write too few (it would
decode before the context landed), or a prefiller that sent one too many or too few, fails.
The TP cases split one side's KV over two in-process shards (`sharded_stand_in`), so a page
costs several writes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import pytest

from disagg.config import ReliabilityConfig
from disagg.engine.request import RequestState
from tests.disagg.kv_transfer.conftest import MakeHarness
from tests.disagg.kv_transfer.messenger_harness import (
    CACHE,
    random_prompt,
    single_node_tokens,
    tiny_model,
)
from transfer_core.testing.loopback import LoopbackEngine

# A missing write shows as a missed deadline, quickly; a whole request takes milliseconds.
QUICK = ReliabilityConfig(kv_timeout_s=2.0, quarantine_timeout_s=0.5, max_attempts=1)


def imms_landed(transfer: LoopbackEngine) -> int:
    """Immediates (one per write) that have landed on any of the engine's domains."""
    return sum(s.imms_received for s in transfer.stats())


@dataclass
class CounterWatch:
    """For each immediate armed on a transfer engine: writes landed by then, and since then
    when its counter fired."""

    transfer: LoopbackEngine
    landed_before: dict[int, int] = field(default_factory=dict)
    landed_at_fire: dict[int, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        arm = self.transfer.expect_imm_count

        def expect_imm_count(imm: int, count: int, on_reached: Callable[[], None]
                             ) -> tuple[int, int] | None:
            self.landed_before[imm] = imms_landed(self.transfer)

            def reached() -> None:
                self.landed_at_fire[imm] = self.landed_since_armed(imm)
                on_reached()
            return arm(imm, count, reached)

        self.transfer.expect_imm_count = expect_imm_count  # type: ignore[method-assign]

    def landed_since_armed(self, imm: int) -> int:
        return imms_landed(self.transfer) - self.landed_before[imm]


@pytest.mark.parametrize(("prefill_tp", "decode_tp", "kv_layout", "writes_per_page"), [
    (1, 1, "NHD", 1),  # matched: each page in one write
    (1, 2, "HND", 4),  # each decoder rank gets its 2 heads of K and of V: 2 x 2 writes
    (2, 1, "NHD", 16),  # each prefiller rank's 2 heads, per token, of K and of V: 2 x 4 x 2
], ids=["tp1-tp1", "tp1-tp2-hnd", "tp2-tp1-nhd"])
def test_the_counter_fires_on_exactly_the_planned_writes(
        make_harness: MakeHarness, prefill_tp: int, decode_tp: int, kv_layout: str,
        writes_per_page: int) -> None:
    """A 10-token prompt (9 prefilled: 3 pages in 2 chunks): when the decoder's counter fires,
    3 pages x 2 layers x writes per page + 1 context write have landed, none more; after the
    request ends nothing else lands for it, and it decodes the single-node tokens."""
    h = make_harness(prefill_tp=prefill_tp, decode_tp=decode_tp, kv_layout=kv_layout,
                     reliability=QUICK)
    watch = CounterWatch(h.decode_transfer)
    prompt = random_prompt(10, seed=7)
    planned = 3 * tiny_model().config.num_layers * writes_per_page + 1
    assert CACHE.page_size == 4  # 9 prefilled tokens: 3 pages
    request = h.submit(prompt)
    h.run_to_end(request)
    (imm,) = watch.landed_before
    assert watch.landed_at_fire == {imm: planned}, (
        f"the counter fired with {watch.landed_at_fire.get(imm)} of {planned} planned writes "
        "landed" if watch.landed_at_fire else f"the counter never fired ({planned} planned)")
    assert h.fabric.quiesce(5.0)
    assert watch.landed_since_armed(imm) == planned, "writes landed after the counter fired"
    assert (h.decode_transfer.imm_counted(imm), h.decode_transfer.dropped_imms) == (0, 0)
    assert request.state is RequestState.FINISHED_LENGTH
    assert request.output_token_ids == single_node_tokens(prompt)
    h.check_clean()
