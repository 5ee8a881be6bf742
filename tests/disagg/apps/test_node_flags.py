"""One mapping from flags to node configs (`node_config_from_options`): every node flag reaches
the config of every node that takes it, through `serve prefill|decode|mixed`, `serve cluster`
and `demo` alike, and a word that names no layout, memory path or draft is refused by name."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import typer

from disagg.apps.cli import app, main
from disagg.apps.options import NODE_FLAGS
from disagg.node.cluster_config import ClusterConfig
from disagg.node.node_config import NodeConfig, NodeRole

Check = Callable[[NodeConfig], bool]

# Per flag: a non-default value on the command line, and how a node config shows it.
CASES: dict[str, tuple[list[str], Check]] = {
    "model": (["--model", "small"], lambda c: c.model == "small"),
    "node_id": (["--node-id", "n-7"], lambda c: c.node_id == "n-7"),
    "listen": (["--listen", "[::1]:0"], lambda c: c.listen == "[::1]:0"),
    "prefillers": (["--prefiller", "a:1", "--prefiller", "b:2"],
                   lambda c: c.prefillers == ("a:1", "b:2")),
    "kv_layout": (["--kv-layout", "HND"], lambda c: c.cache.kv_layout == "HND"),
    "page_size": (["--page-size", "8"], lambda c: c.cache.page_size == 8),
    "num_pages": (["--num-pages", "64"], lambda c: c.cache.num_pages == 64),
    "prefix_caching": (["--no-prefix-caching"], lambda c: not c.cache.prefix_caching),
    "chunk_size": (["--chunk-size", "32"],
                   lambda c: (c.scheduler.chunk_size, c.scheduler.max_num_batched_tokens)
                   == (32, 32)),
    "tp": (["--tp", "2"], lambda c: c.parallel.tp == 2),
    "replicated_kv": (["--replicated-kv"], lambda c: c.parallel.replicated_kv),
    "provider": (["--provider", "shm"], lambda c: c.provider == "shm"),
    "fabric_node": (["--fabric-node", "10.0.0.7"], lambda c: c.fabric_node == "10.0.0.7"),
    "domains_per_rank": (["--domains-per-rank", "2"], lambda c: c.domains_per_rank == 2),
    "device": (["--device", "cuda:1"], lambda c: c.device == "cuda:1"),
    "kv_memory_path": (["--kv-memory-path", "staged"], lambda c: c.kv_memory_path == "staged"),
    "threads": (["--threads", "3"], lambda c: c.threads == 3),
    "trace": (["--trace", "/tmp/t-{node_id}.json"], lambda c: c.trace == "/tmp/t-{node_id}.json"),
    "otlp_endpoint": (["--otlp-endpoint", "http://127.0.0.1:4318"],
                      lambda c: c.otlp_endpoint == "http://127.0.0.1:4318"),
    "faults": (["--faults", "seed=1,drop_imm=0.01"], lambda c: c.faults == "seed=1,drop_imm=0.01"),
    "lease": (["--lease", "5"], lambda c: c.lease_s == 5.0),
    "min_post_kib": (["--min-post-kib", "3"], lambda c: c.min_post_bytes == 3 * 1024),
    "metrics_port": (["--metrics-port", "9100"], lambda c: c.metrics_port == 9100),
    "kv_timeout": (["--kv-timeout", "5"], lambda c: c.reliability.kv_timeout_s == 5.0),
    "retry": (["--no-retry"], lambda c: not c.reliability.retry_on_prefiller_failure),
    "speculative": (["--speculative", "mtp"],
                    lambda c: c.speculative is not None and c.speculative.kind == "mtp"),
    "num_draft_tokens": (["--speculative", "early-exit", "--num-draft-tokens", "2"],
                         lambda c: c.speculative is not None
                         and c.speculative.num_draft_tokens == 2),
    "draft_layers": (["--speculative", "early-exit", "--draft-layers", "1"],
                     lambda c: c.speculative is not None and c.speculative.draft_layers == 1),
    "cuda_graph": (["--cuda-graph"], lambda c: c.cuda_graph),
    "dtype": (["--dtype", "bfloat16"],
              lambda c: (c.dtype, c.cache.dtype) == (torch.bfloat16, torch.bfloat16)),
    "kv_dtype": (["--kv-dtype", "float16"],
                 lambda c: (c.dtype, c.cache.dtype) == (torch.float32, torch.float16)),
}

# Written out here, not imported from `options.py`: the test states what each command must
# offer, so moving a flag out of a command's table fails it.
ALL = set(NODE_FLAGS)
PER_NODE = {"node_id", "listen", "tp", "metrics_port", "prefillers"}  # a cluster sets these
DECODER = {"kv_timeout", "retry", "speculative", "num_draft_tokens", "draft_layers",
           "cuda_graph"}
CLUSTER = ALL - PER_NODE
# Per command: the node flags it must offer, and the roles whose config it builds.
COMMANDS: dict[str, tuple[set[str], tuple[NodeRole, ...]]] = {
    "serve prefill": (ALL - DECODER - {"prefillers"}, (NodeRole.PREFILL,)),
    "serve decode": (ALL, (NodeRole.DECODE,)),
    "serve mixed": (ALL - DECODER - {"prefillers"} | {"cuda_graph"}, (NodeRole.MIXED,)),
    "serve cluster": (CLUSTER, (NodeRole.PREFILL, NodeRole.DECODE, NodeRole.MIXED)),
    "demo": (CLUSTER, (NodeRole.PREFILL, NodeRole.DECODE, NodeRole.MIXED)),
}
# What a cluster keeps for its decoders only (`ClusterConfig.node_config`); the reliability
# flags reach every node, where only decoders read them.
DECODING = {"speculative", "num_draft_tokens", "draft_layers", "cuda_graph"}
# The demo's --trace is its own: one trace merged from every process, not a node option.
OWN = {("demo", "trace")}


CLI: Any = typer.main.get_command(app)  # built once: typer takes 30 ms to build it


def _offered(command: str) -> set[str]:
    """The node flags `disagg COMMAND` takes, read from the built click command."""
    group = CLI
    for word in command.split():
        group = group.commands[word]
    return {p.name for p in group.params if p.param_type_name == "option"} & ALL


@pytest.fixture
def captured(monkeypatch: pytest.MonkeyPatch) -> list[NodeConfig | ClusterConfig]:
    """What each command would run (a node config, or a cluster), instead of running it."""
    import disagg.apps.demo as demo
    import disagg.apps.serve_commands as serve_commands
    import disagg.server.launch as launch

    runs: list[NodeConfig | ClusterConfig] = []
    monkeypatch.setattr(serve_commands, "_run", runs.append)
    monkeypatch.setattr(launch, "serve_cluster", lambda cluster, *_, **__: runs.append(cluster))
    monkeypatch.setattr(demo, "run_demo", lambda cluster, *_, **__: runs.append(cluster) or {
        "requests": [], "totals": {"requests": 0, "failed": 0}})
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # --device cuda:1 is checked
    return runs


def _node_configs(command: str, argv: list[str], runs: list[Any]) -> dict[NodeRole, NodeConfig]:
    """The config of every role `disagg COMMAND ARGV` builds."""
    needs_one = command == "serve decode" and "--prefiller" not in argv
    extra = ["--prefiller", "127.0.0.1:7000"] if needs_one else []
    if "--model" not in argv:
        extra += ["--model", "tiny"]
    if command == "demo":
        extra += ["--json"]
    CLI.main([*command.split(), *argv, *extra], standalone_mode=False)
    [run] = runs
    runs.clear()
    if isinstance(run, NodeConfig):
        return {run.role: run}
    prefillers = ("127.0.0.1:7000",)
    return {role: run.node_config(role, role.value, prefillers if role is NodeRole.DECODE
                                  else ()) for role in COMMANDS[command][1]}


_DEFAULTS: dict[str, dict[NodeRole, NodeConfig]] = {}  # per command, with no flag given


def test_every_flag_of_the_mapping_has_a_case() -> None:
    """A flag added to the mapping without a case here fails, so it gets one."""
    assert set(CASES) == ALL


@pytest.mark.parametrize("command", COMMANDS)
def test_each_command_offers_the_node_flags_of_its_roles(command: str) -> None:
    assert _offered(command) == COMMANDS[command][0]


@pytest.mark.parametrize(("command", "flag"), [(c, f) for c, (flags, _) in COMMANDS.items()
                                               for f in sorted(flags) if (c, f) not in OWN])
def test_a_flag_reaches_the_config_of_every_node_that_takes_it(
        captured: list[Any], command: str, flag: str) -> None:
    """Set on the command line, the flag shows in each role's config; left out, it does not
    (so the value is not the default). A cluster's draft and graph flags reach its decoders
    only."""
    argv, check = CASES[flag]
    given = _node_configs(command, argv, captured)
    if command not in _DEFAULTS:
        _DEFAULTS[command] = _node_configs(command, [], captured)
    default = _DEFAULTS[command]
    for role, config in given.items():
        takes = flag not in DECODING or role is NodeRole.DECODE or command == "serve mixed"
        assert check(config) is takes, (role, config)
        assert not check(default[role]), (role, default[role])


@pytest.mark.parametrize(("argv", "message"), [
    (["serve", "prefill", "--kv-layout", "NDH"], "unknown kv_layout 'NDH'"),
    (["serve", "cluster", "--kv-layout", "NDH"], "unknown kv_layout 'NDH'"),
    (["serve", "mixed", "--kv-memory-path", "rdma"], "unknown KV memory path 'rdma'"),
    (["serve", "cluster", "--kv-memory-path", "rdma"], "unknown KV memory path 'rdma'"),
    (["serve", "decode", "--prefiller", "a:1", "--speculative", "medusa"],
     "unknown draft 'medusa'"),
    (["demo", "--speculative", "medusa"], "unknown draft 'medusa'"),
    (["serve", "cluster", "--routing", "round-robin"], "unknown routing policy 'round-robin'"),
])
def test_an_unknown_word_is_one_line_naming_it(
        captured: list[Any], capsys: pytest.CaptureFixture[str], argv: list[str],
        message: str) -> None:
    """Exit 2, one line with the bad value and the choices; nothing started."""
    with pytest.raises(SystemExit) as exit_info:
        main([*argv, "--model", "tiny"])
    assert exit_info.value.code == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert message in line
    assert "expected one of" in line
    assert not captured
