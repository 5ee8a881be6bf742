"""`disagg models`: KV bytes per token for each attention, the numbers the simulator uses (S9)."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from disagg.apps.cli import app
from disagg.apps.models_command import models_report
from disagg.sim.models import PRESETS as SIM_PRESETS


def rows() -> dict[str, dict]:
    return {row["model"]: row for row in models_report()}


def test_mla_ships_one_latent_row_whatever_the_head_count() -> None:
    """DeepSeek-R1: 512 + 64 values per token and layer, 2 bytes each in bf16, for 128 heads."""
    r1 = rows()["deepseek-r1"]
    assert r1["kv_bytes_per_token_layer"] == {"float32": 2304, "bfloat16": 1152, "float16": 1152}
    assert r1["attention"] == "MLA 512 + 64"


def test_gqa_ships_k_and_v_of_each_kv_head() -> None:
    """Qwen3-Coder: 2 (K, V) x 8 KV heads x 128 dims; bf16 halves fp32."""
    qwen = rows()["qwen3-coder-480b"]["kv_bytes_per_token_layer"]
    assert qwen["bfloat16"] == 2 * 8 * 128 * 2 and qwen["float32"] == 2 * qwen["bfloat16"]


@pytest.mark.parametrize("name", ["deepseek-r1", "qwen3-coder-480b", "smollm2-135m"])
def test_the_simulator_uses_the_same_numbers(name: str) -> None:
    """The simulator's presets ship, per token, what the table says for their bf16 KV."""
    assert SIM_PRESETS[name].kv_bytes_per_token == rows()[name]["kv_bytes_per_token"]["bfloat16"]


def test_command_prints_json_and_a_table() -> None:
    runner = CliRunner()
    result = runner.invoke(app, ["models", "--json"])
    assert result.exit_code == 0, result.output
    assert {row["model"] for row in json.loads(result.output)} >= {"deepseek-r1", "tiny"}
    table = runner.invoke(app, ["models"])
    assert table.exit_code == 0 and "MLA 512" in table.output
