"""`disagg bench transfer`: both batch sizes, fi_rma_bw beside them with our ratio, and the
messengers' path (S5).

Our workload and the messengers' path are stood in for (their two processes are tested in
transfer_core's tests and test_benchmark_messenger_path.py); the fi_rma_bw stand-in is a real
server/client pair on loopback, as in test_fi_rma_bw.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import disagg.kv_transfer.messenger_bench
import transfer_core.bench
from tests.disagg.apps.test_cli import run_cli
from tests.transfer_core.test_fi_rma_bw import write_fake_fi_rma_bw


def _ours(provider: str, num_pages: int, page_bytes: int, one_buffer: bool = False,
          **_: object) -> dict:
    return {"provider": provider, "num_pages": num_pages, "page_bytes": page_bytes,
            "gbps": 6.05 if one_buffer else 3.78, "gbps_initiator": 4.21, "us_per_page": 1.0,
            "latency_us_p50": 20.0, "latency_us_p99": 40.0, "verified": True}


@pytest.fixture
def fake_binary(tmp_path: Path) -> Path:
    return write_fake_fi_rma_bw(tmp_path)


def test_both_batch_sizes_run_each_beside_fi_rma_bw_and_ours_on_its_pattern(fake_binary: Path, monkeypatch,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(transfer_core.bench, "run_transfer_benchmark", _ours)
    code, out, _ = run_cli(["bench", "transfer", "--provider", "tcp", "--pages", "2048",
                         "--small-pages", "64", "--fi-rma-bw", str(fake_binary),
                         "--no-messenger", "--json"], capsys)
    assert code == 0
    results = json.loads(out)
    assert [r["num_pages"] for r in results] == [2048, 64]
    assert all(r["fi_rma_bw_gbps"] == pytest.approx(7.560284346) for r in results)
    assert all(r["one_buffer_gbps"] == 6.05 and r["gbps"] == 3.78 for r in results)
    code, out, _ = run_cli(["bench", "transfer", "--small-pages", "0", "--fi-rma-bw",
                         str(fake_binary), "--no-messenger"], capsys)
    assert code == 0 and "7.56" in out and "0.50" in out  # the ratio: 3.78 / 7.56
    assert "6.05" in out and "0.80" in out  # one page: 6.05 / 7.56
    assert "sender" in out and "4.21" in out  # at the sender's own completions


def test_a_named_fi_rma_bw_that_is_not_executable_is_a_usage_error(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    plain = tmp_path / "fi_rma_bw"
    plain.write_text("")
    code, _, err = run_cli(["bench", "transfer", "--fi-rma-bw", str(plain)], capsys)
    assert code == 2
    assert "not an executable" in err


def _messenger(provider: str, shape: object, reps: int) -> dict:
    paths = {p: {"us_per_write": us} for p, us in
             (("messenger", 6.5), ("ungrouped", 7.5), ("prepared", 13.0))}
    return {"writes": 1920, "write_bytes": 12288, "paths": paths,
            "messenger_over_prepared": 0.5, "verified": True}


def test_the_messengers_path_is_reported_once_per_provider(
        monkeypatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)  # no fi_rma_bw in reach: no ./.venv-peers, none on PATH
    monkeypatch.delenv("FI_RMA_BW", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(transfer_core.bench, "run_transfer_benchmark", _ours)
    monkeypatch.setattr(disagg.kv_transfer.messenger_bench, "measure", _messenger)
    code, out, _ = run_cli(["bench", "transfer", "--provider", "all", "--json"], capsys)
    assert code == 0
    results = json.loads(out)
    assert [("messenger" in r) for r in results] == [True, False, True, False]
    assert results[0]["messenger"]["us_per_write_prepared"] == 13.0
    code, out, _ = run_cli(["bench", "transfer", "--small-pages", "0"], capsys)
    assert code == 0 and "1920 x 12288 B" in out and "0.50" in out


def test_a_failing_fi_rma_bw_loses_none_of_our_rows(fake_binary: Path, monkeypatch,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(transfer_core.bench, "run_transfer_benchmark", _ours)
    monkeypatch.setenv("FAKE_SERVER_RC", "3")
    code, out, _ = run_cli(["bench", "transfer", "--small-pages", "0", "--fi-rma-bw",
                         str(fake_binary), "--no-messenger", "--json"], capsys)
    assert code == 0
    result = json.loads(out)
    assert result["gbps"] == 3.78 and "exited 0/3" in result["fi_rma_bw_error"]
