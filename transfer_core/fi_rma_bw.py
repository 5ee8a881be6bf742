"""libfabric's own RMA bandwidth test, `fi_rma_bw`, as the yardstick for our writes (S5).

`fi_rma_bw` comes from fabtests in the libfabric repository, built against the libfabric this
machine links (`benchmarks/peers/build_fi_rma_bw.sh`); nothing here builds or ships it. One
measurement is a server and a client process on loopback: the client posts `iterations`
writes with remote CQ data (`-o writedata`) of `xfer_bytes` each, `window` in flight at a
time, and reports the bytes over the loop's time. It writes ONE source buffer to ONE remote
address, so both stay in cache: compare it with our small batches as well as with the
128 MiB paged workload of `bench.py`, whose pages go to shuffled slots.

The two processes find each other over a TCP socket on 127.0.0.1 (`-E`); the client starts
once the server is listening there, because fabtests' client does not retry a refused connect.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from transfer_core.errors import ReferenceToolError

# Our provider names -> fabtests' -p argument (ofi_rxm layers RDM endpoints over tcp's MSG ones).
PROVIDER_NAMES = {"tcp": "tcp;ofi_rxm", "shm": "shm", "verbs": "verbs;ofi_rxm", "efa": "efa"}
_RESULT = re.compile(r"xfer_size:\s*(\d+),\s*iterations:\s*(\d+),\s*total:\s*(\d+),\s*"
                     r"time:\s*([\d.]+),\s*MB/sec:\s*([\d.]+),\s*usec/xfer:\s*([\d.]+)")
_LISTEN = "0A"  # TCP_LISTEN in /proc/net/tcp


@dataclass(frozen=True, slots=True)
class FiRmaBwRun:
    """One client's report: `gbps` is 1e9 bytes/s, as fabtests' MB/sec is 1e6 bytes/s."""

    provider: str
    xfer_bytes: int
    iterations: int
    window: int
    seconds: float
    gbps: float
    us_per_xfer: float


def find_fi_rma_bw(explicit: str | os.PathLike[str] | None = None,
                   also: Iterable[Path] = ()) -> Path | None:
    """`explicit`, else $FI_RMA_BW, else `fi_rma_bw` on PATH, else in one of `also`."""
    for candidate in (explicit, os.environ.get("FI_RMA_BW")):
        if candidate:
            path = Path(candidate)
            if not (path.is_file() and os.access(path, os.X_OK)):
                raise ReferenceToolError(f"{path} is not an executable fi_rma_bw")
            return path
    for search in (None, os.pathsep.join(str(d) for d in also)):  # None: PATH
        found = shutil.which("fi_rma_bw", path=search)
        if found:
            return Path(found)
    return None


def run_fi_rma_bw(binary: Path, provider: str, xfer_bytes: int, iterations: int, *,
                  window: int = 64, warmup: int = 10, verify: bool = False,
                  timeout_s: float = 60.0) -> FiRmaBwRun:
    """One server/client pair; `verify` turns on fabtests' data integrity checks (-v), which
    slow the loop: use it for a check, not for the number."""
    name = PROVIDER_NAMES.get(provider, provider)
    port = _free_port()
    common = [str(binary), "-p", name, "-e", "rdm", "-o", "writedata", "-S", str(xfer_bytes),
              "-I", str(iterations), "-W", str(window), "-w", str(warmup), "-m", f"-E={port}",
              *(["-v"] if verify else [])]
    deadline = time.monotonic() + timeout_s
    with subprocess.Popen([*common, "-s", "127.0.0.1"], stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True) as server:
        try:
            _wait_listening(port, server, deadline)
            try:
                client = subprocess.run([*common, "127.0.0.1"], capture_output=True, text=True,
                                        timeout=max(deadline - time.monotonic(), 1.0),
                                        check=False)
            except subprocess.TimeoutExpired as exc:
                raise ReferenceToolError(f"fi_rma_bw ({name}) ran past {timeout_s:.0f} s") from exc
            # A client that failed leaves a server waiting for it: its output is the story.
            wait_s = max(deadline - time.monotonic(), 1.0) if client.returncode == 0 else 0.5
            try:
                server_out, _ = server.communicate(timeout=wait_s)
            except subprocess.TimeoutExpired:
                server.kill()
                server_out, _ = server.communicate()
        finally:
            if server.poll() is None:
                server.kill()
    if client.returncode != 0 or server.returncode != 0:
        tail = (client.stdout + client.stderr + server_out).strip().splitlines()[-4:]
        raise ReferenceToolError(f"fi_rma_bw ({name}) exited {client.returncode}/"
                                 f"{server.returncode}: {' | '.join(tail)}")
    return parse_report(client.stdout, provider, window)


def parse_report(text: str, provider: str, window: int) -> FiRmaBwRun:
    """The `-m` (machine readable) line of a client's output."""
    found = _RESULT.search(text)
    if found is None:
        raise ReferenceToolError(f"no fi_rma_bw result line in: {text.strip()[-200:]!r}")
    size, iterations, _total, seconds, mb_per_s, us = found.groups()
    return FiRmaBwRun(provider, int(size), int(iterations), window, float(seconds),
                      float(mb_per_s) / 1e3, float(us))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_listening(port: int, server: subprocess.Popen[str], deadline: float) -> None:
    listening = {f"0100007F:{port:04X} {_LISTEN}", f"00000000:{port:04X} {_LISTEN}"}
    while time.monotonic() < deadline:
        if server.poll() is not None:
            out = (server.stdout.read() if server.stdout else "").strip().splitlines()[-3:]
            raise ReferenceToolError(f"fi_rma_bw server exited {server.returncode} before "
                                     f"listening: {' | '.join(out)}")
        with open("/proc/net/tcp") as f:
            if any(f"{parts[1]} {parts[3]}" in listening
                   for parts in (line.split() for line in f) if len(parts) > 3):
                return
        time.sleep(0.005)
    raise ReferenceToolError(f"fi_rma_bw server never listened on 127.0.0.1:{port}")
