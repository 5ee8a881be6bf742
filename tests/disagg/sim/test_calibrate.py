"""CPU calibration: measured constants predict SmolLM2-135M step times within 25% (S9)."""

from __future__ import annotations

import pytest

from disagg.sim.calibrate import StepCheck, overheads


def test_step_check_error_sign() -> None:
    """Predicting 12 ms for a 10 ms step is +20%."""
    assert StepCheck("x", 0.012, 0.010).error == pytest.approx(0.2)


def test_overheads_from_tiny_timings() -> None:
    """Synthetic timings of 1 ms + 0.5 ms per layer + 0.1 ms per sequence come apart again."""
    raw = {"decode2": 2e-3, "decode8": 5e-3, "decode2_16seqs": 3.5e-3,
           "prefill2_1seq": 2e-3, "prefill2_8seqs": 2e-3 + 7 * (0.1e-3 + 2 * 0.2e-3)}
    fixed = overheads(raw)
    assert fixed["layer"] == pytest.approx(0.5e-3)
    assert fixed["step"] == pytest.approx(1e-3)
    assert fixed["seq"] == pytest.approx(0.1e-3)
    assert fixed["seq_layer"] == pytest.approx(0.2e-3)

