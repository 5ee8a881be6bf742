"""The load-under-failure benchmark at a small size: kills, aborts, and no leak (issue 8)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent


@pytest.mark.slow
@pytest.mark.fabric
def test_load_with_kills_and_aborts_keeps_every_promise() -> None:
    """150 requests, 10% aborted, a prefiller and a decoder SIGKILLed: all promises hold."""
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "load.py"), "--requests",
                          "150", "--rate", "60", "--json"], capture_output=True, text=True,
                         timeout=600, cwd=ROOT)
    result = json.loads(out.stdout)
    assert result["all_terminal"] and result["terminal"] == 150
    assert result["wrong_outputs"] == 0 and result["duplicate_terminal_states"] == 0
    assert result["late"] == 0
    assert result["survivors_clean"], result["exit_codes"]
    assert result["exit_codes"]["decode-0"] == result["exit_codes"]["prefill-0"] == -9
