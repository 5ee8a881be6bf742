"""benchmarks/disagg.py: its numbers from synthetic traces, and one toy-sized run end to end."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from disagg.engine.request import RequestState
from tests.benchmark_modules import load_benchmark

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "disagg.py"


report = load_benchmark("disagg_report")


def _span(name: str, ts_ms: float, dur_ms: float, **args: object) -> dict:
    return {"name": name, "ph": "X", "ts": ts_ms * 1e3, "dur": dur_ms * 1e3, "args": args}


def _observed(request_id: str, kind: str, submitted: float, token_times: list[float]
              ) -> SimpleNamespace:
    arrival = SimpleNamespace(request_id=request_id, kind=kind, prompt_token_ids=[1] * 8)
    return SimpleNamespace(arrival=arrival, submitted_at=submitted, node=0,
                           state=RequestState.FINISHED_LENGTH, token_times=token_times)


def test_percentile_is_nearest_rank() -> None:
    """p50 and p99 are values that occurred; no values gives None."""
    values = [float(v) for v in range(1, 101)]
    assert report.percentile(values, 50) == 50.0
    assert report.percentile(values, 99) == 99.0
    assert report.percentile([3.0], 99) == 3.0
    assert report.percentile([], 50) is None


def test_step_stats_tell_prefill_steps_apart() -> None:
    """A step with more tokens than requests holds a prefill chunk; prefiller steps are skipped."""
    traces = {"mixed-0": [_span("step", 0, 10, num_tokens=4, num_seqs=4),
                          _span("step", 10, 300, num_tokens=260, num_seqs=5)],
              "prefill-0": [_span("step", 0, 500, num_tokens=256, num_seqs=1)]}
    stats = report.step_stats(traces)
    assert (stats["num_decode_only"], stats["num_with_prefill"]) == (1, 1)
    assert stats["with_prefill_ms"]["p50"] == pytest.approx(300.0)
    assert stats["decode_only_by_num_seqs"][4]["steps"] == 1


def test_ttft_split_adds_up_to_ttft() -> None:
    """queue + prefill + transfer tail come from the prefiller's trace; rest is what remains."""
    run = {"observed": [_observed("long-0", "long", 100.0, [100.5, 100.6])],
           "traces": {"prefill-0": [_span("queue", 0, 10, request_id="long-0"),
                                    _span("prefill", 10, 400, request_id="long-0"),
                                    _span("transfer_tail", 410, 5, request_id="long-0")]},
           "start": 100.0, "end": 101.0}
    split = report.ttft_split(run, report.request_rows(run))
    assert split["ttft"]["p50"] == pytest.approx(500.0)
    assert split["prefill"]["p50"] == pytest.approx(400.0)
    assert split["rest"]["p50"] == pytest.approx(500.0 - 415.0)


def test_steady_window_spans_the_long_prompts_first_tokens() -> None:
    """Gaps outside [first long's first token, last long's first token] are left out."""
    run = {"observed": [_observed("short-0", "short", 0.0, [0.1, 0.2, 1.0, 1.1, 3.0, 3.1]),
                        _observed("long-0", "long", 0.5, [1.0, 1.05]),
                        _observed("long-1", "long", 2.0, [3.0, 3.05])],
           "start": 0.0, "end": 3.1}
    assert report.steady_window(run) == (1.0, 3.0)
    short = report.request_rows(run)[0]
    assert short["steady_itl_ms"] == pytest.approx([100.0, 1900.0])


def test_gaps_while_others_used_the_cpu_are_left_out_of_undisturbed_itl() -> None:
    """A gap overlapping a sample where other processes were busy is not 'undisturbed'."""
    run = {"observed": [_observed("short-0", "short", 0.0, [1.0, 1.1, 1.2, 1.3]),
                        _observed("long-0", "long", 0.5, [1.0, 1.05]),
                        _observed("long-1", "long", 0.6, [1.3, 1.35])],
           "others_cpu": [(1.0, 1.15, 0.01), (1.15, 1.5, 0.4)], "start": 0.0, "end": 1.4}
    short = report.request_rows(run)[0]
    assert short["steady_itl_ms"] == pytest.approx([100.0, 100.0, 100.0])
    assert short["undisturbed_itl_ms"] == pytest.approx([100.0])


