"""A prefiller and a decoder running in threads of this process, with a router to the decoder,
and their orderly end: stopped, joined, checked clean (no request, page or counter left), closed.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator

from disagg.node.decode_node import DecodeNode
from disagg.node.prefill_node import PrefillNode
from disagg.node.router import Router


@contextlib.contextmanager
def running(prefill: PrefillNode, decode: DecodeNode) -> Iterator[Router]:
    """Run both nodes' loops in threads; yields a router to the decoder."""
    threads = [threading.Thread(target=node.run, daemon=True, name=name)
               for node, name in ((prefill, "prefill-node"), (decode, "decode-node"))]
    for thread in threads:
        thread.start()
    router = Router([decode.address])
    try:
        yield router
    finally:
        router.close()
        for node in (decode, prefill):
            node.stop()
        for thread in threads:
            thread.join(timeout=10)
    # A decoder may decode its last tokens before the prefiller has reaped the completions of
    # the writes that brought them (tcp reports a write done after it lands): let them come,
    # failing nothing, so that check_clean looks at leaks, not at the stop's timing.
    deadline = time.monotonic() + 5.0
    while prefill.messenger.has_work() and time.monotonic() < deadline:
        prefill.messenger.poll()
        time.sleep(0.01)
    prefill.check_clean()
    decode.check_clean()
    decode.close()
    prefill.close()
