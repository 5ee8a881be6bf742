"""`NodeConfig`: checked when built, sent whole to a child as JSON, built the same way by
every `serve` command."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import pytest
import torch

from disagg.apps import serve_commands
from disagg.apps.cli import main
from disagg.config import (
    CacheConfig,
    ParallelConfig,
    ReliabilityConfig,
    SchedulerConfig,
    SpeculativeConfig,
)
from disagg.errors import ConfigError
from disagg.node.node_config import NodeConfig, NodeRole

DECODER = NodeConfig(
    "tiny", CacheConfig(page_size=8, num_pages=64, kv_layout="HND", dtype=torch.bfloat16),
    SchedulerConfig(chunk_size=32, max_num_batched_tokens=32), ParallelConfig(1, True),
    role=NodeRole.DECODE, node_id="decode-7", listen="[::1]:0",
    prefillers=("127.0.0.1:7000", "[::1]:7001"), provider="shm", threads=3,
    reliability=ReliabilityConfig(kv_timeout_s=5.0, retry_on_prefiller_failure=False),
    speculative=SpeculativeConfig(kind="mtp", num_draft_tokens=2), cuda_graph=True)


def test_json_round_trip_keeps_every_field() -> None:
    """Nested configs, enums, tuples and a torch dtype come back equal."""
    assert NodeConfig.from_json(DECODER.to_json()) == DECODER


@pytest.mark.parametrize(("edit", "message"), [
    (lambda d: d.update(colour="red"), "unknown fields ['colour'] of NodeConfig"),
    (lambda d: d.update(role="router"), "'router' is not a valid NodeRole"),
    (lambda d: d["cache"].update(dtype="float7"), "unknown dtype 'float7'"),
    (lambda d: d.update(prefillers=[]), "a decode node needs at least one prefiller"),
])
def test_a_config_that_does_not_fit_names_the_problem(
        edit: Callable[[dict[str, Any]], None], message: str) -> None:
    document = json.loads(DECODER.to_json())
    edit(document)
    with pytest.raises(ConfigError, match=re.escape(message)):
        NodeConfig.from_json(json.dumps(document))


def test_a_prefiller_refuses_decoder_options() -> None:
    with pytest.raises(ConfigError, match="a prefiller never decodes"):
        NodeConfig("tiny", scheduler=SchedulerConfig(mode="prefill_only"),
                   role=NodeRole.PREFILL, cuda_graph=True)


@pytest.mark.slow  # a child process that loads torch: about 2 s
def test_child_process_refuses_a_malformed_config() -> None:
    """`python -m disagg.node.serve` reads its config from stdin and names what is wrong."""
    child = subprocess.run([sys.executable, "-m", "disagg.node.serve"], input="{not json",
                           capture_output=True, text=True, timeout=60)
    assert child.returncode != 0
    assert "node config:" in child.stderr


@pytest.fixture
def served(monkeypatch: pytest.MonkeyPatch) -> list[NodeConfig]:
    """The configs `disagg serve ...` would run, instead of running them."""
    configs: list[NodeConfig] = []
    monkeypatch.setattr(serve_commands, "_run", configs.append)
    return configs


SHARED = ["--model", "tiny", "--page-size", "8", "--num-pages", "64", "--chunk-size", "32",
          "--kv-layout", "HND", "--provider", "shm", "--listen", "[::1]:0", "--threads", "3"]


@pytest.mark.parametrize(("role", "extra"), [
    ("prefill", []), ("decode", ["--prefiller", "127.0.0.1:7000"]), ("mixed", [])])
def test_every_serve_command_folds_the_shared_options_into_one_config(
        served: list[NodeConfig], role: str, extra: list[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", role, *SHARED, *extra])
    assert exit_info.value.code in (0, None)
    [config] = served
    assert config.role is NodeRole(role)
    assert (config.cache.page_size, config.cache.num_pages, config.cache.kv_layout) == \
        (8, 64, "HND")
    assert (config.scheduler.chunk_size, config.provider, config.listen, config.threads) == \
        (32, "shm", "[::1]:0", 3)
    assert config.node_id == f"{role}-0"


def test_decode_options_reach_the_config(served: list[NodeConfig]) -> None:
    with pytest.raises(SystemExit):
        main(["serve", "decode", "--model", "tiny", "--prefiller", "a:1", "--prefiller", "b:2",
              "--kv-timeout", "5", "--no-retry", "--speculative", "mtp",
              "--num-draft-tokens", "2"])
    [config] = served
    assert config.prefillers == ("a:1", "b:2")
    assert config.reliability == replace(ReliabilityConfig(), kv_timeout_s=5.0,
                                         retry_on_prefiller_failure=False)
    assert config.speculative is not None
    assert (config.speculative.kind, config.speculative.num_draft_tokens) == ("mtp", 2)


def test_a_submit_becomes_the_sampling_it_asks_for() -> None:
    """Every sampling field of the wire message reaches the request, `ignore_eos` included;
    a value no sampler can take is a `RequestError` (answered, never a crash)."""
    from disagg.errors import RequestError
    from disagg.control.messages import Submit
    from disagg.node.decode_node import sampling_params

    params = sampling_params(Submit("r", [1, 2], 7, 0.5, 0.9, 3, 11, ignore_eos=True))
    assert (params.max_tokens, params.temperature, params.top_p, params.top_k, params.seed,
            params.ignore_eos) == (7, 0.5, 0.9, 3, 11, True)
    assert sampling_params(Submit("r", [1], 4)).seed is None
    with pytest.raises(RequestError):
        sampling_params(Submit("r", [1], 0))


@pytest.mark.parametrize("listen", ["0.0.0.0:7000", "[::]:0", "10.1.2.3:7000", "node-3:7000"])
def test_listening_off_loopback_needs_the_secret(monkeypatch: pytest.MonkeyPatch,
                                                 listen: str) -> None:
    """Off loopback (a host name counts as off) a node without DISAGG_CLUSTER_SECRET is
    refused at once, naming the address and the variable; with the secret it is built."""
    monkeypatch.delenv("DISAGG_CLUSTER_SECRET", raising=False)
    with pytest.raises(ConfigError, match=rf"{re.escape(listen)} .*DISAGG_CLUSTER_SECRET"):
        replace(DECODER, listen=listen)
    monkeypatch.setenv("DISAGG_CLUSTER_SECRET", "s3cret")
    assert replace(DECODER, listen=listen).listen == listen


@pytest.mark.parametrize("listen", ["127.0.0.1:0", "127.0.0.2:7000", "[::1]:0", "localhost:0"])
def test_loopback_needs_no_secret(monkeypatch: pytest.MonkeyPatch, listen: str) -> None:
    monkeypatch.delenv("DISAGG_CLUSTER_SECRET", raising=False)
    assert replace(DECODER, listen=listen).listen == listen


def test_serve_off_loopback_without_the_secret_is_one_line_and_exit_2(
        served: list[NodeConfig], monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """`disagg serve prefill --listen 0.0.0.0:7000` without the secret: one error line, exit 2,
    and no node started."""
    monkeypatch.delenv("DISAGG_CLUSTER_SECRET", raising=False)
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "prefill", "--model", "tiny", "--listen", "0.0.0.0:7000"])
    assert exit_info.value.code == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert "DISAGG_CLUSTER_SECRET" in line and "0.0.0.0:7000" in line
    assert not served


@pytest.mark.parametrize("change", [{"speculative": SpeculativeConfig(kind="mtp")},
                                    {"cuda_graph": True}], ids=["speculative", "cuda-graph"])
def test_one_process_decoder_options_are_refused_at_tp_2(change: dict[str, object]) -> None:
    """Drafts and decode graphs run on one process: with TP rank processes, a ConfigError
    naming the option and the TP degree."""
    base = replace(DECODER, speculative=None, cuda_graph=False)
    with pytest.raises(ConfigError, match="not with TP 2"):
        replace(base, parallel=ParallelConfig(2), **change)


def test_tp_options_reach_the_config(served: list[NodeConfig]) -> None:
    """`--tp`, `--domains-per-rank` and `--fabric-node` reach the node's config."""
    with pytest.raises(SystemExit):
        main(["serve", "prefill", "--model", "tiny", "--tp", "2", "--domains-per-rank", "2",
              "--fabric-node", "10.0.0.7"])
    [config] = served
    assert (config.parallel.tp, config.domains_per_rank, config.fabric_node) == (2, 2, "10.0.0.7")
