"""`disagg serve router --decoder-metrics`: one metrics address per decoder, in the same order,
handed to the router's `/health` (X5e); a count or address that cannot pair up is exit 2."""

from __future__ import annotations

import pytest

from disagg.apps.cli import main

DECODERS = ["--decoder", "127.0.0.1:7001", "--decoder", "127.0.0.1:7003"]


@pytest.fixture
def routed(monkeypatch: pytest.MonkeyPatch) -> list[tuple[list[str], object]]:
    """What `serve router` would hand to `launch.serve_router`, without starting anything."""
    import disagg.server.launch as launch

    calls: list[tuple[list[str], object]] = []
    monkeypatch.setattr(launch, "serve_router",
                        lambda model, decoders, http, routing, metrics=None, **_:
                        calls.append((decoders, metrics)))
    return calls


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "router", "--model", "tiny", *argv])
    return exit_info.value.code or 0, capsys.readouterr().err


def test_each_decoder_gets_its_metrics_address_in_order(
        routed: list[tuple[list[str], object]], capsys: pytest.CaptureFixture[str]) -> None:
    """The i-th --decoder-metrics is the i-th decoder's."""
    code, err = _run([*DECODERS, "--decoder-metrics", "127.0.0.1:8002",
                      "--decoder-metrics", "[::1]:8004"], capsys)
    assert (code, err) == (0, "")
    assert routed == [(["127.0.0.1:7001", "127.0.0.1:7003"], ["127.0.0.1:8002", "[::1]:8004"])]


def test_without_the_option_no_metrics_addresses(
        routed: list[tuple[list[str], object]], capsys: pytest.CaptureFixture[str]) -> None:
    """Left out, /health keeps to the router's own view of the decoders."""
    assert _run(DECODERS, capsys) == (0, "")
    assert routed == [(["127.0.0.1:7001", "127.0.0.1:7003"], None)]


@pytest.mark.parametrize("metrics", [["127.0.0.1:8002"],
                                     ["127.0.0.1:8002", "127.0.0.1:8004", "127.0.0.1:8006"]])
def test_a_count_unlike_the_decoders_is_one_line_and_exit_2(
        metrics: list[str], routed: list[tuple[list[str], object]],
        capsys: pytest.CaptureFixture[str]) -> None:
    """Pairing by position would show one decoder another's pid, so it is refused."""
    code, err = _run([*DECODERS, *(f"--decoder-metrics={m}" for m in metrics)], capsys)
    assert code == 2
    assert f"--decoder-metrics was given {len(metrics)} times for 2 --decoder" in err
    assert len(err.strip().splitlines()) == 1
    assert routed == []


def test_a_malformed_metrics_address_is_named(
        routed: list[tuple[list[str], object]], capsys: pytest.CaptureFixture[str]) -> None:
    """An address that is not host:port is refused before the API starts."""
    code, err = _run([*DECODERS, "--decoder-metrics", "127.0.0.1:8002",
                      "--decoder-metrics", "no-port"], capsys)
    assert code == 2
    assert "--decoder-metrics" in err and "'no-port'" in err
    assert routed == []