def test_tables_print_every_mode(capsys: pytest.CaptureFixture[str]) -> None:
    """summarize + print_tables on a synthetic two-mode result name both modes and the goal."""
    def run(mode: str) -> dict:
        observed = [_observed("short-0", "short", 0.0, [0.2, 0.3, 0.4, 1.5, 1.6, 1.7]),
                    _observed("long-0", "long", 0.5, [1.0, 1.1]),
                    _observed("long-1", "long", 0.6, [1.6, 1.7])]
        prefill = [_span("queue", 500, 1, request_id="long-0"),
                   _span("prefill", 501, 400, request_id="long-0"),
                   _span("transfer_tail", 901, 2, request_id="long-0")]
        traces = {f"{mode}-0": [_span("step", 200, 100, num_tokens=1, num_seqs=1)]}
        if mode == "disagg":
            traces["prefill-0"] = prefill
        quiet = SimpleNamespace(quiet=True, others=0.0, ours=0.1, waited_s=2.0)
        return {"observed": observed, "traces": traces, "start": 0.0, "end": 2.0,
                "cpu": {"busy": 0.9, "ours": 0.9, "others": 0.0}, "others_cpu": [],
                "affinity": {}, "quiet": quiet}

    args = SimpleNamespace(model="tiny", num_short=1, short_max_tokens=6, num_long=2,
                           long_prompt_len=8, interval_s=0.5, json=False, modes=[])
    result = report.summarize(args, {"mixed": run("mixed"), "disagg": run("disagg")})
    report.print_tables(result)
    out = capsys.readouterr().out
    assert "mixed" in out and "disagg" in out and "goal" in out
    assert result["modes"]["disagg"]["ttft_split_ms"]["prefill"]["p50"] == pytest.approx(400.0)


@pytest.mark.slow
@pytest.mark.fabric
def test_benchmark_runs_both_modes_and_reports_every_key(tmp_path: Path) -> None:
    """A toy stream through two mixed engines and a prefiller + decoder: JSON complete, the
    mixed engines batch prefill chunks with decodes and the disaggregated decoder never does."""
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("the benchmark pins its two nodes to two cores")
    command = [sys.executable, str(SCRIPT), "--model", "tiny", "--num-short", "2",
               "--short-max-tokens", "24", "--num-long", "3", "--long-prompt-len", "64",
               "--long-max-tokens", "4", "--first-long-s", "0.2", "--interval-s", "0.3",
               "--chunk-size", "32", "--quiet-wait-s", "0", "--trace-dir", str(tmp_path),
               "--json"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout)
    assert set(result["modes"]) == {"mixed", "disagg"}
    for name, mode in result["modes"].items():
        assert (mode["requests"], mode["failed"]) == (5, 0), name
        for key in ("ttft_ms", "ttft_long_ms", "itl_ms", "steady_itl_ms", "tokens_per_s",
                    "request_tokens_per_s", "steps", "cpu_during_run", "quiet_machine"):
            assert key in mode, (name, key)
        assert mode["itl_ms"]["p50"] <= mode["itl_ms"]["p99"] <= mode["itl_ms"]["max"]
    mixed, disagg = result["modes"]["mixed"], result["modes"]["disagg"]
    assert mixed["affinity"] == {"mixed-0": [0], "mixed-1": [1]}
    assert disagg["affinity"] == {"prefill-0": [0], "decode-0": [1]}
    assert mixed["steps"]["num_with_prefill"] > 0
    assert disagg["steps"]["num_with_prefill"] == 0
    assert set(disagg["ttft_split_ms"]) == {"queue", "prefill", "transfer_tail", "rest", "ttft"}
    assert mixed["ttft_split_ms"] is None
    assert set(result["goal"]) >= {"disagg_itl_p99_over_p50", "target", "met"}
    assert (tmp_path / "disagg" / "prefill-0.json").is_file()
