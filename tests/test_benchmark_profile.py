"""benchmarks/profile_engine.py: a toy-sized profile, its phases and its accounting."""

from __future__ import annotations

from pathlib import Path

from tests.benchmark_modules import load_benchmark

ROOT = Path(__file__).resolve().parent.parent


def test_a_toy_profile_accounts_for_every_phase(tmp_path: Path) -> None:
    load_benchmark("engine_models")
    load_benchmark("result_output")
    profile = load_benchmark("profile_engine")
    result = profile.main(["--model", "tiny", "--prompt-len", "16", "--steps", "2",
                           "--dtype", "float32", "--layouts", "NHD", "HND", "--batches", "1", "2",
                           "--json", "--out", str(tmp_path / "p.json")])
    rows = result["rows"]
    assert [(r["layout"], r["phase"]) for r in rows] == [
        (layout, phase) for layout in ("NHD", "HND")
        for phase in ("prefill_16", "decode_batch1", "decode_batch2")]
    for row in rows:
        assert row["wall_ms"] > 0
        assert row["by_kind_ms"]["gemm"] > 0
        assert row["outside_ops_ms"] == max(0.0, row["wall_ms"] - row["ops_ms"])


def test_op_kinds_are_read_from_aten_names() -> None:
    load_benchmark("engine_models")
    load_benchmark("result_output")
    profile = load_benchmark("profile_engine")
    assert profile.kind_of("aten::addmm") == "gemm"
    assert profile.kind_of("disagg::decode_layers") == "layers_in_c"
    assert profile.kind_of("aten::_scaled_dot_product_flash_attention_for_cpu") == "attention"
    assert profile.kind_of("aten::index_select") == "kv_gather"
    assert profile.kind_of("aten::index_put_") == "kv_append"
