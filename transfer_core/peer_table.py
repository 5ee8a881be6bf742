"""`PeerTable`: the remote endpoints one domain writes to, as fi_addrs of its address vector
(S5, X4).

An endpoint is inserted on its first write and kept: a peer given up (`DomainWorker.
abandon_peer`) stays in the AV, because fi_av_remove with writes in flight crashed libfabric
1.17's rxm, and a later write reuses (or re-opens) its connection. Every later lookup of a shm
peer checks that it is still there (`check_peer_alive`, a stat): libfabric 1.17's shm
completes small writes to a peer that has exited, locally, as if they had landed.
"""

from __future__ import annotations

import threading

from transfer_core.pyfabric import AddressVector, check_peer_alive


class PeerTable:
    """Endpoint address -> fi_addr in one domain's AV; any thread may look up."""

    def __init__(self, av: AddressVector) -> None:
        self._av = av
        self._fi_addrs: dict[bytes, int] = {}
        self._lock = threading.Lock()

    def fi_addr(self, address: bytes) -> int:
        """The fi_addr of the endpoint at `address`, inserted into the AV on first use. Raises
        FabricError for a shm peer that is gone."""
        with self._lock:
            fi_addr = self._fi_addrs.get(address)
            if fi_addr is None:
                fi_addr = self._fi_addrs[address] = self._av.insert(address)
            else:
                check_peer_alive(address)
            return fi_addr

    def known(self, address: bytes) -> int | None:
        """The fi_addr of `address` if this domain ever wrote there, else None."""
        with self._lock:
            return self._fi_addrs.get(address)
