"""Startup progress (`progress.py`): a line per node once ready, on stderr only, as plain
lines off a terminal; `LocalCluster` reports each node starting and ready, and `serve
cluster` shows them while stdout stays what scripts parse."""

from __future__ import annotations

import io
from typing import Any

import pytest
from rich.console import Console

from disagg.apps.cli import main
from disagg.apps.progress import StartupProgress
from disagg.node.cluster_config import ClusterConfig


def _console(terminal: bool) -> tuple[Console, io.StringIO]:
    out = io.StringIO()
    return Console(file=out, force_terminal=terminal, width=80), out


@pytest.mark.parametrize("terminal", [False, True])
def test_each_node_gets_a_ready_line_with_its_time(terminal: bool) -> None:
    console, out = _console(terminal)
    with StartupProgress(console, expect=["prefill-0", "decode-0"]) as progress:
        for name in ("prefill-0", "decode-0"):
            progress.on_node(name, "starting")
        progress.on_node("prefill-0", "ready")
        assert (progress._status is not None) is terminal  # decode-0 still pending
        progress.on_node("decode-0", "ready")
        assert progress._status is None  # every node is up: the status line is gone
    text = out.getvalue()
    for name in ("prefill-0", "decode-0"):
        assert f"{name} ready (" in text
        assert " s)" in text


def test_a_phase_is_timed_and_its_done_line_printed() -> None:
    console, out = _console(False)
    with StartupProgress(console) as progress, progress.phase("loading tiny", "tiny loaded"):
        pass
    [line] = out.getvalue().splitlines()
    assert line.startswith("tiny loaded (0.")


def test_a_local_cluster_reports_every_node_starting_then_ready(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Prefillers first (the decoders need their addresses), then the decoders."""
    from disagg.node import local_cluster

    class Process:
        pid, returncode = 1, 0

        def wait(self, timeout: float | None = None) -> int:
            return 0

        def poll(self) -> int:
            return 0

    events: list[tuple[str, str]] = []
    monkeypatch.setattr(local_cluster.LocalCluster, "_start_process", lambda self, config: Process())
    monkeypatch.setattr(local_cluster.LocalCluster, "_wait_ready",
                        lambda self, name, process: events.append((name, "read")) or "x:1")
    config = ClusterConfig.from_options(model="tiny", num_decoders=2)
    with local_cluster.LocalCluster(config, on_node=lambda *event: events.append(event)):
        pass
    assert events == [("prefill-0", "starting"), ("prefill-0", "read"), ("prefill-0", "ready"),
                      ("decode-0", "starting"), ("decode-1", "starting"),
                      ("decode-0", "read"), ("decode-0", "ready"),
                      ("decode-1", "read"), ("decode-1", "ready")]


def test_serve_cluster_shows_its_nodes_on_stderr_and_nothing_on_stdout(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """stdout carries only `READY http://...` (tests and docs parse it)."""
    import disagg.server.launch as launch

    def serve(cluster: ClusterConfig, *_: Any, on_node: Any = None) -> None:  # noqa: ANN401
        for name, _role in cluster.nodes():
            on_node(name, "starting")
            on_node(name, "ready")

    monkeypatch.setattr(launch, "serve_cluster", serve)
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "cluster", "--model", "tiny", "--decoders", "2", "--no-access-log"])
    assert exit_info.value.code == 0
    out, err = capsys.readouterr()
    assert out == ""
    assert "starting 1 prefill and 2 decode nodes (tiny, tcp)" in err
    for name in ("prefill-0", "decode-0", "decode-1"):
        assert f"{name} ready (" in err
