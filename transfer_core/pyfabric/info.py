"""Provider discovery: fi_getinfo hints for RDM + RMA writes with remote CQ data (S5).

`find_infos` walks a provider preference list (the CI default `tcp;ofi_rxm`, `tcp`, `net`;
`shm`; `efa` or `verbs;ofi_rxm` on clusters) and returns the entries of the first provider
that matches. The hints allow every mr_mode bit the binding honours, so the *returned*
`Info.mr_mode` says what the provider needs (FI_MR_LOCAL, VIRT_ADDR, ALLOCATED, PROV_KEY,
ENDPOINT); callers must read it, never assume it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ._pyfabric import ffi, lib
from .errors import ProviderNotFoundError, check, fabric_error

# Shorthands accepted wherever a provider preference is expected. libfabric >= 1.18 serves
# RDM natively as `tcp` and drops `net`, so the tcp class lists all three spellings.
PROVIDER_ALIASES: dict[str, tuple[str, ...]] = {
    "tcp": ("tcp;ofi_rxm", "tcp", "net"),
    "shm": ("shm",),
    "efa": ("efa",),
    "verbs": ("verbs;ofi_rxm",),
}
DEFAULT_PROVIDERS = PROVIDER_ALIASES["tcp"]

# The mr_mode bits this binding knows how to honour; a provider may demand any subset.
SUPPORTED_MR_MODE = (
    lib.FI_MR_LOCAL
    | lib.FI_MR_VIRT_ADDR
    | lib.FI_MR_ALLOCATED
    | lib.FI_MR_PROV_KEY
    | lib.FI_MR_ENDPOINT
)
MIN_CQ_DATA_BYTES = 4

# `node="auto"`: socket providers bind to loopback (else they list eth0 first, the CI trap);
# NIC providers (efa, verbs) take every device. Pass an address to pick an interface.
AUTO_NODE = "auto"
LOOPBACK = "127.0.0.1"
_SOCKET_PROVIDERS = ("tcp", "net", "sockets", "udp")

_PROGRESS_NAMES = {
    lib.FI_PROGRESS_AUTO: "auto",
    lib.FI_PROGRESS_MANUAL: "manual",
    lib.FI_PROGRESS_UNSPEC: "unspec",
}


def resolve_providers(provider: str | Sequence[str]) -> tuple[str, ...]:
    """An alias ("tcp", "shm", ...) or a single provider name or a preference list."""
    if isinstance(provider, str):
        return PROVIDER_ALIASES.get(provider, (provider,))
    names = tuple(provider)
    if not names:
        raise ValueError("provider preference list is empty")
    return names


class Info:
    """One fi_info entry, owned (duplicated) so it outlives the list it came from."""

    def __init__(self, raw: object) -> None:
        self._raw = ffi.gc(lib.fi_dupinfo(raw), lib.fi_freeinfo)
        if self._raw == ffi.NULL:
            raise fabric_error("fi_dupinfo", -lib.FI_ENODATA)

    @property
    def raw(self) -> object:
        """The `struct fi_info *` for fi_fabric/fi_domain/fi_endpoint."""
        return self._raw

    @property
    def provider(self) -> str:
        return ffi.string(self._raw.fabric_attr.prov_name).decode()

    @property
    def domain_name(self) -> str:
        return ffi.string(self._raw.domain_attr.name).decode()

    @property
    def caps(self) -> int:
        return int(self._raw.caps)

    @property
    def mr_mode(self) -> int:
        return int(self._raw.domain_attr.mr_mode)

    @property
    def mr_key_size(self) -> int:
        """Bytes of a memory key (what a requested key may use); 8 where the provider says 0."""
        return int(self._raw.domain_attr.mr_key_size) or 8

    @property
    def cq_data_size(self) -> int:
        return int(self._raw.domain_attr.cq_data_size)

    @property
    def tx_size(self) -> int:
        return int(self._raw.tx_attr.size)

    @property
    def rx_size(self) -> int:
        return int(self._raw.rx_attr.size)

    @property
    def inject_size(self) -> int:
        return int(self._raw.tx_attr.inject_size)

    @property
    def max_msg_size(self) -> int:
        return int(self._raw.ep_attr.max_msg_size)

    @property
    def data_progress(self) -> str:
        return _PROGRESS_NAMES.get(self._raw.domain_attr.data_progress, "other")

    @property
    def hmem(self) -> bool:
        return bool(self.caps & lib.FI_HMEM)

    def __repr__(self) -> str:
        return (
            f"Info(provider={self.provider!r}, domain={self.domain_name!r}, "
            f"mr_mode={self.mr_mode:#x}, cq_data_size={self.cq_data_size}, "
            f"tx_size={self.tx_size}, progress={self.data_progress})"
        )


@dataclass(frozen=True)
class InfoRequest:
    """What to ask fi_getinfo for; `node` (with FI_SOURCE) picks the local interface."""

    provider: str
    node: str | None = AUTO_NODE
    hmem: bool = False
    delivery_complete: bool = False
    domain_name: str | None = None


def _make_hints(req: InfoRequest) -> object:
    hints = ffi.gc(lib.fi_allocinfo(), lib.fi_freeinfo)
    if hints == ffi.NULL:
        raise fabric_error("fi_allocinfo", -12)
    hints.caps = lib.FI_MSG | lib.FI_RMA | lib.FI_WRITE | lib.FI_REMOTE_WRITE
    hints.mode = lib.FI_CONTEXT | lib.FI_CONTEXT2
    hints.ep_attr.type = lib.FI_EP_RDM
    hints.domain_attr.mr_mode = SUPPORTED_MR_MODE
    if req.hmem:
        hints.caps |= lib.FI_HMEM
        hints.domain_attr.mr_mode |= lib.FI_MR_HMEM
    if req.delivery_complete:
        # Sender completion then means "placed at the target" (tcp reports bad writes).
        hints.tx_attr.op_flags = lib.FI_DELIVERY_COMPLETE
    check("fabp_set_prov_name", lib.fabp_set_prov_name(hints, req.provider.encode()))
    if req.domain_name is not None:
        check("fabp_set_domain_name", lib.fabp_set_domain_name(hints, req.domain_name.encode()))
    return hints


def source_node(provider: str, node: str | None) -> str | None:
    """The node fi_getinfo gets for `provider`. shm never gets one: it names endpoints
    itself, and a node would become part of the name and collide between processes."""
    core = provider.split(";")[0]
    if core == "shm":
        return None
    if node == AUTO_NODE:
        return LOOPBACK if core in _SOCKET_PROVIDERS else None
    return node


def get_infos(req: InfoRequest) -> list[Info]:
    """All fi_info entries for one provider that can carry 4-byte immediates; may be empty."""
    hints = _make_hints(req)
    node = source_node(req.provider, req.node)
    out = ffi.new("struct fi_info **")
    rc = lib.fi_getinfo(
        lib.fabp_api_version(),
        node.encode() if node else ffi.NULL,
        ffi.NULL,
        lib.FI_SOURCE if node else 0,
        hints,
        out,
    )
    if rc == -lib.FI_ENODATA:
        return []
    check("fi_getinfo", rc)
    infos = []
    try:
        entry = out[0]
        while entry != ffi.NULL:
            if entry.domain_attr.cq_data_size >= MIN_CQ_DATA_BYTES:
                infos.append(Info(entry))
            entry = entry.next
    finally:
        lib.fi_freeinfo(out[0])
    return infos


def find_infos(
    providers: str | Sequence[str],
    node: str | None = AUTO_NODE,
    hmem: bool = False,
    delivery_complete: bool = False,
) -> list[Info]:
    """The matching entries of the first provider in the preference list that has any."""
    tried = []
    for name in resolve_providers(providers):
        req = InfoRequest(name, node=node, hmem=hmem, delivery_complete=delivery_complete)
        infos = get_infos(req)
        if infos:
            return infos
        tried.append(name)
    raise ProviderNotFoundError(
        f"no libfabric provider among {tried} offers FI_EP_RDM with RMA writes and "
        f">= {MIN_CQ_DATA_BYTES} bytes of CQ data (hmem={hmem}, node={node!r})"
    )
