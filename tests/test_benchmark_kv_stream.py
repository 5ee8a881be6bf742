"""`benchmarks/kv_stream.py` runs end to end at toy size: a tiny-model prefiller and decoder over
tcp, one 64-token request, its milestones read from both nodes' traces. A tail below zero would
mean the two traces' milestones were paired wrongly; no bytes, that no KV moved."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.benchmark_modules import load_benchmark

kv_stream = load_benchmark("kv_stream")

pytestmark = [pytest.mark.fabric, pytest.mark.slow]


def test_every_request_has_a_non_negative_tail_and_bytes(tmp_path: Path) -> None:
    out = tmp_path / "kv_stream.json"
    result = kv_stream.main(["--model", "tiny", "--prompts", "64", "--reps", "1",
                             "--providers", "tcp", "--layouts", "NHD", "--json", str(out)])
    assert len(result["samples"]) == 1
    assert len(result["rows"]) == 1
    for sample in result["samples"]:
        assert sample["tail_ms"] >= 0, sample
        assert sample["transfer_tail_ms"] >= 0, sample
        assert sample["kv_bytes"] > 0, sample
        assert sample["writes"] * sample["write_nbytes"] > 0, sample
    for row in result["rows"]:
        assert row["raw_gbps"] > 0, row
    assert json.loads(out.read_text())["rows"] == result["rows"]
