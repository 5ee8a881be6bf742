"""Traces: per-process files, the merged Chrome trace of a run, `--trace` on the CLI (S1, S3).

The merge is checked on hand-made files (fast), and on a real `disagg demo --model tiny
--trace` run (slow: three processes over the tcp provider), whose trace must be valid Chrome
trace JSON holding the expected kinds of event in every process.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from disagg.apps.cli import main
from disagg.utils.trace import Tracer
from disagg.utils.trace_merge import (
    LAYER_TRACK,
    check_events,
    kinds_by_process,
    layer_spans,
    merge_trace_dir,
    merge_traces,
)

T0 = 1_700_000_000.0  # a wall-clock second, as time.time() gives


def _write_prefiller(path: Path) -> None:
    """A prefiller trace: one step holding two layers' counter bumps, and a request's spans."""
    tracer = Tracer(str(path), "prefill-0")
    tracer.complete("step", T0 + 0.010, T0 + 0.040, num_tokens=8, num_seqs=1)
    tracer.instant("layer_writes_posted", at_s=T0 + 0.020, forward=0, layer=0, requests=1)
    tracer.instant("layer_writes_posted", at_s=T0 + 0.035, forward=0, layer=1, requests=1)
    tracer.complete("prefill", T0 + 0.010, T0 + 0.040, request_id="req-0")
    tracer.complete("queue", T0 + 0.005, T0 + 0.050, request_id="req-1")
    tracer.close()


def _write_router(path: Path) -> None:
    tracer = Tracer(str(path), "router")
    tracer.instant("submit", at_s=T0, track="req-0", request_id="req-0")
    tracer.complete("request", T0, T0 + 0.1, track="req-0", request_id="req-0")
    tracer.counter("kv_writes_landed", at_s=T0 + 0.05, **{"req-0": 5})
    tracer.close()


@pytest.fixture
def trace_dir(tmp_path: Path) -> Path:
    """A directory with a router file and a prefiller file."""
    _write_router(tmp_path / "router.json")
    _write_prefiller(tmp_path / "prefill-0.json")
    return tmp_path


def test_tracer_names_threads_and_tracks(tmp_path: Path) -> None:
    """Every tid used has a thread_name; named tracks are not the calling thread's tid."""
    _write_router(tmp_path / "router.json")
    events = json.loads((tmp_path / "router.json").read_text())["traceEvents"]
    named = {e["tid"] for e in events if e["name"] == "thread_name"}
    assert {e["tid"] for e in events if e["ph"] != "M"} <= named
    submit = next(e for e in events if e["name"] == "submit")
    counter = next(e for e in events if e["ph"] == "C")
    assert submit["tid"] != counter["tid"]


def test_disabled_tracer_writes_nothing(tmp_path: Path) -> None:
    """Without a path, recording and closing leave no file behind."""
    tracer = Tracer()
    tracer.instant("x")
    tracer.close()
    assert not tracer.enabled
    assert list(tmp_path.iterdir()) == []


def test_merge_starts_at_zero_and_keeps_the_origin(trace_dir: Path) -> None:
    """Times become µs from the earliest event; otherData keeps the wall-clock origin."""
    trace = merge_traces(sorted(trace_dir.glob("*.json")))
    times = [e["ts"] for e in trace["traceEvents"] if e["ph"] != "M"]
    assert min(times) == 0
    assert trace["otherData"]["t0_unix_us"] == pytest.approx(T0 * 1e6)
    assert trace["otherData"]["processes"] == ["router", "prefill-0"]


def test_layer_spans_are_cut_at_counter_bumps(trace_dir: Path) -> None:
    """Layer 0 runs from the step's start to its bump, layer 1 from bump 0 to bump 1."""
    events = json.loads((trace_dir / "prefill-0.json").read_text())["traceEvents"]
    spans = [e for e in layer_spans(events) if e["ph"] == "X"]
    assert [(s["name"], s["ts"], s["dur"]) for s in spans] == [
        ("layer 0", pytest.approx((T0 + 0.010) * 1e6), pytest.approx(10_000)),
        ("layer 1", pytest.approx((T0 + 0.020) * 1e6), pytest.approx(15_000))]
    assert {s["tid"] for s in spans} == {LAYER_TRACK}


def test_request_spans_get_a_track_each(trace_dir: Path) -> None:
    """Overlapping spans of two requests land on two different tracks of the prefiller."""
    trace = merge_traces(sorted(trace_dir.glob("*.json")))
    tids = {e["args"]["request_id"]: e["tid"] for e in trace["traceEvents"]
            if e["name"] in ("prefill", "queue")}
    assert tids["req-0"] != tids["req-1"]


def test_merge_dir_writes_valid_json_and_warns_about_missing(
        trace_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The merged file parses; a node that left no file is named in a warning."""
    out = tmp_path / "merged.out"
    merge_trace_dir(trace_dir, out, expected=["router", "prefill-0", "decode-0"])
    check_events(json.loads(out.read_text())["traceEvents"])
    assert "decode-0" in caplog.text


def test_check_events_names_a_bad_span() -> None:
    """A span without a duration is refused, with its name in the message."""
    with pytest.raises(ValueError, match="'step'"):
        check_events([{"name": "step", "ph": "X", "ts": 0, "pid": 1, "tid": 1}])


def test_generate_trace_has_a_step_per_engine_step(tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """`disagg generate --trace` writes one `step` span per step: 1 prefill + 4 decodes."""
    out = tmp_path / "generate.json"
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "--model", "tiny", "--prompt-token-ids", "1,2,3", "--max-tokens", "5",
              "--json", "--trace", str(out)])
    assert exit_info.value.code in (0, None)
    capsys.readouterr()
    events = json.loads(out.read_text())["traceEvents"]
    check_events(events)
    steps = [e for e in events if e["name"] == "step"]
    assert [s["args"]["num_tokens"] for s in steps] == [3, 1, 1, 1, 1]


@pytest.mark.slow
@pytest.mark.fabric
def test_demo_trace_has_every_kind_per_process(tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    """A real `disagg demo --model tiny --trace` run: one valid trace, one process per node,
    each with its kinds of event, all on one clock (the prefill precedes each first token)."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt_token_ids": list(range(3, 3 + n))}) + "\n"
                               for n in (13, 30, 7)))
    out = tmp_path / "demo.json"
    with pytest.raises(SystemExit) as exit_info:
        # Least-loaded: the prompts share a prefix, which prefix routing keeps on one decoder.
        main(["demo", "--model", "tiny", "--decoders", "2", "--max-tokens", "4", "--page-size",
              "4", "--chunk-size", "8", "--prompts-file", str(prompts), "--json",
              "--trace", str(out), "--routing", "least-loaded"])
    assert exit_info.value.code in (0, None)
    capsys.readouterr()
    trace = json.loads(out.read_text())
    check_events(trace["traceEvents"])
    kinds = kinds_by_process(trace)
    assert set(kinds) == {"router", "prefill-0", "decode-0", "decode-1"}
    assert {"submit", "first_token", "token", "done", "request"} <= kinds["router"]
    assert {"step", "queue", "prefill", "transfer_tail", "layer_writes_posted",
            "layer"} <= kinds["prefill-0"]
    for decoder in ("decode-0", "decode-1"):
        assert {"step", "kv_wait"} <= kinds[decoder]
    events = trace["traceEvents"]
    prefill_start = min(e["ts"] for e in events if e["name"] == "prefill")
    first_token = min(e["ts"] for e in events if e["name"] == "first_token")
    assert prefill_start < first_token
