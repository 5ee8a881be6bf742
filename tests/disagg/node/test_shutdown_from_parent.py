"""A node listening without a cluster secret takes `Shutdown` only from its parent (X5d): a
Shutdown from any other local process is refused with a Reject and the node serves on; the
one from the process that started it stops it cleanly. A real node process (tiny model, tcp on
loopback) started by this test, and a second process playing the stranger."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator

import pytest

from disagg.config import CacheConfig, SchedulerConfig
from disagg.control.channel import Channel
from disagg.control.messages import RequestEvent, Shutdown, Status, Submit
from disagg.control.secret import SECRET_ENV
from disagg.engine.request import RequestState
from disagg.node.node_config import NodeConfig, NodeRole
from disagg.node.ready_line import ReadyLine

STRANGER = """
import sys
from disagg.control.channel import Channel
from disagg.control.messages import Reject, Shutdown, Status
channel = Channel.connect(sys.argv[1], secret=b"")
assert channel.recv() == Status(True)
channel.send(Shutdown())
while not isinstance(reply := channel.recv(), Reject):
    pass
print(reply.reason)
"""


@pytest.fixture
def node() -> Iterator[tuple[subprocess.Popen[str], str]]:
    """A mixed node without a secret, this process its parent; (process, address)."""
    env = {k: v for k, v in os.environ.items() if k != SECRET_ENV}
    config = NodeConfig("tiny", CacheConfig(page_size=4, num_pages=64),
                        SchedulerConfig(chunk_size=8, max_num_batched_tokens=8),
                        role=NodeRole.MIXED, node_id="mixed-0")
    process = subprocess.Popen([sys.executable, "-m", "disagg.node.serve"], env=env, text=True,
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                               stderr=subprocess.DEVNULL)
    assert process.stdin is not None and process.stdout is not None
    process.stdin.write(config.to_json())
    process.stdin.close()
    while (ready := ReadyLine.parse(process.stdout.readline())) is None:
        assert process.poll() is None, "the node exited before it was ready"
    try:
        yield process, ready.address
    finally:
        if process.poll() is None:
            process.kill()
        process.wait(timeout=30)
        process.stdout.close()


def test_a_stranger_s_shutdown_is_refused_and_the_parent_s_stops_the_node(
        node: tuple[subprocess.Popen[str], str]) -> None:
    process, address = node
    env = {k: v for k, v in os.environ.items() if k != SECRET_ENV}
    stranger = subprocess.run([sys.executable, "-c", STRANGER, address], env=env, text=True,
                              capture_output=True, timeout=60, check=True)
    assert "takes Shutdown only from the process that started it" in stranger.stdout
    channel = Channel.connect(address, secret=b"")
    assert channel.recv() == Status(True)
    channel.send(Submit("after", [1, 2, 3], 4))
    while not (isinstance(event := channel.recv(), RequestEvent) and event.state.is_terminal()):
        pass
    assert event.state is RequestState.FINISHED_LENGTH  # it serves on
    channel.send(Shutdown())  # from its parent: taken
    assert process.wait(timeout=60) == 0  # and it checked on the way out that nothing leaked
    channel.close()
