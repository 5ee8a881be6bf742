"""A hostile process on the fabric for `load.py`: guessed keys, guessed immediates and forged
Hellos against one decoder of a running cluster (S5). It shares no memory with them.

What it knows is what an attacker on the network learns. Control traffic is not encrypted (the
cluster secret authenticates, it does not hide), so it taps the loopback (AF_PACKET, needs
CAP_NET_RAW) and reads the victim's Hello on its way to a prefiller: the engine address
(endpoints and warm-up probe keys, public by design) and the KV and context descriptors. The
Hello's real KV key would let it write the cache, which the design note concedes to anyone
reading traffic, so it does not use it. Each round until told to stop it sends:

* a flood of zero-byte immediates with guessed values (random 32-bit, and 1..16 as requests
  once got) through the public probe region, past the decoder's bound on unarmed values;
* one 4 KiB RDMA write of 0xFF with a guessed 64-bit key at offset 0 of the decoder's endpoint
  (a wrong key makes tcp drop that connection, so it goes last);
* every 4th round, to every prefiller: a forged Hello naming the decoder's memory, as
  "attacker" then a KVRequest without proof; as the decoder itself then a guessed proof; or
  with the decoder's endpoint but guessed keys (all an attacker without the Hello could name).

Without CAP_NET_RAW it knows only what any local process can read: the decoder's fabric port
from /proc. No probe key then, so each immediate is a key guess too, and it forges no Hello.
The decoder's count of dropped immediates (`TransferEngine.dropped_imms`) is no node metric,
so it is not reported; what is counted is what was sent and how the prefillers answered.
"""

from __future__ import annotations

import dataclasses
import multiprocessing as mp
import os
import secrets
import select
import socket
import struct
import threading
import time
from typing import Any

import numpy as np

from disagg.control.channel import Channel
from disagg.control.framing import HEADER, MAGIC, PROTOCOL_VERSION, decode_header, decode_payload
from disagg.control.messages import Reject
from disagg.errors import DisaggError, ProtocolError
from disagg.kv_transfer.context_slot import new_nonce
from disagg.kv_transfer.messages import Hello, HelloAck, HelloProof, KVRequest
from transfer_core.engine import TransferEngine
from transfer_core.errors import TransferError
from transfer_core.imm_counter import MAX_IMM
from transfer_core.memory import EngineAddress, MemoryRegionDescriptor

ETH_P_ALL, PACKET_OUTGOING, ETH_HEADER = 3, 4, 14
HELLO_PREFIX = MAGIC + bytes([PROTOCOL_VERSION, Hello.TYPE])
ANSWER_S = 5.0  # how long a prefiller gets to answer a forged Hello


def tap_hellos(found: dict[tuple[str, int], Hello], stop: threading.Event,
               sock: socket.socket) -> None:
    """Read every Hello frame crossing the loopback into `found`: (node id, the port it went
    to) -> Hello. Other clusters may run on this host; the port tells which is which."""
    flows: dict[bytes, bytearray] = {}  # a TCP flow whose Hello is not whole yet
    while not stop.is_set():
        try:
            packet, (_, _, pkttype, _, _) = sock.recvfrom(1 << 17)
        except TimeoutError:
            continue
        ip = packet[ETH_HEADER:]
        if pkttype == PACKET_OUTGOING or len(ip) < 20 or ip[0] >> 4 != 4 or ip[9] != 6:
            continue  # each loopback packet is seen twice; IPv4 TCP only
        ihl = (ip[0] & 15) * 4
        (total,) = struct.unpack("!H", ip[2:4])
        tcp = ip[ihl:total]
        payload, flow = tcp[(tcp[12] >> 4) * 4:], ip[12:20] + tcp[:4]
        buffer = flows.get(flow)
        if buffer is None:
            at = payload.find(HELLO_PREFIX)
            if at < 0:
                continue
            buffer = flows[flow] = bytearray(payload[at:])
        else:
            buffer += payload
        if len(buffer) < HEADER.size:
            continue
        try:
            cls, length, _ = decode_header(bytes(buffer[:HEADER.size]))
            if len(buffer) < HEADER.size + length and length < 1 << 20:
                continue
            del flows[flow]
            hello = decode_payload(cls, bytes(buffer[HEADER.size:HEADER.size + length]))
        except ProtocolError:
            flows.pop(flow, None)
            continue
        if isinstance(hello, Hello):
            found[hello.node_id, struct.unpack("!H", flow[10:12])[0]] = hello


