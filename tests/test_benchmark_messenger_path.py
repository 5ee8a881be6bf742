"""`benchmarks/messenger_path.py` runs end to end at toy size over tcp: a spawned receiver, one
rep of each path, and the flat object `transfer_compare.py` reads, with every write landed and
counted (`verified`, exit status 0)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.fabric

FLAT_KEYS = {"engine", "transport", "gbps", "us_per_page", "latency_us_p50", "latency_us_p99",
             "verified", "us_per_write_messenger", "us_per_write_prepared",
             "messenger_over_prepared", "pages", "page_bytes"}


def test_one_provider_prints_the_flat_object_and_verifies() -> None:
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "messenger_path.py"), "--provider", "tcp",
         "--json", "--reps", "1", "--requests", "2", "--pages", "4", "--layers", "2"],
        capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert FLAT_KEYS <= result.keys()
    assert result["engine"] == "ours-messenger"
    assert result["transport"] == "tcp"
    assert result["verified"] is True
    assert result["pages"] == 2 * 2 * 4 * 2  # layers x requests x pages x K/V
    assert result["page_bytes"] == 12288
    assert result["us_per_write_messenger"] > 0
    assert result["us_per_write_prepared"] > 0
    assert result["messenger_over_prepared"] == pytest.approx(
        result["us_per_write_messenger"] / result["us_per_write_prepared"])
