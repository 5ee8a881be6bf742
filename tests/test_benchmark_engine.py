"""benchmarks/engine.py: a toy-sized run of both model kinds in both dtypes, and its JSON."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.benchmark_modules import load_benchmark

pytest.importorskip("transformers")
pytestmark = pytest.mark.slow  # two models, two dtypes, three engines: tens of seconds

ROOT = Path(__file__).resolve().parent.parent
MODELS = ["tiny", "qwen3-moe-tiny"]  # a Llama preset saved by us, a Qwen3-MoE by transformers
DTYPES = ["float32", "bfloat16"]


@pytest.fixture(scope="module")
def result(tmp_path_factory: pytest.TempPathFactory) -> dict:
    load_benchmark("engine_models")
    out = tmp_path_factory.mktemp("engine") / "engine.json"
    load_benchmark("engine").main(["--models", *MODELS, "--dtype", *DTYPES, "--prompt-len", "16",
                          "--steps", "2", "--reps", "1", "--quiet-wait-s", "0", "--json",
                          "--out", str(out)])
    return json.loads(out.read_text())


def test_a_row_per_model_dtype_layout_and_metric(result: dict) -> None:
    """Every (model, dtype, layout, metric) has exactly one row, nothing else has one."""
    keys = [(r["model"], r["dtype"], r["layout"], r["metric"]) for r in result["rows"]]
    metrics = ["prefill_tokens_per_s", "decode_step_ms_batch1", "decode_step_ms_batch8"]
    assert sorted(keys) == sorted((m, d, layout, metric) for m in MODELS for d in DTYPES
                                  for layout in ("NHD", "HND") for metric in metrics)


def test_rows_pair_positive_numbers_and_their_ratio(result: dict) -> None:
    """Both sides measured, the ratio is transformers / ours, the speedup reads the same way
    for times and throughputs."""
    for r in result["rows"]:
        assert r["ours"] > 0, r
        assert r["transformers"] > 0, r
        assert r["ratio"] == pytest.approx(r["transformers"] / r["ours"])
        faster = r["ratio"] if r["metric"].startswith("decode") else 1 / r["ratio"]
        assert r["ours_speedup"] == pytest.approx(faster)
    assert result["transformers_kernels"] == {"attention": "sdpa", "experts": "eager"}
    assert 0 <= result["others_cpu_share_during"] <= 1
