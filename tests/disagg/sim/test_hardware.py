"""Hardware presets and the `cpu` preset file that `disagg calibrate --save` writes."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from disagg.errors import ConfigError
from disagg.sim.hardware import (
    CPU_CALIBRATION_ENV,
    PRESETS,
    hardware_from_name,
    save_cpu_calibration,
)


def test_h200_is_an_h100_with_more_and_faster_memory() -> None:
    """Same tensor cores and NVLink; 141 GB at 4.8 TB/s instead of 80 GB at 3.35 TB/s."""
    h100, h200 = PRESETS["h100"], PRESETS["h200"]
    assert (h100.fp8_flops, h100.nvlink_bandwidth) == (h200.fp8_flops, h200.nvlink_bandwidth)
    assert h200.hbm_bandwidth / h100.hbm_bandwidth == pytest.approx(4.8 / 3.35)
    assert h200.node_nic_bandwidth == 8 * 50e9


def test_cpu_preset_round_trips_through_its_file(tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """What calibrate saves is what `--gpu cpu` loads."""
    monkeypatch.setenv(CPU_CALIBRATION_ENV, str(tmp_path / "cpu.json"))
    measured = replace(PRESETS["h100"], name="cpu-1t", overlap_compute_memory=False)
    save_cpu_calibration(measured)
    assert hardware_from_name("cpu") == measured


def test_cpu_preset_needs_a_calibration(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the file the error says which command makes it."""
    monkeypatch.setenv(CPU_CALIBRATION_ENV, str(tmp_path / "missing.json"))
    with pytest.raises(ConfigError, match="disagg calibrate"):
        hardware_from_name("cpu")


def test_malformed_calibration_is_an_error(tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Garbage or unknown fields in the file raise ConfigError naming the file."""
    path = tmp_path / "cpu.json"
    monkeypatch.setenv(CPU_CALIBRATION_ENV, str(path))
    path.write_text("{not json")
    with pytest.raises(ConfigError, match="malformed"):
        hardware_from_name("cpu")
    path.write_text('{"name": "cpu", "warp_drive": 1}')
    with pytest.raises(ConfigError, match="warp_drive"):
        hardware_from_name("cpu")


def test_efficiency_must_be_a_fraction() -> None:
    """An efficiency above 1 is refused."""
    with pytest.raises(ConfigError, match="gemm_efficiency"):
        replace(PRESETS["h200"], gemm_efficiency=1.5)


def test_unknown_hardware() -> None:
    """A typo names the choices."""
    with pytest.raises(ConfigError, match="h100"):
        hardware_from_name("b200")
