"""Running libfabric's fi_rma_bw beside ours (S5): the server/client choreography and the report.

A stand-in binary plays fabtests' roles: its server listens on the -E port only after a
moment, and its client connects once without retrying, as fabtests' does; so a runner that
starts the client before the server listens fails here. The real binary runs when
`benchmarks/peers/build_fi_rma_bw.sh` has built it (not in CI: it needs the libfabric sources).
"""

from __future__ import annotations

import os
import stat
import sys
from pathlib import Path

import pytest

from transfer_core.errors import ReferenceToolError
from transfer_core.fi_rma_bw import find_fi_rma_bw, parse_report, run_fi_rma_bw

ROOT = Path(__file__).resolve().parents[2]
REPORT = ("- { xfer_size: 65536, iterations: 2048, total: 134217728, time: 0.017753, "
          "MB/sec: 7560.284346, usec/xfer: 8.668457, Mxfers/sec: 0.115361 }")
FAKE = f'''#!{sys.executable}
import os, socket, sys, time
args = sys.argv[1:]
port = int(next(a for a in args if a.startswith("-E="))[3:])
if "-s" in args:  # server: listens late, waits for the client's connection, then exits
    time.sleep(0.3)
    with socket.socket() as s:
        s.bind(("127.0.0.1", port)); s.listen(1)
        conn, _ = s.accept(); conn.recv(1); conn.close()
    sys.exit(int(os.environ.get("FAKE_SERVER_RC", "0")))
if os.environ.get("FAKE_CLIENT_RC"):  # fails before it reaches the server
    print("fi_getinfo(): -61 (No data available)")
    sys.exit(int(os.environ["FAKE_CLIENT_RC"]))
with socket.create_connection(("127.0.0.1", port)) as c:  # one try, like fabtests
    c.sendall(b"x")
print({REPORT!r})
'''


def write_fake_fi_rma_bw(folder: Path) -> Path:
    """The stand-in, as an executable `fi_rma_bw` in `folder`."""
    path = folder / "fi_rma_bw"
    path.write_text(FAKE)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


@pytest.fixture
def fake(tmp_path: Path) -> Path:
    return write_fake_fi_rma_bw(tmp_path)


def test_the_client_starts_once_the_server_listens(fake: Path) -> None:
    run = run_fi_rma_bw(fake, "tcp", 65536, 2048, timeout_s=20)
    assert (run.xfer_bytes, run.iterations, run.window) == (65536, 2048, 64)
    assert run.gbps == pytest.approx(7.560284346)


def test_a_failing_side_is_an_error_naming_its_exit(fake: Path, monkeypatch) -> None:
    monkeypatch.setenv("FAKE_SERVER_RC", "3")
    with pytest.raises(ReferenceToolError, match="exited 0/3"):
        run_fi_rma_bw(fake, "shm", 4096, 8, timeout_s=20)


def test_a_client_that_fails_early_is_reported_not_waited_out(fake: Path, monkeypatch) -> None:
    """The server is left waiting for a client that never came: it is stopped, and the error
    carries the client's exit and its words, not a timeout."""
    monkeypatch.setenv("FAKE_CLIENT_RC", "1")
    with pytest.raises(ReferenceToolError, match=r"exited 1/.*No data available"):
        run_fi_rma_bw(fake, "tcp", 4096, 8, timeout_s=60)


def test_a_report_without_a_result_line_is_an_error() -> None:
    with pytest.raises(ReferenceToolError, match="no fi_rma_bw result"):
        parse_report("fi_getinfo: -61\n", "tcp", 64)
    assert parse_report(f"noise\n{REPORT}\n", "shm", 16).us_per_xfer == pytest.approx(8.668457)


def test_find_prefers_the_explicit_path_and_rejects_a_non_executable(fake: Path,
                                                                    tmp_path: Path,
                                                                    monkeypatch) -> None:
    monkeypatch.delenv("FI_RMA_BW", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    assert find_fi_rma_bw(fake) == fake
    assert find_fi_rma_bw(also=[fake.parent]) == fake
    assert find_fi_rma_bw(also=[tmp_path / "nowhere"]) is None
    plain = tmp_path / "plain"
    plain.write_text("")
    with pytest.raises(ReferenceToolError, match="not an executable"):
        find_fi_rma_bw(plain)


@pytest.mark.fabric
@pytest.mark.parametrize("provider", ["tcp", "shm"])
def test_the_real_fi_rma_bw_moves_verified_bytes(provider: str) -> None:
    binary = find_fi_rma_bw(also=[ROOT / ".venv-peers" / "bin"])
    if binary is None:
        pytest.skip("fi_rma_bw not built (benchmarks/peers/build_fi_rma_bw.sh)")
    run = run_fi_rma_bw(binary, provider, 65536, 64, verify=True, timeout_s=60)
    assert run.iterations == 64 and run.gbps > 0
