"""benchmarks/serving.py: the stream, the numbers from synthetic observations, the engine step
times from hand-made trace events, and one toy-sized run against both `serve cluster` modes end
to end."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from argparse import Namespace
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.benchmark_modules import load_benchmark

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "benchmarks"


for _dependency in ("disagg_report", "pinned_cluster", "result_output"):
    load_benchmark(_dependency)
step_times = load_benchmark("step_times")
report = load_benchmark("serving_report")
serving = load_benchmark("serving")


def _observed(kind: str, sent: float, token_times: list[float], max_tokens: int,
              error: str | None = None) -> SimpleNamespace:
    arrival = SimpleNamespace(at_s=sent, kind=kind, prompt=[1] * 8, max_tokens=max_tokens)
    return SimpleNamespace(arrival=arrival, sent=sent, token_times=token_times,
                           chunks=len(set(token_times)), end=token_times[-1] if token_times
                           else sent + 0.1, finish_reason=None if error else "length",
                           usage_tokens=len(token_times), error=error)


def test_stream_is_seeded_and_mixes_short_and_long() -> None:
    args = serving.parse_args(["--num-requests", "200", "--rate", "2", "--seed", "3"])
    stream = serving.make_stream(args, vocab_size=512)
    assert stream == serving.make_stream(args, vocab_size=512)
    assert [a.at_s for a in stream] == sorted(a.at_s for a in stream)
    longs = [a for a in stream if a.kind == "long"]
    assert 20 < len(longs) < 60  # 20% of 200
    assert all(256 <= len(a.prompt) <= 512 for a in longs)
    assert all(8 <= len(a.prompt) <= 32 for a in stream if a.kind == "short")
    assert 60 < stream[-1].at_s < 140  # 199 gaps of mean 0.5 s
    assert all(16 <= t < 512 for a in stream for t in a.prompt)


def test_steady_stream_is_the_in_process_schedule() -> None:
    """Four short prompts with long outputs at once, then long prompts every 2.5 s."""
    stream = serving.make_stream(serving.parse_args(["--stream", "steady"]), vocab_size=512)
    shorts = [a for a in stream if a.kind == "short"]
    longs = [a for a in stream if a.kind == "long"]
    assert [(a.at_s, len(a.prompt), a.max_tokens) for a in shorts] == [(0.0, 16, 320)] * 4
    assert [a.at_s for a in longs] == [2.0 + 2.5 * i for i in range(14)]
    assert {(len(a.prompt), a.max_tokens) for a in longs} == {(512, 32)}


def test_steady_gaps_lie_between_the_first_and_last_long_first_tokens() -> None:
    """Gaps before the first long prompt's first token or after the last one's are left out."""
    observed = [_observed("short", 0.0, [0.1, 0.5, 1.0, 1.2, 3.0], 5),
                _observed("long", 0.4, [0.9, 1.1], 2), _observed("long", 0.6, [1.3, 1.4], 2)]
    gaps, window = report.steady_itl(observed)
    assert window == [0.9, 1.3]
    assert gaps == pytest.approx([200.0, 200.0])  # 1.0 -> 1.2 (short), 0.9 -> 1.1 (long)


def test_summary_counts_latencies_and_groups_gaps_by_batch() -> None:
    """TTFT from the send time, gaps between tokens (0 ms inside one chunk), failures apart."""
    observed = [_observed("short", 0.0, [0.1, 0.2, 0.3, 0.4], 4),
                _observed("long", 0.25, [1.0, 1.0, 1.5], 4),  # two tokens in one chunk
                _observed("short", 2.0, [], 4, error="APIError: boom")]
    quiet = SimpleNamespace(quiet=True, others=0.0)
    run = {"observed": observed, "quiet": quiet, "cpu_cores": {"front door": 0.1, "client": 0.1,
                                                               "others": 0.0},
           "affinity": {}, "server_exit_code": 0, "server_log_tail": ""}
    summary = report.mode_summary(run)
    assert (summary["requested"], summary["completed"], summary["failed"]) == (3, 2, 1)
    assert (summary["output_tokens"], summary["expected_tokens"]) == (7, 8)
    assert summary["finished_early"] == 1
    assert summary["multi_token_chunks"] == 1
    assert summary["ttft_ms"]["p50"] == pytest.approx(100.0)
    assert summary["ttft_long_ms"]["p99"] == pytest.approx(750.0)
    assert summary["itl_ms"]["max"] == pytest.approx(500.0)
    assert summary["itl_ms"]["p50"] == pytest.approx(100.0)
    assert summary["requests_per_s"] == pytest.approx(2 / 2.1)
    by_batch = summary["itl_by_decoding_ms"]
    assert by_batch[1]["gaps"] == 5
    assert by_batch[1]["p99"] == pytest.approx(500.0)


def test_table_prints_every_mode(capsys: pytest.CaptureFixture[str]) -> None:
    def run() -> dict:
        return {"observed": [_observed("short", 0.0, [0.1, 0.2, 0.3], 3)],
                "quiet": SimpleNamespace(quiet=True, others=0.0),
                "cpu_cores": {"decode-0": 0.5, "front door": 0.1, "client": 0.1, "others": 0.0},
                "affinity": {}, "server_exit_code": 0, "server_log_tail": ""}

    args = Namespace(model="tiny", stream="poisson", num_requests=1, rate=1.0, long_fraction=0.2,
                     long_len=[256, 512], max_tokens=3, out=None, json=False, modes=[])
    result = report.summarize(args, {"disagg": run(), "mixed": run()})
    report.print_table(json.loads(json.dumps(result)))  # as read back from the JSON file
    out = capsys.readouterr().out
    for word in ("disagg", "mixed", "goal"):
        assert word in out


def _step(dur_us: float, num_tokens: int, num_seqs: int, ts: float = 1e15) -> dict:
    """A `step` span as the nodes' Perfetto files hold it."""
    return {"name": "step", "ph": "X", "ts": ts, "dur": dur_us, "pid": 1, "tid": 1,
            "args": {"num_tokens": num_tokens, "num_seqs": num_seqs}}


