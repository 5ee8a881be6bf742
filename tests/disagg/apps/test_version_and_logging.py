"""`disagg --version`, and `--log-level` for the serve commands: the level this process logs
at and, through `DISAGG_LOG_LEVEL`, every node process it starts (`node/log_level.py`)."""

from __future__ import annotations

import logging
from importlib.metadata import version
from typing import Any

import pytest
from typer.testing import CliRunner

from disagg.apps.cli import app, main
from disagg.node.log_level import LOG_LEVEL_ENV, check_log_level, node_log_level


def test_version_prints_the_installed_version() -> None:
    result = CliRunner().invoke(app, ["--version"])
    assert result.exit_code == 0
    assert result.output == f"disagg {version('disagg')}\n"


@pytest.mark.parametrize("command", [["serve", "prefill"], ["serve", "cluster"],
                                     ["serve", "router", "--decoder", "127.0.0.1:7100"]])
def test_log_level_reaches_the_nodes_environment(
        command: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """What a node process reads (`node_log_level`) is what the command line said."""
    import disagg.apps.serve_commands as serve_commands
    import disagg.server.launch as launch

    monkeypatch.setenv(LOG_LEVEL_ENV, "warning")  # so that the command's change is undone
    seen: list[int] = []
    monkeypatch.setattr(serve_commands, "_run", lambda *_: seen.append(node_log_level()))
    for name in ("serve_cluster", "serve_router"):
        monkeypatch.setattr(launch, name,
                            lambda *_, **__: seen.append(node_log_level()))  # type: ignore[misc]
    with pytest.raises(SystemExit) as exit_info:
        main([*command, "--model", "tiny", "--log-level", "debug"])
    assert exit_info.value.code == 0
    assert seen == [logging.DEBUG]


def test_an_unknown_log_level_is_one_line(capsys: pytest.CaptureFixture[str],
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    import disagg.apps.serve_commands as serve_commands

    ran: list[Any] = []
    monkeypatch.setattr(serve_commands, "_run", ran.append)
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "mixed", "--model", "tiny", "--log-level", "loud"])
    assert exit_info.value.code == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert "unknown log level 'loud': expected one of debug, info, warning, error" in line
    assert not ran


def test_a_node_logs_at_info_unless_told() -> None:
    assert check_log_level("WARNING") == logging.WARNING
    with pytest.MonkeyPatch.context() as patch:
        patch.delenv(LOG_LEVEL_ENV, raising=False)
        assert node_log_level() == logging.INFO
        patch.setenv(LOG_LEVEL_ENV, "error")
        assert node_log_level() == logging.ERROR


@pytest.mark.parametrize(("flag", "on"), [([], True), (["--no-access-log"], False)])
def test_serve_cluster_has_its_access_log_on_unless_told(
        flag: list[str], on: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    import disagg.server.launch as launch
    from disagg.server.http_server import ACCESS_LOG, enable_access_log

    monkeypatch.setattr(launch, "serve_cluster", lambda *_, **__: None)
    try:
        with pytest.raises(SystemExit):
            main(["serve", "cluster", "--model", "tiny", *flag])
        assert ACCESS_LOG.isEnabledFor(logging.INFO) is on
    finally:
        enable_access_log(False)
