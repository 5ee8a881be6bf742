"""The demo's live view (`demo_view.py`) at 80 columns: no line wider than the terminal, and
every request's id, state, KV writes, TTFT, tokens/s and latest text still in it."""

from __future__ import annotations

from rich.console import Console

from disagg.apps.demo import DemoRequest
from disagg.apps.demo_view import metrics_table, request_table, totals_table
from disagg.engine.request import RequestState

STATES = [RequestState.WAITING_FOR_KV, RequestState.RUNNING, RequestState.FINISHED_LENGTH,
          RequestState.FINISHED_FAILED, RequestState.FINISHED_STOPPED]
TEXT = " red, yellow and blue. These colors cannot be made by mixing other colors"


def _requests() -> list[DemoRequest]:
    requests = []
    for i, state in enumerate(STATES):
        request = DemoRequest(f"req-{i}", "The three primary colors are", [1, 2, 3], 32,
                              state=state, decoder=i % 3, text=TEXT + f" {i}")
        request.stream = object()  # type: ignore[assignment]  # a text model: show its text
        request.token_times = [0.125, 0.225, 0.325]
        request.kv_writes = 1440 if state.is_terminal() else 0
        request.kv_writes_received = 720
        requests.append(request)
    return requests


def _render(*tables: object, width: int) -> list[str]:
    console = Console(width=width, record=True, file=open("/dev/null", "w"))  # noqa: SIM115
    for table in tables:
        console.print(table)
    return console.export_text().splitlines()


def test_the_request_table_fits_80_columns_with_every_fact() -> None:
    lines = _render(request_table(_requests(), width=80), width=80)
    assert max(map(len, lines)) <= 80
    for i, state in enumerate(STATES):
        [row] = [line for line in lines if f"req-{i}" in line]
        assert state.value.removeprefix("finished_") in row
        assert ("1440" if state.is_terminal() else "720…") in row
        assert "125" in row  # TTFT ms
        assert "10.0" in row  # tokens/s
        assert f"other colors {i}" in row  # the latest text, not its start


def test_the_totals_and_node_metrics_fit_80_columns() -> None:
    result = {"totals": {"requests": 5, "failed": 1, "output_tokens": 160,
                         "tokens_per_s": 123.4, "ttft_ms_p50": 125.0, "kv_writes": 7200,
                         "kv_bytes": 123456789}, "kv_dtype": "bfloat16"}
    metrics = {"prefill-0": {"disagg:kv_sent_writes_total": 7200.0},
               "decode-10": {"disagg:kv_writes_total": 7200.0}}
    lines = _render(totals_table(result), metrics_table(metrics), width=80)
    assert max(map(len, lines)) <= 80
    assert any("123.4" in line and "117.7" in line for line in lines)
    assert any("decode-10" in line for line in lines)


def test_a_wide_terminal_keeps_the_long_headers() -> None:
    lines = _render(request_table(_requests(), width=140), width=140)
    assert any("KV writes" in line and "TTFT ms" in line for line in lines)
    assert max(map(len, lines)) <= 140
