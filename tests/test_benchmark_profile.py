"""benchmarks/profile_engine.py: a toy-sized profile, its phases and its accounting."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parent.parent


def _load(name: str) -> ModuleType:
    # By path, not via sys.path: benchmarks/disagg.py would shadow the `disagg` package.
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # profile_engine.py imports engine_models by name
    spec.loader.exec_module(module)
    return module


def test_a_toy_profile_accounts_for_every_phase(tmp_path: Path) -> None:
    _load("engine_models")
    profile = _load("profile_engine")
    result = profile.main(["--model", "tiny", "--prompt-len", "16", "--steps", "2",
                           "--dtype", "float32", "--layouts", "NHD", "HND", "--batches", "1", "2",
                           "--json", "--out", str(tmp_path / "p.json")])
    rows = result["rows"]
    assert [(r["layout"], r["phase"]) for r in rows] == [
        (layout, phase) for layout in ("NHD", "HND")
        for phase in ("prefill_16", "decode_batch1", "decode_batch2")]
    for row in rows:
        assert row["wall_ms"] > 0 and row["by_kind_ms"]["gemm"] > 0
        assert row["outside_ops_ms"] == max(0.0, row["wall_ms"] - row["ops_ms"])


def test_op_kinds_are_read_from_aten_names() -> None:
    profile = _load("profile_engine")
    assert profile.kind_of("aten::addmm") == "gemm"
    assert profile.kind_of("aten::_scaled_dot_product_flash_attention_for_cpu") == "attention"
    assert profile.kind_of("aten::index_select") == "kv_gather"
    assert profile.kind_of("aten::index_put_") == "kv_append"
