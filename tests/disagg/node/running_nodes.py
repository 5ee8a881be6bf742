"""A prefiller and a decoder running in threads of this process, with a router to the decoder,
and their orderly end: stopped, joined, checked clean (no request, page or counter left), closed.
"""

from __future__ import annotations

import contextlib
import threading
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
    prefill.settle()  # its last writes' completions, before checking it clean
    prefill.check_clean()
    decode.check_clean()
    decode.close()
    prefill.close()
