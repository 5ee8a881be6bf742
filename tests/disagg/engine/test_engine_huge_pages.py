"""The engine built for a CPU holds its model's weights in huge pages (X8f)."""

from __future__ import annotations

from disagg.config import CacheConfig, EngineConfig, SchedulerConfig
from disagg.engine.llm_engine import build_engine
from disagg.model.loading.registry import load_model
from tests.disagg.model.test_huge_pages import mapping_of, needs_thp


@needs_thp
def test_a_cpu_engines_model_is_in_huge_pages() -> None:
    loaded = load_model("tiny")
    engine = build_engine(EngineConfig(loaded.config, CacheConfig(page_size=4, num_pages=32),
                                       SchedulerConfig()), loaded.state_dict)
    weights = list(engine.model.parameters())
    assert all(mapping_of(p.data_ptr())["asked"] == 1 for p in weights)
