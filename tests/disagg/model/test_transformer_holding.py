"""`Transformer.holding`: a model built on the meta device and given the state dict's tensors,
so no weight is drawn at random first; the model computes what a copied-into one does."""

from __future__ import annotations

import pytest
import torch

from disagg.config import PRESETS, CacheConfig
from disagg.model.attention import AttentionMetadata, SequenceSlice
from disagg.model.kv_cache import PagedKVCache
from disagg.model.loading.registry import init_random_weights
from disagg.model.transformer import Transformer

CONFIG = PRESETS["tiny"]


def test_it_draws_nothing_at_random() -> None:
    state_dict = init_random_weights(CONFIG)
    before = torch.get_rng_state()
    Transformer.holding(CONFIG, state_dict)
    assert torch.equal(torch.get_rng_state(), before)


def test_whole_tensors_become_the_parameters_and_views_are_copied() -> None:
    state_dict = init_random_weights(CONFIG)
    whole = state_dict["layers.0.self_attn.q_proj.weight"]
    wider = torch.randn(CONFIG.hidden_size, 2 * CONFIG.intermediate_size)
    state_dict["layers.0.mlp.down_proj.weight"] = wider[:, :CONFIG.intermediate_size]  # a view
    model = Transformer.holding(CONFIG, state_dict)
    assert model.layers[0].self_attn.q_proj.weight.data_ptr() == whole.data_ptr()
    down = model.layers[0].mlp.down_proj.weight
    assert down.is_contiguous() and down.untyped_storage().nbytes() == down.nbytes
    assert torch.equal(down, state_dict["layers.0.mlp.down_proj.weight"])


def test_it_computes_what_a_model_copied_into_computes() -> None:
    state_dict = init_random_weights(CONFIG)
    held = Transformer.holding(CONFIG, state_dict).eval()
    copied = Transformer(CONFIG).eval()
    copied.load_weights(state_dict)
    outputs = []
    for model in (held, copied):
        cache = PagedKVCache(CONFIG, CacheConfig(page_size=4, num_pages=4))
        meta = AttentionMetadata(torch.tensor([0, 0, 0]), torch.tensor([0, 1, 2]),
                                 [SequenceSlice(0, 3, 0, torch.tensor([0]))])
        with torch.inference_mode():
            outputs.append(model(torch.tensor([5, 17, 42]), torch.arange(3), cache, meta))
    assert torch.equal(outputs[0], outputs[1])


def test_a_missing_weight_is_named() -> None:
    state_dict = init_random_weights(CONFIG)
    del state_dict["norm.weight"]
    with pytest.raises(ValueError, match="norm.weight"):
        Transformer.holding(CONFIG, state_dict)


class _WithABuffer(Transformer):
    """A model with a buffer built in its constructor that no state dict holds."""

    def __init__(self, *args: object) -> None:
        super().__init__(*args)
        self.register_buffer("scratch", torch.zeros(3), persistent=False)


def test_a_buffer_left_on_the_meta_device_is_named() -> None:
    with pytest.raises(ValueError, match="nothing loaded into.*scratch"):
        _WithABuffer.holding(CONFIG, init_random_weights(CONFIG))