def test_decode_steps_are_grouped_by_batch_with_nearest_rank_percentiles() -> None:
    events = [_step(ms * 1e3, 1, 1) for ms in range(1, 11)] + [_step(30e3, 4, 4),
                                                               _step(20e3, 4, 4)]
    by_batch = step_times.step_summary(events)["decode_step_ms_by_batch"]
    assert list(by_batch) == ["1", "4"]
    assert by_batch["1"] == {"steps": 10, "p50": pytest.approx(5.0), "p90": pytest.approx(9.0)}
    assert by_batch["4"] == {"steps": 2, "p50": pytest.approx(20.0), "p90": pytest.approx(30.0)}


def test_steps_that_carried_a_prefill_chunk_are_kept_apart() -> None:
    """More tokens than sequences: a prefill chunk rode along (a mixed node's step)."""
    summary = step_times.step_summary([_step(2e3, 2, 2), _step(50e3, 34, 3), _step(40e3, 32, 1)])
    assert summary["decode_step_ms_by_batch"] == {"2": {"steps": 1, "p50": 2.0, "p90": 2.0}}
    assert summary["mixed_step_ms"] == {"steps": 2, "p50": pytest.approx(40.0),
                                        "p90": pytest.approx(50.0)}


def test_events_other_than_step_spans_are_ignored() -> None:
    """Metadata, counters, instants named `step` and other spans count for nothing."""
    events = [{"name": "process_name", "ph": "M", "pid": 1, "tid": 0, "args": {"name": "d"}},
              {"name": "kv_wait", "ph": "X", "ts": 1e15, "dur": 9e3, "args": {}},
              {"name": "step", "ph": "i", "s": "t", "ts": 1e15, "args": {}},
              {"name": "kv_writes_landed", "ph": "C", "ts": 1e15, "args": {"r": 1}},
              _step(3e3, 1, 1)]
    summary = step_times.step_summary(events)
    assert summary["decode_step_ms_by_batch"] == {"1": {"steps": 1, "p50": 3.0, "p90": 3.0}}
    assert summary["mixed_step_ms"] == {"steps": 0, "p50": None, "p90": None}


