"""`disagg simulate`, `plan-cluster` and `calibrate` through the CLI's main()."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from disagg.apps.cli import main
from disagg.sim.hardware import CPU_CALIBRATION_ENV, Hardware, save_cpu_calibration
from tests.disagg.sim.conftest import BenchmarkRun

FAST = ["--duration", "20", "--qps", "2", "--output-len", "128", "--prompt-len", "2048"]


def run_cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    out, err = capsys.readouterr()
    return exit_info.value.code or 0, out, err


@pytest.mark.parametrize("mode", ["mixed", "disagg"])
def test_simulate_json_is_one_object(mode: str, capsys: pytest.CaptureFixture[str]) -> None:
    """--json prints one line with the metrics the issue asks for."""
    code, out, _ = run_cli(["simulate", "--mode", mode, "--json", *FAST], capsys)
    result = json.loads(out)
    assert code == 0
    assert out.count("\n") == 1
    for key in ("tps_per_request_p50", "ttft_ms_p50", "ttft_ms_p99", "itl_ms_p99", "qps"):
        assert isinstance(result[key], float)


@pytest.mark.parametrize(("argv", "message"), [
    (["simulate", "--model", "gpt-5"], "unknown simulator model 'gpt-5'"),
    (["simulate", "--mode", "hybrid"], "unknown mode 'hybrid'"),
    (["simulate", "--decoder-layout", "pp"], "unknown decoder layout"),
    (["simulate", "--qps", "0"], "qps must be positive"),
    (["plan-cluster", "--gpu", "tpu"], "unknown hardware 'tpu'"),
])
def test_bad_input_exits_2(argv: list[str], message: str,
                           capsys: pytest.CaptureFixture[str]) -> None:
    """User errors print one line naming the problem and exit 2."""
    code, _, err = run_cli(argv, capsys)
    assert code == 2
    assert message in err.replace("\n", " ")
    assert "Traceback" not in err


def test_cpu_without_calibration_exits_2(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    """--gpu cpu before `disagg calibrate` says what to run."""
    monkeypatch.setenv(CPU_CALIBRATION_ENV, str(tmp_path / "none.json"))
    code, _, err = run_cli(["simulate", "--gpu", "cpu", "--model", "smollm2-135m"], capsys)
    assert code == 2
    assert "disagg calibrate" in err


def test_plan_cluster_json(capsys: pytest.CaptureFixture[str]) -> None:
    """plan-cluster --json names the best deployment and its reasoning."""
    code, out, _ = run_cli(["plan-cluster", "--json", "--model", "qwen3-coder-480b"], capsys)
    result = json.loads(out)
    assert code == 0
    assert "P:" in result["best"]
    assert result["options"][0]["label"] == result["best"]
    assert any("binding" in line for line in result["reasoning"])


def test_calibrate_against_benchmark_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                          capsys: pytest.CaptureFixture[str], cpu_hw: Hardware,
                                          benchmark_run: BenchmarkRun) -> None:
    """With a saved preset, --against replays benchmark runs and prints each metric."""
    monkeypatch.setenv(CPU_CALIBRATION_ENV, str(tmp_path / "cpu.json"))
    save_cpu_calibration(cpu_hw)
    runs = tmp_path / "runs.json"
    runs.write_text(json.dumps([benchmark_run("mixed"), benchmark_run("disagg")]))
    code, out, _ = run_cli(["calibrate", "--use-saved", "--no-validate", "--against", str(runs),
                            "--json"], capsys)
    result = json.loads(out)
    assert code == 0
    assert {(c["mode"], c["metric"]) for c in result["benchmark"]} == {
        (mode, metric) for mode in ("mixed", "disagg") for metric in ("itl_ms_p99", "ttft_ms_p50")}


@pytest.mark.slow
def test_simulate_plot_writes_a_png(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--plot sweeps both modes and saves a PNG."""
    path = tmp_path / "sweep.png"
    code, out, _ = run_cli(["simulate", "--json", "--plot", str(path), *FAST], capsys)
    assert code == 0
    assert json.loads(out)["plot"] == str(path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
