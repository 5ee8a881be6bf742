"""Qwen2 and Qwen3 at TP 2, as real rank processes, give TP 1's greedy tokens (S3c, S9b).

What TP must get right for them: Q/K/V biases cut like their rows (Qwen2), the q/k norms whole
on every rank (Qwen3), and an o_proj bias added once, not once per rank, after the all-reduce
(Qwen3 with attention_bias). Checkpoints are random transformers models with every bias and
norm weight randomised (`test_architectures_vs_hf.make_hf_model`), saved to disk, because
each rank loads its own slices of the checkpoint.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.disagg.model.test_architectures_vs_hf import make_hf_model
from tests.disagg.parallel.test_ranks import tokens

pytest.importorskip("transformers")


@pytest.mark.parametrize("case", [
    "qwen3-bias",
    pytest.param("qwen2", marks=pytest.mark.slow),
    pytest.param("qwen3", marks=pytest.mark.slow),
])
def test_tp2_matches_tp1(tmp_path: Path, case: str) -> None:
    """qwen3-bias holds every mechanism (Q/K/V and o_proj biases, q/k norms); the other two
    each alone, in the slow run."""
    hf_model, _, _ = make_hf_model(case)
    hf_model.save_pretrained(tmp_path)
    spec = str(tmp_path)
    assert tokens(spec, 2, "HND") == tokens(spec, 1, "HND")
