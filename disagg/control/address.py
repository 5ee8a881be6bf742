"""Control-plane addresses: "host:port" or "[ipv6]:port", parsed, formatted and listened on (S2)."""

from __future__ import annotations

import socket


def parse_address(address: str) -> tuple[str, int]:
    """"host:port" or "[ipv6]:port" -> (host, port), with an error naming a malformed address.

    An IPv6 host must be in brackets: in "::1:7000" nothing tells the port from the last
    group of the address, so it is refused rather than guessed.

    >>> parse_address("[::1]:7000")
    ('::1', 7000)
    """
    if address.startswith("["):
        host, sep, port = address[1:].partition("]:")
        if not sep or "]" in host:
            raise ValueError(f"address {address!r} is not [host]:port")
    else:
        host, sep, port = address.rpartition(":")
        if ":" in host:
            raise ValueError(f"address {address!r}: an IPv6 host must be in brackets, "
                             "as in [::1]:7000")
        if not sep:
            raise ValueError(f"address {address!r} is not host:port")
    # isdecimal, not isdigit: int() refuses some digits (superscripts) that isdigit accepts.
    if not host or not port.isdecimal() or int(port) > 65535:
        raise ValueError(f"address {address!r} is not host:port (port 0-65535)")
    return host, int(port)


def format_address(host: str, port: int) -> str:
    """The "host:port" that `parse_address` reads back: an IPv6 host goes in brackets.

    >>> format_address("::1", 7000)
    '[::1]:7000'
    """
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def listen(address: str) -> socket.socket:
    """A listening socket on `host:port` or `[ipv6]:port` (port 0 picks a free one)."""
    host, port = parse_address(address)
    # create_server defaults to IPv4, where an IPv6 literal does not resolve.
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    return socket.create_server((host, port), family=family, reuse_port=False)
