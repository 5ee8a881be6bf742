"""disagg: disaggregated LLM prefill and decode, written to be read (docs/design.md, S1-S9).

The public API of one engine on one node; nodes, the transfer path and the CLI live in the
sub-packages (`disagg.node`, `disagg.kv_transfer`, `disagg.apps`), imported when needed::

    from disagg import EngineConfig, SamplingParams, build_engine, load_model

    model = load_model("tiny")
    engine = build_engine(EngineConfig(model.config), model.state_dict)
    [request] = engine.generate([[1, 2, 3]], SamplingParams(max_tokens=8))
    print(request.state, request.output_token_ids)
"""

from disagg.config import (
    CacheConfig,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    ReliabilityConfig,
    SchedulerConfig,
    SpeculativeConfig,
)
from disagg.engine.llm_engine import EngineParts, LLMEngine, build_engine
from disagg.engine.request import FailureCause, Request, RequestState, SamplingParams
from disagg.errors import DisaggError
from disagg.model.loading.registry import LoadedModel, load_model
from disagg.speculative.speculator import build_speculative_engine

__all__ = [
    "CacheConfig",
    "DisaggError",
    "EngineConfig",
    "EngineParts",
    "FailureCause",
    "LLMEngine",
    "LoadedModel",
    "ModelConfig",
    "ParallelConfig",
    "ReliabilityConfig",
    "Request",
    "RequestState",
    "SamplingParams",
    "SchedulerConfig",
    "SpeculativeConfig",
    "build_engine",
    "build_speculative_engine",
    "load_model",
]