def endpoint_from_proc(pid: int, known_ports: set[int]) -> bytes:
    """The tcp provider's endpoint address of process `pid`: a sockaddr_in of its listening
    socket that is none of `known_ports` (what `fi_getname` gives, as a peer reads it)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        link = os.readlink(f"/proc/{pid}/fd/{fd}")
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    with open("/proc/net/tcp") as table:
        for line in table.readlines()[1:]:
            fields = line.split()
            host, port = fields[1].split(":")
            if fields[3] == "0A" and fields[9] in inodes and int(port, 16) not in known_ports:
                ip = bytes.fromhex(host)[::-1]  # /proc prints the address little-endian
                return struct.pack("<H", socket.AF_INET) + struct.pack("!H", int(port, 16)) + (
                    ip + bytes(8))
    raise DisaggError(f"no fabric endpoint found for pid {pid}")


class Attack:
    """The attack loop's state: the attacker's engine, the victim, and what was sent."""

    def __init__(self, engine: TransferEngine, endpoint: bytes, probe: tuple[int, int] | None,
                 hello: Hello | None, prefillers: list[str]) -> None:
        self.engine, self.endpoint, self.hello = engine, endpoint, hello
        self.prefillers = prefillers
        self.source, _ = engine.register_memory(np.full(4096, 255, np.uint8), remote_write=False)
        key, raddr = probe if probe else (0, 0)
        self.probe = MemoryRegionDescriptor("probe", engine.provider, raddr, 64, True, True,
                                            ((endpoint, key),))
        self.counts = {"guessed_key_writes": 0, "guessed_imms": 0, "forged_hellos": 0,
                       "forged_hellos_refused": 0, "forged_hellos_unanswered": 0,
                       "forged_hellos_unreachable": 0,
                       "forged_hellos_accepted": 0, "op_errors": 0}
        self.refusals: list[str] = []
        self._round = 0

    def _post_all(self, posts: list[Any]) -> None:
        left, lock, finished = [len(posts)], threading.Lock(), threading.Event()

        def done(error: object = None) -> None:
            with lock:
                self.counts["op_errors"] += error is not None
                left[0] -= 1
                if left[0] == 0:
                    finished.set()

        for post in posts:
            try:
                post(done, done)
            except TransferError:
                done("refused at post")
        finished.wait(10.0)

    def one_round(self, num_imms: int) -> None:
        """A flood of guessed immediates, one guessed-key write, every 4th round a forged
        Hello (in that order: a wrong key makes tcp drop the connection, losing what follows)."""
        self._round += 1
        imms = list(range(1, 17)) if self._round == 1 else []  # as requests once got them
        imms += [secrets.randbelow(MAX_IMM) + 1 for _ in range(num_imms)]
        if self.hello is None:  # no probe key: each immediate is also a key guess
            imms = imms[:1]
            self.probe = dataclasses.replace(self.probe, domains=((self.endpoint,
                                                                   secrets.randbits(64)),))
        self._post_all([lambda ok, err, imm=imm: self.engine.post_imm(
            imm, self.probe, ok, err, timeout_s=5.0) for imm in imms])
        self.counts["guessed_imms"] += len(imms)
        guess = MemoryRegionDescriptor("guess", self.engine.provider, 0, 4096, False, True,
                                       ((self.endpoint, secrets.randbits(64)),))
        self._post_all([lambda ok, err: self.engine.post_write(
            self.source, 0, 4096, None, guess, 0, ok, err, timeout_s=5.0)])
        self.counts["guessed_key_writes"] += 1
        if self.hello is not None and self._round % 4 == 0:
            for address in self.prefillers:
                self.forge_hello(address, self._round // 4 % 3)

    def forge_hello(self, address: str, variant: int) -> None:
        """Variant 0: the decoder's Hello as "attacker", then a KVRequest without proof;
        1: as the decoder itself, then a guessed proof; 2: its endpoint with guessed keys."""
        assert self.hello is not None
        hello = dataclasses.replace(self.hello, node_id="attacker")
        if variant == 1:
            hello = self.hello
        elif variant == 2:
            hello = dataclasses.replace(
                hello, engine_address=dataclasses.replace(
                    EngineAddress.from_bytes(hello.engine_address),
                    probes=((secrets.randbits(64), 0),)).to_bytes(),
                kv_descriptors=[_rekeyed(d) for d in hello.kv_descriptors],
                context_descriptor=_rekeyed(hello.context_descriptor))
        follow_up = (KVRequest("evil", 1, 2, list(range(3, 12)), [0, 1], 0, nonce=new_nonce())
                     if variant == 0 else HelloProof(new_nonce()))
        self.counts["forged_hellos"] += 1
        try:
            channel = Channel.connect(address, timeout_s=ANSWER_S)
        except DisaggError:
            self.counts["forged_hellos_unreachable"] += 1  # a dead prefiller
            return
        try:
            channel.send(hello)
            reply = _answer(channel)
            if isinstance(reply, HelloAck):
                channel.send(follow_up)
                reply = _answer(channel)
                if reply is None:
                    self.counts["forged_hellos_accepted"] += 1  # nothing refused the forgery
                    return
            if reply is None:
                self.counts["forged_hellos_unanswered"] += 1  # a frozen prefiller
            else:
                self.counts["forged_hellos_refused"] += 1
                reason = reply.reason if isinstance(reply, Reject) else str(reply)
                self.refusals.append(f"variant {variant}: {reason}"[:160])
        finally:
            channel.close()


def _rekeyed(descriptor: bytes) -> bytes:
    region = MemoryRegionDescriptor.from_bytes(descriptor)
    keys = tuple((endpoint, secrets.randbits(64)) for endpoint, _ in region.domains)
    return dataclasses.replace(region, domains=keys).to_bytes()


def _answer(channel: Channel) -> Any:
    """The peer's next message, or None if none came in time; a closed connection is a
    refusal too."""
    if not select.select([channel.sock], [], [], ANSWER_S)[0]:
        return None
    try:
        return channel.recv()
    except DisaggError as error:
        return Reject(f"connection closed: {error}")


def _child(conn: Any, victim: str, stop: Any) -> None:
    """The hostile process: tap, wait for the cluster, attack until `stop`, report."""
    found: dict[tuple[str, int], Hello] = {}
    tap_stop = threading.Event()
    try:
        sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.ntohs(ETH_P_ALL))
        sock.bind(("lo", 0))
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16 << 20)
        sock.settimeout(0.2)
        threading.Thread(target=tap_hellos, args=(found, tap_stop, sock), daemon=True).start()
        view = "tapped Hello"
    except OSError as error:
        view = f"endpoint from /proc (no tap: {error.strerror})"
    conn.send("tapping")
    prefillers, pid, known_ports = conn.recv()  # the cluster is up
    ours = {(victim, int(address.rsplit(":", 1)[1])) for address in prefillers}
    deadline = time.monotonic() + 30.0
    while view == "tapped Hello" and not ours & found.keys() and time.monotonic() < deadline:
        time.sleep(0.05)
    tap_stop.set()
    hello = next((found[key] for key in ours if key in found), None)
    if hello is not None:
        address = EngineAddress.from_bytes(hello.engine_address)
        endpoint, probe = address.domains[0], address.probes[0]
    else:
        view = view if view != "tapped Hello" else "endpoint from /proc (Hello not seen)"
        endpoint, probe = endpoint_from_proc(pid, known_ports), None
    with TransferEngine("tcp") as engine:
        attack = Attack(engine, endpoint, probe, hello, prefillers)
        conn.send(view)
        while not conn.poll(0.2):  # for "go"
            if stop.is_set():
                break
        while not stop.is_set():
            attack.one_round(num_imms=150)
            stop.wait(0.25)  # and a new connection for the next key guess
        conn.send({"view": view, **attack.counts, "refusals": sorted(set(attack.refusals))})


class HostileClient:
    """The parent's handle: `start` before the cluster (so the tap sees its handshakes),
    `arm` once it is up, `go` when the load starts, `stop` for the counts."""

    def __init__(self, victim: str) -> None:
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._stop = ctx.Event()
        self.process = ctx.Process(target=_child, args=(child, victim, self._stop), daemon=True)
        self.process.start()
        self.view = ""
        assert self._recv(60.0) == "tapping"

    def _recv(self, timeout_s: float) -> Any:
        if not self._conn.poll(timeout_s):
            raise DisaggError("the hostile process did not answer")
        return self._conn.recv()

    def arm(self, prefillers: list[str], pid: int, known_ports: set[int]) -> str:
        """The prefillers' control addresses (public) and, for the fallback, the victim's pid
        and the ports that are not its fabric endpoint; returns what the attacker knows."""
        self._conn.send((prefillers, pid, known_ports))
        self.view = self._recv(60.0)
        return self.view

    def go(self) -> None:
        self._conn.send("go")

    def stop(self) -> dict[str, Any]:
        """Stop attacking; what was sent and how the prefillers answered."""
        self._stop.set()
        try:
            return self._recv(60.0)
        finally:
            self.process.join(10.0)
            if self.process.is_alive():
                self.process.kill()
