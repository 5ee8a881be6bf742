"""A local cluster always carries a cluster secret (X5d): real node processes, tcp on loopback.

Started without `DISAGG_CLUSTER_SECRET`, `LocalCluster` makes a random one, hands it to every
node and holds it in this process while the cluster lives (its router signs with it), then
unsets it again. A connection without it is refused, and an unsigned 10-byte Shutdown frame
from a raw socket stops no node.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Iterator

import pytest

from disagg.control.address import parse_address
from disagg.control.channel import Channel
from disagg.control.framing import encode
from disagg.control.messages import Shutdown, Submit
from disagg.control.secret import SECRET_ENV
from disagg.errors import ProtocolError
from disagg.node.cluster_config import ClusterConfig
from disagg.node.local_cluster import LocalCluster
from disagg.node.router import Router
from disagg.node.secret_scope import SecretScope

pytestmark = [pytest.mark.fabric, pytest.mark.slow]  # two node processes

CONFIG = ClusterConfig.from_options(model="tiny", num_decoders=1, page_size=4, num_pages=128,
                                    chunk_size=32)


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    """A prefiller and a decoder started with no secret in the environment."""
    with pytest.MonkeyPatch.context() as patch:
        patch.delenv(SECRET_ENV, raising=False)
        with LocalCluster(CONFIG) as started:
            yield started
        assert SECRET_ENV not in os.environ  # put back as it was: unset
    assert started.exit_codes() == [0, 0], started.logs  # the signed Shutdowns were obeyed


def environment_of(pid: int) -> dict[str, str]:
    with open(f"/proc/{pid}/environ", "rb") as environ:
        pairs = [item.partition(b"=") for item in environ.read().split(b"\0") if item]
    return {key.decode(): value.decode() for key, _, value in pairs}


def closed_within(sock: socket.socket, timeout_s: float) -> bool:
    """Whether the node hung up on `sock` (EOF or reset) within `timeout_s`."""
    sock.settimeout(timeout_s)
    try:
        while sock.recv(1 << 16):
            pass
    except TimeoutError:
        return False
    except OSError:
        return True
    return True


def served(cluster: LocalCluster) -> str:
    """The final state of one request through a new router (signed with this process's
    secret)."""
    router = Router([cluster.decoder_addresses[0]])
    try:
        router.route(Submit("probe", [1, 2, 3, 4, 5], 3))
        while not (event := router.events.get(timeout=30)).state.is_terminal():
            pass
        return event.state.value
    finally:
        router.close()


def test_every_node_gets_the_generated_secret(cluster: LocalCluster) -> None:
    """A random 256-bit secret, the same in this process and in every node's environment."""
    secret = os.environ[SECRET_ENV]
    assert len(bytes.fromhex(secret)) == 32
    for process in cluster.processes:
        assert environment_of(process.pid)[SECRET_ENV] == secret


@pytest.mark.parametrize("node", ["prefill-0", "decode-0"])
def test_a_connection_without_the_secret_is_refused(cluster: LocalCluster, node: str) -> None:
    """An unauthenticated channel's opening frame is refused: the node answers with its
    nonce preface, which a peer without the secret cannot take."""
    address = (cluster.prefiller_address if node == "prefill-0"
               else cluster.decoder_addresses[0])
    intruder = Channel.connect(address, secret=b"")
    intruder.sock.settimeout(10)  # a node that took the connection would leave recv waiting
    with pytest.raises(ProtocolError, match="signed frame"):
        intruder.recv()
    intruder.close()


def test_a_raw_shutdown_frame_stops_no_decoder(cluster: LocalCluster) -> None:
    """The 10 bytes of an unsigned Shutdown, sent by a stranger: the decoder hangs up on it
    and goes on serving."""
    frame = encode(Shutdown(), tagged=False)
    assert len(frame) == 10
    for address in (cluster.decoder_addresses[0], cluster.prefiller_address):
        with socket.create_connection(parse_address(address), timeout=5) as attacker:
            attacker.sendall(frame)
            assert closed_within(attacker, 10)
    time.sleep(0.5)  # an obeyed Shutdown would have ended a node by now
    assert cluster.exit_codes() == [None, None], cluster.logs
    assert served(cluster) == "finished_length"


def test_a_users_secret_is_the_one_used_and_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    """With the variable set, the scope uses that secret and leaves it set on restore."""
    monkeypatch.setenv(SECRET_ENV, "the-users-secret")
    scope = SecretScope()
    assert (scope.secret, scope.generated) == ("the-users-secret", False)
    assert scope.child_env()[SECRET_ENV] == "the-users-secret"
    scope.restore()
    assert os.environ[SECRET_ENV] == "the-users-secret"


def test_a_generated_secret_is_unset_on_restore(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the variable, each scope makes its own secret and unsets it on restore."""
    monkeypatch.delenv(SECRET_ENV, raising=False)
    first = SecretScope()
    assert first.generated and os.environ[SECRET_ENV] == first.secret
    first.restore()
    assert SECRET_ENV not in os.environ
    second = SecretScope()
    second.restore()
    assert second.secret != first.secret
