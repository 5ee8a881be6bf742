"""The layer counter: bumped once per layer per forward, monotonic, decodable (S3b)."""

from __future__ import annotations

import pytest
import torch

from disagg.config import CacheConfig, EngineConfig, ModelConfig
from disagg.engine.llm_engine import EngineParts, LLMEngine
from disagg.model.layer_counter import LayerCounter
from disagg.model.transformer import Transformer


def test_decode_maps_values_to_forward_and_layer() -> None:
    """Value v means layer (v-1) % L of forward (v-1) // L just finished."""
    assert [LayerCounter.decode(v, 3) for v in (1, 3, 4)] == [(0, 0), (0, 2), (1, 0)]
    with pytest.raises(ValueError, match="no layer"):
        LayerCounter.decode(0, 3)


def test_model_bumps_once_per_layer_per_forward() -> None:
    """Three engine steps of a 2-layer model move the counter to 6, bump by bump."""
    torch.manual_seed(0)
    config = ModelConfig.from_name("tiny")
    seen = []

    class RecordingCounter(LayerCounter):
        def bump(self) -> None:
            super().bump()
            seen.append(self.read())

    model = Transformer(config, RecordingCounter())
    engine = LLMEngine(EngineParts.build(
        EngineConfig(config, CacheConfig(page_size=4, num_pages=16)), model))
    engine.add_request([1, 2, 3])
    for _ in range(3):
        engine.step()
    assert seen == [1, 2, 3, 4, 5, 6]


def test_counter_rejects_wrong_tensor() -> None:
    """A counter must be one int64 word, so a poller can read it atomically."""
    with pytest.raises(ValueError, match="int64"):
        LayerCounter(torch.zeros(1, dtype=torch.int32))


def test_cpu_counter_is_polled_through_its_own_tensor() -> None:
    """On CPU the poller watches the very tensor the model bumps."""
    counter = LayerCounter.for_device("cpu")
    counter.bump()
    assert counter.poll_target is counter.value
    assert counter.read() == 1


@pytest.mark.gpu_only
def test_cuda_counter_lives_in_mapped_host_memory() -> None:
    """On CUDA the model bumps a device alias and the host reads the same word."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU: mapped host counters need one")
    counter = LayerCounter.for_device("cuda")
    counter.bump()
    torch.cuda.synchronize()
    assert counter.value.device.type == "cuda"
    assert counter.poll_target.value == 1


def test_a_cpu_counter_rings_its_doorbell_on_every_bump() -> None:
    """So the messenger's poller can sleep until a layer is done (S3b)."""
    counter = LayerCounter.for_device("cpu")
    assert counter.doorbell is not None
    counter.bump()
    counter.bump()
    assert counter.doorbell.word[0] == 2 and counter.read() == 2
