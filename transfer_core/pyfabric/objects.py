"""Thin Pythonic libfabric objects: fabric, domain, completion queue, address vector, RDM
endpoint and memory registration (S5).

Each object owns one fid and closes it in `close()` (idempotent); children keep their parent
alive, and closing must go children first (what `FabricStack.close` does). Nothing here
touches the data path: batched writes and CQ draining are in `datapath.Worker`.
"""

from __future__ import annotations

import os

from ._pyfabric import ffi, lib
from .errors import FabricError, check
from .info import Info


class _Fid:
    """Shared close() for anything holding a `struct fid_*` pointer."""

    _kind = "fid"

    def __init__(self, handle: object) -> None:
        self._handle = handle

    @property
    def handle(self) -> object:
        if self._handle is None:
            raise ValueError(f"{self._kind} is closed")
        return self._handle

    @property
    def closed(self) -> bool:
        return self._handle is None

    def close(self) -> None:
        if self._handle is None:
            return
        handle, self._handle = self._handle, None
        check(f"fi_close({self._kind})", lib.fi_close(ffi.cast("struct fid *", handle)))


class Fabric(_Fid):
    _kind = "fabric"

    def __init__(self, info: Info) -> None:
        out = ffi.new("struct fid_fabric **")
        check("fi_fabric", lib.fi_fabric(info.raw.fabric_attr, out, ffi.NULL))
        super().__init__(out[0])
        self.info = info


class Domain(_Fid):
    _kind = "domain"

    def __init__(self, fabric: Fabric, info: Info) -> None:
        out = ffi.new("struct fid_domain **")
        check("fi_domain", lib.fi_domain(fabric.handle, info.raw, out, ffi.NULL))
        super().__init__(out[0])
        self.fabric = fabric
        self.info = info


class CompletionQueue(_Fid):
    """A CQ of FI_CQ_FORMAT_DATA entries; progress is manual (the worker reads it).

    With `wait_fd` it is opened with FI_WAIT_FD, so that an idle worker can sleep until a
    socket has something for it (`waitable`); a provider that refuses FI_WAIT_FD gets a CQ
    without a wait object, polled as before."""

    _kind = "cq"

    def __init__(self, domain: Domain, size: int, wait_fd: bool = False) -> None:
        attr = ffi.new("struct fi_cq_attr *")
        attr.size = size
        attr.format = lib.FI_CQ_FORMAT_DATA
        attr.wait_obj = lib.FI_WAIT_FD if wait_fd else lib.FI_WAIT_NONE
        out = ffi.new("struct fid_cq **")
        rc = lib.fi_cq_open(domain.handle, attr, out, ffi.NULL)
        if rc != 0 and wait_fd:
            attr.wait_obj = lib.FI_WAIT_NONE
            rc = lib.fi_cq_open(domain.handle, attr, out, ffi.NULL)
        check("fi_cq_open", rc)
        super().__init__(out[0])
        self.domain = domain
        self.waitable = wait_fd and attr.wait_obj == lib.FI_WAIT_FD

    def read(self, max_entries: int = 16) -> list[tuple[int, int, int]]:
        """Reference slow path: up to `max_entries` (op_context, flags, data) tuples.

        An error entry raises `FabricError` named "fi_cq_read" with the entry's errno."""
        entries = ffi.new("struct fi_cq_data_entry[]", max_entries)
        got = lib.fi_cq_read(self.handle, entries, max_entries)
        if got == -lib.FI_EAGAIN:
            return []
        if got == -lib.FI_EAVAIL:
            err = ffi.new("struct fi_cq_err_entry *")
            check("fi_cq_readerr", lib.fi_cq_readerr(self.handle, err, 0))
            check("fi_cq_read", -err.err)
        check("fi_cq_read", got)
        return [
            (int(ffi.cast("uintptr_t", e.op_context)), int(e.flags), int(e.data))
            for e in entries[0:got]
        ]


class AddressVector(_Fid):
    """Peer addresses (opaque bytes from `Endpoint.name`) mapped to fi_addr_t handles."""

    _kind = "av"

    def __init__(self, domain: Domain, count: int = 64) -> None:
        attr = ffi.new("struct fi_av_attr *")
        attr.type = lib.FI_AV_TABLE
        attr.count = count
        out = ffi.new("struct fid_av **")
        check("fi_av_open", lib.fi_av_open(domain.handle, attr, out, ffi.NULL))
        super().__init__(out[0])
        self.domain = domain

    def insert(self, address: bytes) -> int:
        check_peer_alive(address)
        fi_addr = ffi.new("fi_addr_t *")
        rc = lib.fi_av_insert(self.handle, address, 1, fi_addr, 0, ffi.NULL)
        check("fi_av_insert", rc)
        if rc != 1:
            check("fi_av_insert", -lib.FI_EIO)
        return int(fi_addr[0])


_SHM_PREFIX = b"fi_shm://"


def shm_file(address: bytes) -> str | None:
    """The /dev/shm file a shm peer's region lives in; None for other providers."""
    if not address.startswith(_SHM_PREFIX):
        return None
    name = address[len(_SHM_PREFIX) :].split(b"\0", 1)[0].decode(errors="replace")
    return None if "/" in name else f"/dev/shm/{name}"


