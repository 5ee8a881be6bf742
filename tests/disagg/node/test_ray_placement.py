"""Where `serve cluster --ray` puts each node, decided without Ray: resource options, bundles,
fixed ports, and a wrong address refused at once (`disagg/node/ray_placement.py`)."""

from __future__ import annotations

import socket
import sys

import pytest

from disagg.apps.cli import main
from disagg.errors import ConfigError
from disagg.node.cluster_config import ClusterConfig
from disagg.node.node_config import NodeRole
from disagg.node.ray_placement import (
    RayConfig,
    ResourceRequest,
    check_ray_address,
    node_bundles,
    node_ports,
    plan_nodes,
    probe_address,
)


def _closed_port() -> int:
    """A port nothing listens on (bound, then closed)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.parametrize(("text", "expected"), [
    ("decode_host", ResourceRequest("decode_host", 1.0)),
    ("decode_host=2", ResourceRequest("decode_host", 2.0)),
    ("gpu_box=0.25", ResourceRequest("gpu_box", 0.25)),
])
def test_resource_option_parses_name_and_amount(text: str, expected: ResourceRequest) -> None:
    """NAME asks for 1 of it; NAME=AMOUNT for that much."""
    assert ResourceRequest.parse(text, "--ray-decode-resource") == expected


@pytest.mark.parametrize("text", ["", "=1", "host=0", "host=-1", "host=nan", "host=x",
                                  "a b", '{"host": 1}', "GPU", "CPU=2"])
def test_bad_resource_option_names_the_option_and_value(text: str) -> None:
    with pytest.raises(ConfigError, match=r"--ray-prefill-resource") as error:
        ResourceRequest.parse(text, "--ray-prefill-resource")
    assert repr(text) in str(error.value)


@pytest.mark.parametrize("address", ["local", "auto", "10.0.0.1:6379", "[::1]:6379"])
def test_ray_address_forms_accepted(address: str) -> None:
    assert check_ray_address(address) == address


@pytest.mark.parametrize("address", ["", "head", "head:port", "10.0.0.1"])
def test_malformed_ray_address_is_refused_naming_it(address: str) -> None:
    with pytest.raises(ConfigError, match="expected local, auto or the head's host:port"):
        RayConfig(address)


def test_probe_refuses_an_address_where_nothing_listens() -> None:
    """Ray itself would retry for minutes; the probe names the address at once."""
    address = f"127.0.0.1:{_closed_port()}"
    with pytest.raises(ConfigError, match=rf"--ray {address}: no Ray cluster answers there"):
        probe_address(address)


def test_ray_bad_address_is_one_line_and_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    """`serve cluster --ray 127.0.0.1:1`: one line naming the address, exit 2, Ray untouched."""
    had_ray = "ray" in sys.modules
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "cluster", "--model", "tiny", "--ray", "127.0.0.1:1"])
    err = capsys.readouterr().err.strip()
    assert exit_info.value.code == 2
    assert len(err.splitlines()) == 1
    assert "--ray 127.0.0.1:1: no Ray cluster answers there" in err
    assert had_ray or "ray" not in sys.modules


def test_role_resources_without_ray_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "cluster", "--model", "tiny", "--ray-decode-resource", "decode_host"])
    assert exit_info.value.code == 2
    assert "need --ray" in capsys.readouterr().err


def test_ports_are_fixed_per_node_index() -> None:
    """Two ports per node from the base: the same node index, the same address after a
    restart."""
    assert [node_ports(30000, i) for i in range(3)] == [(30000, 30001), (30002, 30003),
                                                        (30004, 30005)]
    with pytest.raises(ConfigError, match="past 65535"):
        node_ports(65530, 3)


def test_one_bundle_per_tp_rank_and_the_role_resource_in_the_first() -> None:
    assert node_bundles(3, 1.0, 1.0, ResourceRequest("gpu_box", 2.0)) == (
        {"CPU": 1.0, "GPU": 1.0, "gpu_box": 2.0}, {"CPU": 1.0, "GPU": 1.0},
        {"CPU": 1.0, "GPU": 1.0})
    with pytest.raises(ConfigError, match="must ask Ray for something"):
        node_bundles(1, 0.0, 0.0, None)


def test_plan_puts_prefillers_first_with_their_tp_and_resources() -> None:
    cluster = ClusterConfig.from_options(model="tiny", num_prefillers=1, num_decoders=2,
                                         prefill_tp=1, decode_tp=2)
    ray = RayConfig("local", ResourceRequest("p"), ResourceRequest("d", 0.5), base_port=21000)
    plan = plan_nodes(cluster, ray)
    assert [(p.name, p.role, p.port, p.metrics_port) for p in plan] == [
        ("prefill-0", NodeRole.PREFILL, 21000, 21001),
        ("decode-0", NodeRole.DECODE, 21002, 21003),
        ("decode-1", NodeRole.DECODE, 21004, 21005)]
    assert plan[0].bundles == ({"CPU": 1.0, "p": 1.0},)
    assert plan[2].bundles == ({"CPU": 1.0, "d": 0.5}, {"CPU": 1.0})


def test_plan_asks_a_gpu_per_rank_on_cuda_and_refuses_a_fixed_gpu() -> None:
    """--device cuda: each rank's bundle holds a GPU; cuda:N is refused (Ray picks GPUs)."""
    cuda = ClusterConfig.from_options(model="tiny", device="cuda", decode_tp=2)
    plan = plan_nodes(cuda, RayConfig("local"))
    assert plan[1].bundles == ({"CPU": 1.0, "GPU": 1.0}, {"CPU": 1.0, "GPU": 1.0})
    with pytest.raises(ConfigError, match="--device cuda:1 with --ray"):
        plan_nodes(ClusterConfig.from_options(model="tiny", device="cuda:1"), RayConfig("local"))


def test_mixed_nodes_take_the_decode_resource() -> None:
    plan = plan_nodes(ClusterConfig.from_options(model="tiny", num_mixed=2),
                      RayConfig("local", decode_resource=ResourceRequest("d")))
    assert [(p.name, p.role, p.bundles) for p in plan] == [
        ("mixed-0", NodeRole.MIXED, ({"CPU": 1.0, "d": 1.0},)),
        ("mixed-1", NodeRole.MIXED, ({"CPU": 1.0, "d": 1.0},))]


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"max_restarts": -2}, "--ray-max-restarts"),
    ({"base_port": 80}, "--ray-base-port"),
    ({"cpus_per_rank": -1.0}, "--ray-cpus-per-rank"),
])
def test_bad_ray_options_name_themselves(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        RayConfig("local", **kwargs)  # type: ignore[arg-type]
