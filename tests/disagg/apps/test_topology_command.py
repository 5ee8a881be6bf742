"""`disagg topology`: the machine and the rank map, as tables or JSON; bad options exit 2 (S5b)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.disagg.apps.test_cli import run_cli
from tests.disagg.node.test_rank_placement import _switch
from tests.transfer_core.test_topology import FakeSysfs


@pytest.fixture
def four_gpus(tmp_path: Path) -> Path:
    """2 NUMA nodes, 4 GPUs, 2 RDMA NICs, and an Ethernet port beside them."""
    fake = FakeSysfs(tmp_path)
    fake.node(0, "0-3")
    fake.node(1, "4-7")
    _switch(fake, 0x10, numa=0, gpus=2, nics=["mlx5_0"])
    _switch(fake, 0x80, numa=1, gpus=2, nics=["mlx5_1"])
    fake.nic(["pci0000:00", "0000:00:1f.6"], numa=0, ib=None, net="eno1")
    return tmp_path


def test_json_has_the_machine_and_the_map(four_gpus: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    """--json: one object with NUMA nodes, NICs (RDMA or not), GPUs, ranks and domains."""
    code, out, _ = run_cli(["topology", "--tp", "4", "--device", "cuda", "--json",
                            "--sysfs-root", str(four_gpus)], capsys)
    report = json.loads(out)
    assert code == 0
    assert [n["cpus"] for n in report["numa_nodes"]] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert {(n["name"], n["rdma"]) for n in report["nics"]} == {
        ("mlx5_0", True), ("mlx5_1", True), ("eno1", False)}
    assert [g["numa_node"] for g in report["gpus"]] == [0, 0, 1, 1]
    assert [(r["device"], r["nics"], r["domains"]) for r in report["ranks"]] == [
        (f"cuda:{i}", [f"mlx5_{i // 2}"], [i]) for i in range(4)]
    assert [(d["rank"], d["nic"], d["cpus"]) for d in report["domains"]] == [
        (i, f"mlx5_{i // 2}", list(range(4 * (i // 2), 4 * (i // 2) + 4))) for i in range(4)]


def test_tables_name_nics_and_stand_ins(four_gpus: Path,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    """Without --json: the machine, the ranks and the domains; CPU ranks show stand-ins."""
    code, out, _ = run_cli(["topology", "--tp", "2", "--domains-per-rank", "2",
                            "--sysfs-root", str(four_gpus)], capsys)
    assert code == 0
    assert "RDMA yes" in out
    assert "RDMA no" in out
    assert "cuda:3" in out
    assert out.count("stand-in, provider's own") == 4


def test_this_machine(capsys: pytest.CaptureFixture[str]) -> None:
    """The real sysfs: every rank on a NUMA node of this machine, K domains each."""
    code, out, _ = run_cli(["topology", "--tp", "2", "--domains-per-rank", "3", "--json"],
                           capsys)
    report = json.loads(out)
    assert code == 0
    assert [r["domains"] for r in report["ranks"]] == [[0, 1, 2], [3, 4, 5]]
    allowed = os.sched_getaffinity(0)
    assert all(set(d["cpus"]) & allowed for d in report["domains"])


@pytest.mark.parametrize(("argv", "message"), [
    (["--tp", "0"], "tp must be at least 1, got 0"),
    (["--domains-per-rank", "0"], "domains_per_rank must be at least 1"),
    (["--device", "cuda:5"], "device cuda:5 (rank 0 of tp 1 on 'cuda:5') is not on this"),
    (["--device", "gpu"], "unknown device 'gpu'"),
    (["--sysfs-root", "/no/such/dir"], "--sysfs-root '/no/such/dir' is not a directory"),
])
def test_bad_options_are_one_line_and_exit_2(argv: list[str], message: str, four_gpus: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    """ConfigError becomes one line on stderr naming the bad value, exit code 2."""
    root = [] if "--sysfs-root" in argv else ["--sysfs-root", str(four_gpus)]
    code, out, err = run_cli(["topology", *root, *argv], capsys)
    assert (code, out) == (2, "")
    assert err.count("\n") == 1
    assert message in err