def check_peer_alive(address: bytes) -> None:
    """Raise FabricError if `address` is a shm peer whose region (/dev/shm/<name>) is gone.

    libfabric 1.17's shm segfaults in fi_av_insert on such an address, and small writes to a
    peer that exited after insertion still complete locally; other providers: no-op."""
    if not address.startswith(_SHM_PREFIX):
        return
    path = shm_file(address)
    if path is None or not os.path.exists(path):
        name = address[len(_SHM_PREFIX) :].split(b"\0", 1)[0].decode(errors="replace")
        text = f"shm peer {name!r} is gone (no /dev/shm/{name})"
        raise FabricError("fi_av_insert", lib.FI_EHOSTUNREACH, text)


class Endpoint(_Fid):
    """An enabled FI_EP_RDM endpoint with one CQ for both directions and an AV."""

    _kind = "ep"

    def __init__(self, domain: Domain, cq: CompletionQueue, av: AddressVector) -> None:
        out = ffi.new("struct fid_ep **")
        check("fi_endpoint", lib.fi_endpoint(domain.handle, domain.info.raw, out, ffi.NULL))
        super().__init__(out[0])
        self.domain = domain
        try:
            cq_fid = ffi.cast("struct fid *", cq.handle)
            check(
                "fi_ep_bind(cq)", lib.fi_ep_bind(self.handle, cq_fid, lib.FI_TRANSMIT | lib.FI_RECV)
            )
            av_fid = ffi.cast("struct fid *", av.handle)
            check("fi_ep_bind(av)", lib.fi_ep_bind(self.handle, av_fid, 0))
            check("fi_enable", lib.fi_enable(self.handle))
        except BaseException:
            self.close()
            raise

    @property
    def name(self) -> bytes:
        """This endpoint's address, to send to peers for `AddressVector.insert`."""
        size = ffi.new("size_t *", 256)
        buf = ffi.new("char[]", 256)
        check("fi_getname", lib.fi_getname(ffi.cast("struct fid *", self.handle), buf, size))
        return bytes(ffi.buffer(buf, size[0]))


class MemoryRegistration(_Fid):
    """One registration of [ptr, ptr + length) with one domain.

    `key` is read back with fi_mr_key (FI_MR_PROV_KEY providers choose it); `desc` goes with
    every local buffer (required under FI_MR_LOCAL, harmless otherwise). Under FI_MR_ENDPOINT
    the region is bound to `endpoint` and enabled before use.
    """

    _kind = "mr"

    def __init__(
        self,
        domain: Domain,
        ptr: int,
        length: int,
        access: int,
        requested_key: int,
        endpoint: Endpoint | None = None,
        cuda_device: int | None = None,
    ) -> None:
        out = ffi.new("struct fid_mr **")
        buf = ffi.cast("void *", ptr)
        if cuda_device is None:
            rc = lib.fi_mr_reg(
                domain.handle, buf, length, access, 0, requested_key, 0, out, ffi.NULL
            )
            check("fi_mr_reg", rc)
        else:
            rc = lib.fabp_mr_reg_iface(
                domain.handle,
                buf,
                length,
                access,
                requested_key,
                lib.FI_HMEM_CUDA,
                cuda_device,
                out,
            )
            check("fi_mr_regattr", rc)
        super().__init__(out[0])
        self.domain = domain
        self.ptr = ptr
        self.length = length
        try:
            if domain.info.mr_mode & lib.FI_MR_ENDPOINT:
                if endpoint is None:
                    raise ValueError("provider needs FI_MR_ENDPOINT: pass the endpoint")
                ep_fid = ffi.cast("struct fid *", endpoint.handle)
                check("fi_mr_bind", lib.fi_mr_bind(self.handle, ep_fid, 0))
                check("fi_mr_enable", lib.fi_mr_enable(self.handle))
        except BaseException:
            self.close()
            raise
        self.key = int(lib.fi_mr_key(self.handle))
        self.desc = lib.fi_mr_desc(self.handle)


# Providers whose CQ wakes a sleeper when a write lands (tcp;ofi_rxm: its sockets' epoll
# set). shm's CQ in libfabric 1.17 has no wait object but FI_WAIT_YIELD: its workers nap.
_FD_PROVIDERS = ("tcp",)


def sleeps_on_fd(info: Info) -> bool:
    """Whether a worker on `info`'s provider sleeps on its CQ's fd when idle."""
    return info.provider.split(";")[0] in _FD_PROVIDERS


class FabricStack:
    """fabric -> domain -> CQ + AV -> endpoint for one `Info`, closed children first."""

    def __init__(self, info: Info, cq_size: int | None = None, av_count: int = 64) -> None:
        self.info = info
        self._opened: list[_Fid] = []
        try:
            self.fabric = self._keep(Fabric(info))
            self.domain = self._keep(Domain(self.fabric, info))
            self.cq = self._keep(
                CompletionQueue(self.domain, cq_size or info.tx_size + info.rx_size,
                                wait_fd=sleeps_on_fd(info))
            )
            self.av = self._keep(AddressVector(self.domain, av_count))
            self.endpoint = self._keep(Endpoint(self.domain, self.cq, self.av))
        except BaseException:
            self.close()
            raise

    def _keep(self, fid: _Fid) -> _Fid:
        self._opened.append(fid)
        return fid

    def close(self) -> None:
        """Close endpoint, AV, CQ, domain, fabric; the first failure is raised at the end."""
        first: BaseException | None = None
        while self._opened:
            try:
                self._opened.pop().close()
            except BaseException as exc:  # keep closing the rest, then report
                first = first or exc
        if first is not None:
            raise first
