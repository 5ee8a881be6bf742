"""benchmarks/engine.py: a toy-sized run of both model kinds in both dtypes, its JSON, and the
roofline's parts (the read bandwidth, the bytes a decode step reads)."""

from __future__ import annotations

import dataclasses
import json
import statistics
from types import ModuleType

import pytest
import torch

from disagg.model.loading.registry import load_model
from disagg.model.transformer import Transformer
from disagg.model_config import MoEConfig
from tests.benchmark_modules import load_benchmark

pytest.importorskip("transformers")

MODELS = ["tiny", "qwen3-moe-tiny"]  # a Llama preset saved by us, a Qwen3-MoE by transformers
DTYPES = ["float32", "bfloat16"]
PROMPT_LENS = [16, 32]
BATCHES = [1, 2]


@pytest.fixture(scope="module")
def engine_bench() -> ModuleType:
    load_benchmark("engine_models")
    load_benchmark("roofline")
    load_benchmark("result_output")
    return load_benchmark("engine")


@pytest.fixture(scope="module")
def result(engine_bench: ModuleType, tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("engine") / "engine.json"
    engine_bench.main(["--models", *MODELS, "--dtype", *DTYPES,
                       "--prompt-lens", *map(str, PROMPT_LENS), "--batches", *map(str, BATCHES),
                       "--steps", "2", "--reps", "1", "--quiet-wait-s", "0",
                       "--bandwidth-mib", "8", "--json", "--out", str(out)])
    return json.loads(out.read_text())


def by_key(result: dict) -> dict[tuple[str, str, str, str], dict]:
    return {(r["model"], r["dtype"], r["layout"], r["metric"]): r for r in result["rows"]}


@pytest.mark.slow  # two models, two dtypes, three engines: seconds
def test_a_row_per_model_dtype_layout_and_metric(result: dict) -> None:
    """Every (model, dtype, layout, metric) has exactly one row, nothing else has one: a prefill
    per prompt length, a decode step per batch, the batch-1 roofline."""
    keys = [(r["model"], r["dtype"], r["layout"], r["metric"]) for r in result["rows"]]
    metrics = ["prefill_tokens_per_s_16", "prefill_tokens_per_s_32", "decode_step_ms_batch1",
               "decode_step_ms_batch2", "roofline_fraction_batch1"]
    assert sorted(keys) == sorted((m, d, layout, metric) for m in MODELS for d in DTYPES
                                  for layout in ("NHD", "HND") for metric in metrics)
    assert (result["prompt_lens"], result["decode_prompt_len"]) == (PROMPT_LENS, 16)
    assert result["batches"] == BATCHES


@pytest.mark.slow
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
    assert result["malloc"] == "node settings"


@pytest.mark.slow
def test_the_roofline_share_is_roofline_over_the_measured_step(result: dict) -> None:
    """Each engine's share is, rep by rep, the roofline at the bandwidth sampled before that
    rep's decodes over that rep's batch-1 step, and then the median over reps; the roofline's
    ms (the caption's) is the positive bytes read at the reps' median bandwidth."""
    rows = by_key(result)
    for (model, dtype, layout, metric), r in rows.items():
        if metric != "roofline_fraction_batch1":
            continue
        samples = result["read_bandwidth"]["gbs_by_run"][f"{model} {dtype}"]
        assert len(samples) == result["reps"]
        assert r["gbs_by_rep"] == samples
        read = r["weight_bytes"] + r["kv_bytes"]
        assert r["weight_bytes"] > 0
        assert r["kv_bytes"] > 0
        assert r["roofline_ms_batch1"] == pytest.approx(
            read / (statistics.median(samples) * 1e9) * 1e3)
        step = rows[(model, dtype, layout, "decode_step_ms_batch1")]
        for side in ("ours", "transformers"):
            steps = r["steps_ms_by_rep"][side]
            assert statistics.median(steps) == pytest.approx(step[side])  # the same reps
            shares = [read / (gbs * 1e9) * 1e3 / ms for ms, gbs in zip(steps, samples)]
            assert r[side] == pytest.approx(statistics.median(shares))


def test_each_reps_step_meets_its_own_bandwidth(engine_bench: ModuleType) -> None:
    """A rep that ran while the memory was slow is set against that rep's bandwidth, not the
    median's: 100 MB read, steps of 20 and 10 ms at 10 and 40 GB/s are shares 0.5 and 0.25
    (median 0.375), where the median bandwidth (25 GB/s, 4 ms) over the median step (15 ms)
    would read 0.27."""
    roofline = {"weight_bytes": 90_000_000, "kv_bytes": 10_000_000, "gbs_by_rep": [10.0, 40.0]}
    assert engine_bench.shares_by_rep([0.020, 0.010], roofline) == pytest.approx([0.5, 0.25])
    metrics = engine_bench.with_roofline({"decode_step_ms_batch1": 15.0}, [0.020, 0.010],
                                         roofline)
    assert metrics["roofline_fraction_batch1"] == pytest.approx(0.375)


def test_read_bandwidth_is_positive(engine_bench: ModuleType) -> None:
    """A small buffer (in cache: only the sign is checked), and the reader that won."""
    gbs, reader = engine_bench.read_bandwidth_gbs(1 << 20, repeats=2)
    assert gbs > 0
    assert reader in ("torch.sum", "torch.dot")


@pytest.mark.parametrize("tied", [False, True])
def test_a_dense_step_reads_every_weight_but_the_embedding_and_the_head_once(
        engine_bench: ModuleType, tied: bool) -> None:
    """A tied head is the embedding: counted once as the head; an untied one beside it."""
    config = dataclasses.replace(load_model("tiny").config, tie_word_embeddings=tied)
    model = Transformer(config).to(torch.bfloat16)
    everything = sum(p.numel() * 2 for p in model.parameters())  # a tied matrix is listed once
    embedding = config.vocab_size * config.hidden_size * 2
    head = embedding if tied else 0  # an untied head is already among the parameters
    assert engine_bench.decode_weight_bytes(model) == everything - embedding + head


def test_an_moe_step_reads_the_experts_a_token_picks(engine_bench: ModuleType) -> None:
    """Of each MoE layer's routed experts, a token reads `num_experts_per_tok`; the router and
    the attention whole."""
    moe = MoEConfig(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32)
    config = dataclasses.replace(load_model("tiny").config, moe=moe)
    model = Transformer(config)
    rest = sum(p.numel() * 4 for n, p in model.named_parameters() if ".experts." not in n)
    picked = config.num_layers * 2 * 3 * config.hidden_size * 32 * 4  # gate, up, down
    embedding = config.vocab_size * config.hidden_size * 4
    assert engine_bench.decode_weight_bytes(model) == rest - embedding + picked


def test_bad_sizes_are_refused(engine_bench: ModuleType) -> None:
    """A batch below 1 and a repeated prompt length are argparse errors."""
    with pytest.raises(SystemExit):
        engine_bench.parse_args(["--batches", "0"])
    with pytest.raises(SystemExit):
        engine_bench.parse_args(["--prompt-lens", "16", "16"])


def test_the_old_prompt_len_option_still_works(engine_bench: ModuleType) -> None:
    """`--prompt-len` is `--prompt-lens` by another name."""
    assert engine_bench.parse_args(["--prompt-len", "16"]).prompt_lens == [16]
