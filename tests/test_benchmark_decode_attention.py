"""benchmarks/decode_attention.py: a toy-sized run, every case's row and its accounting."""

from __future__ import annotations

import pytest

from disagg.model.cpu_kernels import AVX512
from tests.benchmark_modules import load_benchmark

pytestmark = pytest.mark.skipif(not AVX512, reason="no AVX-512 (or the kernels are not built)")


def test_a_toy_run_times_both_paths_for_every_case() -> None:
    load_benchmark("result_output")
    bench = load_benchmark("decode_attention")
    result = bench.main(["--shapes", "tiny", "--kv-lens", "20", "--batches", "1", "3",
                         "--layouts", "NHD", "HND", "--reps", "2", "--evict-mib", "1",
                         "--json"])
    rows = result["rows"]
    assert [(r["batch"], r["dtype"], r["layout"]) for r in rows] == [
        (batch, dtype, layout) for batch in (1, 3) for dtype in ("float32", "bfloat16")
        for layout in ("NHD", "HND")]
    for row in rows:
        for state in ("hot", "cold"):
            assert row[f"{state}_kernel_us"] > 0 and row[f"{state}_pytorch_us"] > 0
            assert row[f"{state}_speedup"] == pytest.approx(
                row[f"{state}_pytorch_us"] / row[f"{state}_kernel_us"])
