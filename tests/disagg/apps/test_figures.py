"""`disagg figures`: the PNGs come out of real runs, and a trace reads back as a timeline.

The full command starts a prefiller and a decoder process and runs the `small` model, so it is
slow; reading a merged trace into a `Timeline` is checked on a hand-made trace.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from disagg.apps.cli import main
from disagg.apps.figures.commands import timeline_from_trace

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _meta(pid: int, name: str) -> dict[str, Any]:
    return {"name": "process_name", "ph": "M", "pid": pid, "tid": 0, "args": {"name": name}}


def _event(name: str, pid: int, ts: float, **args: Any) -> dict[str, Any]:
    return {"name": name, "ph": "i", "s": "t", "pid": pid, "tid": 1, "ts": ts, "args": args}


def _step(pid: int, ts: float, dur: float, num_tokens: int, num_seqs: int) -> dict[str, Any]:
    return {"name": "step", "ph": "X", "pid": pid, "tid": 1, "ts": ts, "dur": dur,
            "args": {"num_tokens": num_tokens, "num_seqs": num_seqs}}


def test_timeline_from_trace_reads_tokens_and_steps() -> None:
    """Router tokens become per-request times (ms from the first submit); prefiller steps
    count as prefill tokens, decoder steps as decodes."""
    trace = {"traceEvents": [
        _meta(1, "router"), _meta(2, "prefill-0"), _meta(3, "decode-0"),
        _event("submit", 1, 1000.0, request_id="req-0"),
        _event("first_token", 1, 6000.0, request_id="req-0", index=0),
        _event("token", 1, 8000.0, request_id="req-0", index=1),
        _step(2, 2000.0, 3000.0, num_tokens=40, num_seqs=1),
        _step(3, 6500.0, 1000.0, num_tokens=1, num_seqs=1),
    ]}
    timeline = timeline_from_trace(trace)
    assert [(r.name, r.submit_ms, r.token_ms) for r in timeline.requests] == [
        ("A", 0.0, [5.0, 7.0])]
    prefill, decode = timeline.lanes["prefiller"][0], timeline.lanes["decoder"][0]
    assert (prefill.start_ms, prefill.end_ms, prefill.prefill_tokens) == (1.0, 4.0, 40)
    assert (decode.prefill_tokens, decode.decodes) == (0, 1)


@pytest.mark.slow
@pytest.mark.fabric
def test_figures_command_writes_every_png(tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    """`disagg figures --out DIR` writes the five figures, each a real PNG under 200 KB."""
    with pytest.raises(SystemExit) as exit_info:
        main(["figures", "--out", str(tmp_path)])
    assert exit_info.value.code in (0, None)
    printed = capsys.readouterr().out.split()
    names = {"mixed-vs-disaggregated.png", "request-lifecycle.png", "layer-streaming.png",
             "nhd-vs-hnd.png", "tp-mismatch.png"}
    assert {Path(p).name for p in printed} == names
    for name in names:
        data = (tmp_path / name).read_bytes()
        assert data.startswith(PNG_MAGIC)
        assert len(data) < 200_000
