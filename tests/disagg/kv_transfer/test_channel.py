"""Addresses of control connections: host:port, [ipv6]:port, and a real IPv6 round trip (S2).
The channel's defences (nonces, sequence numbers, limits, timeouts) are in
test_channel_defences.py."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest
from hypothesis import given
from hypothesis import strategies as st

from disagg.control.address import format_address, listen, parse_address
from disagg.control.channel import Channel
from disagg.control.messages import Heartbeat, Shutdown


@pytest.mark.parametrize(("address", "expected"), [
    ("127.0.0.1:7000", ("127.0.0.1", 7000)),
    ("localhost:0", ("localhost", 0)),
    ("node-3.cluster.local:65535", ("node-3.cluster.local", 65535)),
    ("[::1]:7000", ("::1", 7000)),
    ("[fe80::1%eth0]:80", ("fe80::1%eth0", 80)),
    ("[2001:db8::7]:1", ("2001:db8::7", 1)),
])
def test_parse_address(address: str, expected: tuple[str, int]) -> None:
    """IPv4, host names and bracketed IPv6 hosts split into (host, port)."""
    assert parse_address(address) == expected


@pytest.mark.parametrize("address", [
    "::1:7000", "2001:db8::7:80", "fe80::1",
])
def test_bare_ipv6_is_refused_asking_for_brackets(address: str) -> None:
    """Without brackets an IPv6 port is ambiguous: refused, naming the address and brackets."""
    with pytest.raises(ValueError, match="brackets") as error:
        parse_address(address)
    assert repr(address) in str(error.value)


@pytest.mark.parametrize("address", [
    "", "host", ":7000", "host:", "host:http", "host:-1", "host:65536", "host:7000 ",
    "[::1]", "[::1]7000", "[::1]:", "[]:7000", "[::1:7000", "[::1]]:7000", "host:¹",
])
def test_malformed_addresses_are_value_errors(address: str) -> None:
    """Every malformed address is a ValueError that names it."""
    with pytest.raises(ValueError, match="address") as error:
        parse_address(address)
    assert repr(address) in str(error.value)


@given(host=st.ip_addresses().map(str)
       | st.from_regex(r"[a-z][a-z0-9-]{0,20}(\.[a-z][a-z0-9-]{0,20}){0,3}", fullmatch=True),
       port=st.integers(0, 65535))
def test_format_address_round_trips(host: str, port: int) -> None:
    """What a node prints with format_address, parse_address reads back."""
    assert parse_address(format_address(host, port)) == (host, port)


def test_format_address_brackets_ipv6_only() -> None:
    assert format_address("::1", 7000) == "[::1]:7000"
    assert format_address("10.0.0.2", 7000) == "10.0.0.2:7000"


def has_ipv6_loopback() -> bool:
    """Whether this machine can bind ::1 (containers often have IPv6 disabled)."""
    if not socket.has_ipv6:
        return False
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as probe:
            probe.bind(("::1", 0))
    except OSError:
        return False
    return True


@pytest.fixture
def ipv6_server() -> Iterator[socket.socket]:
    if not has_ipv6_loopback():
        pytest.skip("no IPv6 loopback on this machine")
    server = listen("[::1]:0")
    yield server
    server.close()


def test_messages_round_trip_over_ipv6_loopback(ipv6_server: socket.socket) -> None:
    """listen("[::1]:0") listens on IPv6 and Channel.connect reaches it by its printed address."""
    assert ipv6_server.family == socket.AF_INET6
    host, port = ipv6_server.getsockname()[:2]
    client = Channel.connect(format_address(host, port), timeout_s=5.0, secret=b"")
    accepted, _ = ipv6_server.accept()
    server_end = Channel(accepted, "client", secret=b"")
    try:
        client.send(Heartbeat())
        server_end.send(Shutdown())
        assert isinstance(server_end.recv(), Heartbeat)
        assert isinstance(client.recv(), Shutdown)
        assert client.peer == f"[::1]:{port}"
    finally:
        client.close()
        server_end.close()


def test_ipv4_listen_stays_ipv4() -> None:
    server = listen("127.0.0.1:0")
    try:
        assert server.family == socket.AF_INET
    finally:
        server.close()
