"""`preflight.py`: each check that needs no model fails, as one line with exit code 2, before
any model loads or any node starts; the loaders are replaced by ones that fail the test if
they are called, so "before" is what these tests prove."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from disagg.apps.cli import main
from disagg.control.secret import SECRET_ENV
from disagg.errors import ConfigError, ModelLoadError, PreflightError
from disagg.node import preflight
from disagg.node.cluster_config import ClusterConfig
from disagg.node.node_config import NodeRole
from disagg.node.node_options import node_config_from_options


def _never(*_: object, **__: object) -> None:
    raise AssertionError("a model was loaded (or a node started) before the preflight checks")


@pytest.fixture
def busy_port() -> Iterator[int]:
    """A port another socket listens on."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        yield server.getsockname()[1]


@pytest.fixture
def no_model(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every way a command loads a model or starts a node fails the test."""
    import disagg.apps.demo as demo
    import disagg.node.local_cluster as local_cluster
    import disagg.node.serve as serve
    import disagg.server.launch as launch

    monkeypatch.setattr(serve, "build_node", _never)
    monkeypatch.setattr(demo, "load_model", _never)
    monkeypatch.setattr(local_cluster.LocalCluster, "_start_process", _never)
    monkeypatch.setattr(launch, "make_front_door", _never)


def _cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    return exit_info.value.code or 0, capsys.readouterr().err  # type: ignore[return-value]


def test_a_busy_port_is_refused_and_a_free_one_is_not(busy_port: int) -> None:
    with pytest.raises(PreflightError, match=rf"--listen 127.0.0.1:{busy_port}: cannot listen "
                                             r"there \(Address already in use\)"):
        preflight.check_port(f"127.0.0.1:{busy_port}", "--listen")
    preflight.check_port("127.0.0.1:0", "--listen")
    with pytest.raises(PreflightError, match="cannot listen there"):
        preflight.check_port("192.0.2.1:0", "--listen")  # TEST-NET: no interface has it


def test_a_provider_this_machine_lacks_is_refused() -> None:
    preflight.check_provider("tcp")
    with pytest.raises(PreflightError, match=r"--provider no-such-provider: this machine's "
                                             "libfabric does not offer it"):
        preflight.check_provider("no-such-provider")


@pytest.mark.parametrize("spec", ["tiny", "smollm2-135m", "Qwen/Qwen3-0.6B"])
def test_a_model_name_of_each_kind_passes(spec: str) -> None:
    preflight.check_model_spec(spec)


def test_a_model_that_names_nothing_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="unknown model 'no-such-model'"):
        preflight.check_model_spec("no-such-model")
    with pytest.raises(ModelLoadError, match="has no config.json"):
        preflight.check_model_spec(str(tmp_path))
    (tmp_path / "config.json").write_text("{}")
    preflight.check_model_spec(str(tmp_path))


@pytest.mark.usefixtures("no_model")
def test_run_node_checks_its_ports_before_building_the_node(busy_port: int) -> None:
    """`serve.run_node`, what every node process runs, for its control and metrics ports."""
    from disagg.node.serve import run_node

    for options in ({"listen": f"127.0.0.1:{busy_port}"}, {"metrics_port": busy_port}):
        config = node_config_from_options(NodeRole.MIXED, model="tiny", **options)
        with pytest.raises(PreflightError, match=str(busy_port)):
            run_node(config)


@pytest.mark.usefixtures("no_model")
@pytest.mark.parametrize(("argv", "message"), [
    (["serve", "prefill", "--listen", "127.0.0.1:{port}"],
     "--listen 127.0.0.1:{port}: cannot listen there"),
    (["serve", "mixed", "--metrics-port", "{port}"], "--metrics-port 127.0.0.1:{port}"),
    (["serve", "prefill", "--provider", "efa"], "--provider efa: this machine's libfabric"),
    (["serve", "decode", "--prefiller", "a:1", "--model", "no-such-model"],
     "unknown model 'no-such-model'"),
    (["serve", "cluster", "--port", "{port}"], "--host/--port 127.0.0.1:{port}"),
    (["serve", "cluster", "--provider", "efa"], "--provider efa"),
    (["serve", "cluster", "--model", "no-such-model"], "unknown model 'no-such-model'"),
    (["serve", "router", "--decoder", "a:1", "--port", "{port}"], "--host/--port"),
    (["demo", "--json", "--provider", "efa"], "--provider efa"),
    (["demo", "--json", "--model", "no-such-model"], "unknown model 'no-such-model'"),
])
def test_each_command_fails_in_one_line_before_any_model_loads(
        capsys: pytest.CaptureFixture[str], busy_port: int, argv: list[str],
        message: str) -> None:
    """Each used to fail only once the model had loaded; the busy port in a traceback."""
    argv = [word.format(port=busy_port) for word in argv]
    if "--model" not in argv:
        argv += ["--model", "tiny"]
    code, err = _cli(argv, capsys)
    assert code == 2
    [line] = err.strip().splitlines()
    assert message.format(port=busy_port) in line


@pytest.mark.usefixtures("no_model")
def test_listening_off_loopback_without_the_secret_fails_before_any_model(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(SECRET_ENV, raising=False)
    code, err = _cli(["serve", "prefill", "--model", "tiny", "--listen", "0.0.0.0:0"], capsys)
    assert code == 2
    assert f"needs the cluster secret: set {SECRET_ENV}" in err
    # A config made while the secret was set, run where it is not (a child's environment).
    monkeypatch.setenv(SECRET_ENV, "s")
    config = node_config_from_options(NodeRole.PREFILL, model="tiny", listen="0.0.0.0:0")
    monkeypatch.delenv(SECRET_ENV)
    with pytest.raises(ConfigError, match="needs the cluster secret"):
        preflight.check_node(config)


@pytest.mark.usefixtures("no_model")
def test_a_local_cluster_checks_its_provider_before_starting_a_node() -> None:
    """`LocalCluster`, for every script and test that starts one, not only the CLI."""
    from disagg.node.local_cluster import LocalCluster

    config = ClusterConfig.from_options(model="tiny", provider="no-such-provider")
    with pytest.raises(PreflightError, match="--provider no-such-provider"), \
            LocalCluster(config):
        pass
