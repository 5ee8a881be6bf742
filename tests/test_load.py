"""The load-under-failure benchmark at a small size: kills, aborts, frozen nodes, a hostile
process, and no leak (X4, S5)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent


@pytest.mark.slow
@pytest.mark.fabric
def test_load_with_kills_freezes_and_an_attacker_keeps_every_promise() -> None:
    """150 requests over 30 s, 10% aborted; a prefiller and a decoder SIGKILLed, the other
    prefiller frozen 11 s (past the decoders' 10 s peer timeout), decode-0 frozen 6 s (past
    the router's 5 s silence window), a hostile process at decode-1 throughout: every
    promise holds, and each fault visibly happened (~40 s)."""
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "load.py"), "--requests",
                          "150", "--rate", "5", "--freeze-prefiller-s", "11",
                          "--freeze-decoder-s", "6", "--json"], capture_output=True, text=True,
                         timeout=300, cwd=ROOT)
    assert out.stdout, out.stderr[-3000:]
    result = json.loads(out.stdout)
    assert result["all_terminal"] and result["terminal"] == 150
    assert result["wrong_outputs"] == 0 and result["duplicate_terminal_states"] == 0
    assert result["late"] == 0
    assert result["survivors_clean"], (result["exit_codes"], result["tracebacks"])
    assert result["killed"] == ["decode-2", "prefill-0"]
    assert all(result["exit_codes"][name] == -9 for name in result["killed"])
    # The last prefiller really froze: requests meanwhile were refused or failed.
    freeze = result["prefiller_freeze"]
    assert sum(n for outcome, n in freeze["while_frozen"].items()
               if outcome == "refused" or outcome.startswith("finished_failed")) > 0, freeze
    # Once thawed, both surviving decoders took it back, it prefilled again, and nothing
    # submitted after that was refused or failed for want of a prefiller.
    assert set(freeze["taken_back_after_s"]) == {"decode-0", "decode-1"}, freeze
    assert freeze["prefilled_by_it_after_thaw"] > 0 and freeze["served_after_thaw"] > 0
    assert freeze["refused_or_no_prefiller_after_back"][1] == 0, freeze
    # decode-0 (the router's first choice at this load) got nothing once its silence showed,
    # and work again after the thaw.
    frozen = result["decoder_freeze"]
    assert frozen["routed_while_frozen_after_silence"] == 0, frozen
    assert frozen["routed_after_thaw"] > 0, frozen
    # The attacker really attacked, and no forged Hello got anywhere.
    hostile = result["hostile"]
    assert hostile["guessed_key_writes"] > 0 and hostile["guessed_imms"] > 0, hostile
    assert hostile["forged_hellos_accepted"] == 0, hostile
    if hostile["view"] == "tapped Hello":  # else no descriptors to forge a Hello with
        assert hostile["forged_hellos_refused"] > 0, hostile
    assert result["ok"], result
