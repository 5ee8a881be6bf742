"""`disagg demo --deployment`: a preset gives defaults, and a flag that contradicts it is refused
(naming the flag and both values) before any process starts (S9)."""

from __future__ import annotations

from typing import Any

import pytest

from disagg.apps import demo as demo_module
from disagg.apps.cli import main
from disagg.apps.deployments import DEPLOYMENTS, apply_deployment
from disagg.errors import ConfigError
from disagg.node.cluster_config import ClusterConfig


def test_preset_replaces_defaults() -> None:
    """With nothing given explicitly, every option the preset names takes its value: the
    deployment's model too (S9a: an MLA + MoE model)."""
    options = apply_deployment({"model": "smollm2-135m", "page_size": 4}, "deepseek-r1", {})
    config = ClusterConfig.from_options(**options)
    assert (config.node.model, config.prefill_tp, config.decode_tp, config.node.cache.kv_layout,
            config.num_decoders) == ("tiny-mla-moe", 4, 1, "HND", 3)
    assert config.node.cache.page_size == 4  # options the preset does not name are kept


@pytest.mark.parametrize(("name", "architecture"), [("deepseek-r1", "deepseek_v3"),
                                                    ("qwen3-coder", "qwen3_moe")])
def test_each_deployment_serves_its_architecture(name: str, architecture: str) -> None:
    """The presets' models are the deployments' architectures; only MLA's cache is
    replicated on every rank, and by construction, not by a flag (S9a)."""
    from disagg.model.sharding import Sharding
    from disagg.model_config import ModelConfig

    model = ModelConfig.from_name(str(DEPLOYMENTS[name]["model"]))
    assert model.architecture == architecture and model.moe is not None
    assert "replicated_kv" not in DEPLOYMENTS[name] or not DEPLOYMENTS[name]["replicated_kv"]
    assert Sharding.of_model(model, 4).replicated == (model.mla is not None)


@pytest.mark.parametrize(("explicit", "message"), [
    ({"decode_tp": 2}, "--decode-tp 2 conflicts with --deployment qwen3-coder, which sets "
                       "--decode-tp 4"),
    ({"kv_layout": "NHD"}, "--kv-layout NHD conflicts with --deployment qwen3-coder, which "
                           "sets --kv-layout HND"),
    ({"num_decoders": 5}, "--decoders 5 conflicts"),
    ({"replicated_kv": True}, "--replicated-kv conflicts with --deployment qwen3-coder, which "
                              "sets --no-replicated-kv"),
    ({"model": "tiny"}, "--model tiny conflicts with --deployment qwen3-coder, which sets "
                        "--model tiny-qwen3-moe"),
])
def test_conflicting_flag_is_refused(explicit: dict[str, object], message: str) -> None:
    """An explicit value that differs from the preset's: ConfigError naming flag and values."""
    with pytest.raises(ConfigError, match=message):
        apply_deployment({"model": "tiny-qwen3-moe"}, "qwen3-coder", explicit)


def test_explicit_value_equal_to_the_preset_is_accepted() -> None:
    """Repeating the preset's value is not a conflict; unrelated options pass through."""
    explicit: dict[str, object] = {"decode_tp": 4, "kv_layout": "HND", "page_size": 8}
    options = apply_deployment({"model": "tiny-qwen3-moe", "page_size": 8}, "qwen3-coder",
                               explicit)
    assert (options["decode_tp"], options["prefill_tp"], options["page_size"]) == (4, 4, 8)


def test_unknown_deployment_lists_the_known_ones() -> None:
    with pytest.raises(ConfigError, match="unknown deployment 'gpt-5'") as error:
        apply_deployment({"model": "tiny"}, "gpt-5", {})
    assert all(name in str(error.value) for name in DEPLOYMENTS)


@pytest.fixture
def started(monkeypatch: pytest.MonkeyPatch) -> list[ClusterConfig]:
    """The clusters `disagg demo` would start; nothing is started for real."""
    clusters: list[ClusterConfig] = []

    def fake_run_demo(cluster: ClusterConfig, *args: Any, **kwargs: Any) -> dict[str, Any]:
        clusters.append(cluster)
        return {"requests": [], "totals": {"requests": 0, "failed": 0}}

    monkeypatch.setattr(demo_module, "run_demo", fake_run_demo)
    return clusters


def run_cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    return exit_info.value.code or 0, capsys.readouterr().err


def test_demo_refuses_a_conflicting_flag_before_starting(
        started: list[ClusterConfig], capsys: pytest.CaptureFixture[str]) -> None:
    """`--deployment qwen3-coder --decode-tp 2`: exit 2, one line naming --decode-tp and both
    values, and no cluster started (the old code silently ran TP 4)."""
    code, err = run_cli(["demo", "--deployment", "qwen3-coder", "--decode-tp", "2"], capsys)
    assert code == 2
    assert "--decode-tp 2 conflicts with --deployment qwen3-coder" in err
    assert "--decode-tp 4" in err
    assert len(err.strip().splitlines()) == 1
    assert started == []


def test_demo_applies_the_preset_and_accepts_equal_flags(
        started: list[ClusterConfig], capsys: pytest.CaptureFixture[str]) -> None:
    """Flags the user left alone take the preset's values; an equal explicit flag is fine."""
    code, err = run_cli(["demo", "--deployment", "qwen3-coder", "--decode-tp", "4",
                         "--page-size", "4", "--model", "tiny-qwen3-moe", "--json"], capsys)
    assert code == 0, err
    [cluster] = started
    assert (cluster.prefill_tp, cluster.decode_tp, cluster.node.cache.kv_layout,
            cluster.num_decoders, cluster.node.cache.page_size) == (4, 4, "HND", 3, 4)
