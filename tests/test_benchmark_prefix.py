"""benchmarks/prefix.py: a toy-sized run of both modes end to end, and what its JSON says."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
@pytest.mark.fabric
def test_benchmark_runs_both_modes_and_the_cache_moves_less(tmp_path: Path) -> None:
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("the benchmark pins its two nodes to two cores")
    out = tmp_path / "prefix.json"
    command = [sys.executable, str(ROOT / "benchmarks" / "prefix.py"), "--model", "tiny",
               "--conversations", "2", "--turns", "3", "--system-len", "40", "--user-len", "10",
               "--max-tokens", "6", "--page-size", "4", "--num-pages", "128",
               "--chunk-size", "16", "--quiet-wait-s", "0", "--out", str(out)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=180, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "with the cache / without" in done.stdout
    result = json.loads(out.read_text())
    cache, cold = result["modes"]["cache"], result["modes"]["no cache"]
    assert len(cache["requests"]) == len(cold["requests"]) == 6
    assert all(r["cached_tokens"] == 0 for r in cold["requests"])
    # Every later turn finds its chat so far; the second chat's first turn the system prompt.
    assert all(r["cached_tokens"] > 0 for r in cache["requests"] if r["turn"] > 1
               or r["chat"] == 1)
    assert cache["kv_bytes_total"] < cold["kv_bytes_total"]
    assert [r["prompt_tokens"] for r in cache["requests"]] == [
        r["prompt_tokens"] for r in cold["requests"]]  # the same stream (same answers too)
