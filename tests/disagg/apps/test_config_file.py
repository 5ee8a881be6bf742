"""`--config FILE` (`config_file.py`): a YAML or TOML file of a command's flags under the
command line, checked key by key, and `disagg config show`, whose YAML reads back to the same
configs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from disagg.apps.cli import main
from disagg.node.cluster_config import ClusterConfig
from disagg.node.node_config import NodeConfig

# Per command: the flags it needs besides the file's, and how to read page-size off its run.
COMMANDS: dict[str, list[str]] = {
    "serve prefill": [], "serve decode": ["--prefiller", "127.0.0.1:7000"], "serve mixed": [],
    "serve cluster": [], "serve router": ["--decoder", "127.0.0.1:7100"], "demo": ["--json"],
}


@pytest.fixture
def runs(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """What each command would run (a node config, a cluster, the router's arguments)."""
    import disagg.apps.demo as demo
    import disagg.apps.serve_commands as serve_commands
    import disagg.server.launch as launch

    ran: list[Any] = []
    monkeypatch.setattr(serve_commands, "_run", ran.append)
    monkeypatch.setattr(launch, "serve_cluster", lambda cluster, *_, **__: ran.append(cluster))
    monkeypatch.setattr(launch, "serve_router", lambda model, decoders, http, routing, *_, **__:
                        ran.append((model, decoders, http, routing)))
    monkeypatch.setattr(demo, "run_demo", lambda cluster, *_, **__: ran.append(cluster) or {
        "requests": [], "totals": {"requests": 0, "failed": 0}})
    return ran


def _cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    try:
        main(argv)
        code = 0
    except SystemExit as exit_info:
        code = exit_info.code or 0  # type: ignore[assignment]
    out, err = capsys.readouterr()
    return code, out, err


def _page_size(run: Any) -> int:  # noqa: ANN401 - whatever the command ran
    if isinstance(run, NodeConfig):
        return run.cache.page_size
    if isinstance(run, ClusterConfig):
        return run.node.cache.page_size
    return run[3].page_size  # the router's RoutingConfig


def _file(tmp_path: Path, text: str, name: str = "c.yaml") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize(("name", "text"), [("c.yaml", "model: tiny\npage-size: 8\n"),
                                            ("c.yml", "model: tiny\npage_size: 8\n"),
                                            ("c.toml", 'model = "tiny"\npage-size = 8\n')])
def test_the_file_sets_the_flags_of_every_command(
        runs: list[Any], capsys: pytest.CaptureFixture[str], tmp_path: Path, command: str,
        name: str, text: str) -> None:
    """YAML or TOML, `-` or `_` in the key: the file's page size reaches what the command runs."""
    code, _, err = _cli([*command.split(), "--config", _file(tmp_path, text, name),
                         *COMMANDS[command]], capsys)
    assert code == 0
    assert "error" not in err
    [run] = runs
    assert _page_size(run) == 8


@pytest.mark.parametrize("command", COMMANDS)
def test_a_flag_on_the_command_line_overrides_the_file(
        runs: list[Any], capsys: pytest.CaptureFixture[str], tmp_path: Path,
        command: str) -> None:
    """The file over the defaults, the command line over the file."""
    path = _file(tmp_path, "model: tiny\npage-size: 8\n")
    code, _, _ = _cli([*command.split(), "--config", path, "--page-size", "4",
                       *COMMANDS[command]], capsys)
    assert code == 0
    [run] = runs
    assert _page_size(run) == 4


def test_options_outside_the_node_table_come_from_the_file_too(
        runs: list[Any], capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """serve cluster's own flags (--decoders, --port, the limits) and a repeatable flag."""
    path = _file(tmp_path, "model: tiny\ndecoders: 3\nport: 9001\nmax-in-flight: 7\n")
    assert _cli(["serve", "cluster", "--config", path], capsys)[0] == 0
    path = _file(tmp_path, "model: tiny\nprefiller: [a:1, b:2]\n", "d.yaml")
    assert _cli(["serve", "decode", "--config", path], capsys)[0] == 0
    cluster, decoder = runs
    assert cluster.num_decoders == 3
    assert decoder.prefillers == ("a:1", "b:2")


@pytest.mark.parametrize(("text", "message"), [
    ("pagesize: 8\n", "unknown key 'pagesize' for `disagg serve cluster`; did you mean "
                      "'page-size'?"),
    ("page-size: eight\n", "page-size: expected a whole number, got 'eight'"),
    ("page-size: 8.5\n", "page-size: expected a whole number, got 8.5"),
    ("prefix-caching: 'no'\n", "prefix-caching: expected true or false, got 'no'"),
    ("lease: soon\n", "lease: expected a number, got 'soon'"),
    ("trace: 5\n", "trace: expected a string, got 5"),
    ("page-size: null\n", "page-size: expected a value, not null"),
    ("- model\n", "expected a mapping of flag names to values, got list"),
    ("a: [\n", "not valid YAML"),
])
def test_a_bad_key_or_value_is_one_line_naming_it(
        runs: list[Any], capsys: pytest.CaptureFixture[str], tmp_path: Path, text: str,
        message: str) -> None:
    """Exit 2, one line with the file, the key and what was expected; nothing runs."""
    path = _file(tmp_path, text)
    code, _, err = _cli(["serve", "cluster", "--config", path], capsys)
    assert code == 2
    [line] = err.strip().splitlines()
    assert f"--config {path}: " in line
    assert message in line
    assert not runs


def test_a_list_flag_needs_a_list_and_a_file_needs_a_known_suffix(
        runs: list[Any], capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """`decoder = "a:1"` would be read letter by letter; a .json file is not guessed at."""
    path = _file(tmp_path, 'decoder = "a:1"\n', "r.toml")
    code, _, err = _cli(["serve", "router", "--config", path], capsys)
    assert code == 2
    assert "decoder: expected a list, each a string, got 'a:1'" in err
    code, _, err = _cli(["serve", "router", "--config", _file(tmp_path, "{}", "r.json")], capsys)
    assert code == 2
    assert "expected a .yaml, .yml or .toml file" in err
    code, _, err = _cli(["demo", "--config", str(tmp_path / "missing.yaml")], capsys)
    assert (code, err.count("\n")) == (2, 1)
    assert not runs


def test_a_file_value_counts_as_given_against_a_deployment(
        runs: list[Any], capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """A preset refuses a file's contradicting value as it refuses the flag's."""
    path = _file(tmp_path, "prefill-tp: 2\n")
    code, _, err = _cli(["demo", "--deployment", "deepseek-r1", "--config", path, "--json"],
                        capsys)
    assert code == 2
    assert "prefill" in err
    assert not runs


@pytest.mark.parametrize("command", COMMANDS)
def test_config_show_reads_back_to_the_same_run(
        runs: list[Any], capsys: pytest.CaptureFixture[str], tmp_path: Path,
        command: str) -> None:
    """`config show CMD --config F FLAGS` prints a file that, passed back alone, runs what
    `CMD --config F FLAGS` runs."""
    argv = [*command.split(), "--config", _file(tmp_path, "model: tiny\npage-size: 8\n"),
            "--chunk-size" if command != "serve router" else "--routing-margin", "3",
            *COMMANDS[command]]
    code, shown, _ = _cli(["config", "show", *argv], capsys)
    assert code == 0
    assert yaml.safe_load(shown)["page-size"] == 8
    assert _cli(argv, capsys)[0] == 0
    assert _cli([*command.split(), "--config", _file(tmp_path, shown, "shown.yaml")],
                capsys)[0] == 0
    direct, read_back = runs
    assert read_back == direct


def test_config_show_never_prints_the_api_key(
        capsys: pytest.CaptureFixture[str]) -> None:
    """The key stays out of a file that may be shared or committed."""
    code, shown, _ = _cli(["config", "show", "serve", "cluster", "--api-key", "sekrit"],
                          capsys)
    assert code == 0
    assert "sekrit" not in shown
    assert "api-key" not in yaml.safe_load(shown)


def test_config_show_needs_a_command(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = _cli(["config", "show", "serve"], capsys)
    assert code == 2
    assert "name a command (cluster, decode, mixed, prefill, router)" in err
