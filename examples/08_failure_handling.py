"""Step 8: failure handling. Lose immediates on purpose and watch the decoder recover (X4).

A prefiller and a decoder run as threads of this process over the real tcp provider. The
decoder's transfer engine drops 10% of arriving immediates (seeded), so some KV counters never
reach their expected count. Each such request misses its deadline, is cancelled at the
prefiller, waits in the page quarantine for its counted fence (or the quarantine deadline),
and is retried. Every request still ends exactly once, with the right tokens.
Pairs with docs/tutorials/08-failure-handling.md.
"""

from __future__ import annotations

import logging
import threading
import time

from disagg.config import CacheConfig, ReliabilityConfig, SchedulerConfig
from disagg.control.messages import Submit
from disagg.node.builder import build_node
from disagg.node.decode_node import DecodeNode
from disagg.node.node_config import NodeConfig, NodeRole
from disagg.node.router import Router


def main() -> None:
    logging.basicConfig(level=logging.ERROR)
    cache = CacheConfig(page_size=4, num_pages=128)
    prefiller = build_node(NodeConfig(
        "tiny", cache, SchedulerConfig(chunk_size=8, max_num_batched_tokens=8,
                                       mode="prefill_only"), role=NodeRole.PREFILL))
    reliability = ReliabilityConfig(kv_timeout_s=1.0, quarantine_timeout_s=0.5, max_attempts=3)
    decoder = build_node(NodeConfig(
        "tiny", cache, SchedulerConfig(), role=NodeRole.DECODE, prefillers=(prefiller.address,),
        faults="seed=4,drop_imm=0.1", reliability=reliability))
    assert isinstance(decoder, DecodeNode)
    threads = [threading.Thread(target=node.run, daemon=True) for node in (prefiller, decoder)]
    for thread in threads:
        thread.start()
    router = Router([decoder.address])
    start = time.monotonic()
    for i in range(4):
        router.route(Submit(f"r{i}", list(range(3, 10 + 6 * i)), 4))
    done, last_state = 0, {}
    while done < 4:
        event = router.events.get(timeout=30)
        if event.detail or last_state.get(event.request_id) != event.state:
            print(f"{time.monotonic() - start:5.2f}s {event.request_id}: {event.state.value}"
                  f"{' (' + event.detail + ')' if event.detail else ''}")
        last_state[event.request_id] = event.state
        done += event.state.is_terminal()
    print(f"immediates dropped on purpose: {decoder.transfer.injected['drop_imm']}, "
          f"fences never reached: {decoder.messenger.quarantine.forced_releases}")
    router.close()
    for node in (decoder, prefiller):
        node.stop()
    for thread in threads:
        thread.join()
    prefiller.settle()  # the completions of its last writes may still be on their way
    decoder.check_clean()
    prefiller.check_clean()
    print("both nodes clean: no page, request, transfer context or counter left")
    decoder.close()
    prefiller.close()


if __name__ == "__main__":
    main()
