"""`PeerTable`: an endpoint is inserted into the AV once, on its first lookup, and stays known
(a peer given up keeps its fi_addr)."""

from __future__ import annotations

from transfer_core.peer_table import PeerTable


class _CountingAV:
    def __init__(self) -> None:
        self.inserted: list[bytes] = []

    def insert(self, address: bytes) -> int:
        self.inserted.append(address)
        return 100 + len(self.inserted)


def test_an_endpoint_is_inserted_once_and_stays_known() -> None:
    av = _CountingAV()
    table = PeerTable(av)  # type: ignore[arg-type]
    assert table.known(b"tcp-peer-a") is None  # never written to: nothing to give up
    first = table.fi_addr(b"tcp-peer-a")
    assert table.fi_addr(b"tcp-peer-a") == first == table.known(b"tcp-peer-a")
    assert table.fi_addr(b"tcp-peer-b") != first
    assert av.inserted == [b"tcp-peer-a", b"tcp-peer-b"]