def test_steps_before_the_stream_started_are_left_out() -> None:
    """The warm-up's steps ran before `since_us`: they are not the stream's."""
    events = [_step(90e3, 1, 1, ts=1_000.0), _step(5e3, 1, 1, ts=2_000.0)]
    by_batch = step_times.step_summary(events, since_us=1_500.0)["decode_step_ms_by_batch"]
    assert by_batch == {"1": {"steps": 1, "p50": 5.0, "p90": 5.0}}


def test_table_prints_the_step_times_per_batch(capsys: pytest.CaptureFixture[str]) -> None:
    run = {"observed": [_observed("short", 0.0, [0.1, 0.2], 2)],
           "quiet": SimpleNamespace(quiet=True, others=0.0),
           "cpu_cores": {"front door": 0.1, "client": 0.1, "others": 0.0}, "affinity": {},
           "server_exit_code": 0, "server_log_tail": "",
           "engine_steps": step_times.step_summary([_step(12.5e3, 7, 7)])}
    args = Namespace(model="tiny", stream="poisson", num_requests=1, rate=1.0, long_fraction=0.2,
                     long_len=[256, 512], max_tokens=2, out=None, json=False, modes=[])
    report.print_table(json.loads(json.dumps(report.summarize(args, {"mixed": run}))))
    out = capsys.readouterr().out
    assert "Engine step ms per batch" in out
    assert "1, 12.5 / 12.5" in out


@pytest.mark.slow
@pytest.mark.fabric
def test_benchmark_runs_both_modes_and_reports_every_key(tmp_path: Path) -> None:
    """A handful of tiny-model requests through both `serve cluster` modes over HTTP."""
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("the benchmark pins its two nodes to two cores")
    out = tmp_path / "serving.json"
    command = [sys.executable, str(BENCH / "serving.py"), "--model", "tiny",
               "--num-requests", "6", "--rate", "10", "--long-len", "48", "96",
               "--max-tokens", "6", "--page-size", "4", "--num-pages", "256",
               "--chunk-size", "32", "--warmup", "1", "--quiet-wait-s", "0", "--out", str(out)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "ITL p99 / p50" in done.stdout
    result = json.loads(out.read_text())
    assert set(result["modes"]) == {"disagg", "mixed"}
    for name, mode in result["modes"].items():
        assert (mode["requested"], mode["completed"], mode["failed"]) == (6, 6, 0), name
        if not mode["finished_early"]:
            assert mode["output_tokens"] == mode["expected_tokens"] == 6 * 6, name
        assert mode["usage_mismatches"] == 0, name
        assert mode["server_exit_code"] == 0, name
        for key in ("ttft_ms", "itl_ms", "e2e_ms", "requests_per_s", "output_tokens_per_s",
                    "itl_p99_over_p50", "itl_by_decoding_ms", "cpu_cores", "per_request"):
            assert key in mode, (name, key)
        for key in ("ttft_ms", "itl_ms", "e2e_ms"):
            assert 0 <= mode[key]["p50"] <= mode[key]["p99"], (name, key)
        assert {"front door", "client", "others"} <= set(mode["cpu_cores"])
    assert result["modes"]["disagg"]["affinity"] == {"prefill-0": [0], "decode-0": [1]}
    assert result["modes"]["mixed"]["affinity"] == {"mixed-0": [0], "mixed-1": [1]}
    for name, mode in result["modes"].items():  # the decoding nodes' own traces were read
        assert mode["step_traces_missing"] == [], name
        assert mode["decode_step_ms_by_batch"], name
    assert set(result["goal"]) >= {"disagg_itl_p99_over_p50", "target", "met"}


def test_the_json_mode_is_disagg_under_a_schema_that_can_fill_max_tokens() -> None:
    """"disagg-json" runs the disagg cluster, every request under a JSON schema whose array
    has no end of its own (so the mask, not the schema, is what differs)."""
    args = serving.parse_args(["--modes", "disagg", "disagg-json"])
    assert args.modes == ["disagg", "disagg-json"]
    assert serving.MODE_FLAGS["disagg-json"] == serving.MODE_FLAGS["disagg"]
    schema = serving.MODE_BODY["disagg-json"]["guided_json"]
    assert "maxItems" not in schema["properties"]["values"]
