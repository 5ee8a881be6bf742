"""The address table of a decode step's one C call (`disagg.model.layer_weights`, X8e): built
once per model and dtype, forgotten wherever the engine gives weights new storage, and never
pointing at freed memory."""

from __future__ import annotations

import gc

import pytest
import torch

from disagg.config import PRESETS
from disagg.model import huge_pages
from disagg.model.layer_weights import LayerWeights, weights_of
from disagg.model.precision import cast_model
from disagg.model.transformer import Transformer


def _model() -> Transformer:
    torch.manual_seed(0)
    return Transformer(PRESETS["tiny"]).eval()


def test_the_table_is_built_once() -> None:
    model = _model()
    table = weights_of(model, 2, torch.float32)
    assert weights_of(model, 2, torch.float32) is table
    assert weights_of(model, 1, torch.float32) is not table  # an early-exit draft's own


def test_it_names_each_layers_weights_in_the_c_order() -> None:
    model = _model()
    addresses = weights_of(model, 2, torch.float32).addresses.view(2, -1)
    second = model.layers[1]
    assert addresses[1, 0] == second.input_layernorm.weight.data_ptr()
    assert addresses[1, 4] == second.self_attn.o_proj.weight.data_ptr()
    assert addresses[1, 8] == second.mlp.down_proj.weight.data_ptr()
    assert (addresses[:, 9:] == 0).all()  # no biases, Q/K norms or experts in a Llama


@pytest.fixture
def without_sentinels(monkeypatch: pytest.MonkeyPatch) -> None:
    """Only the forgetting under test can make the table rebuilt (the sentinels would see a
    whole-model move too)."""
    monkeypatch.setattr(LayerWeights, "current", lambda self: True)


def _o_proj_address(model: Transformer, dtype: torch.dtype) -> int:
    return int(weights_of(model, 2, dtype).addresses.view(2, -1)[1, 4])


def test_a_cast_of_the_model_rebuilds_the_table(without_sentinels: None) -> None:
    """`.to()` gives every parameter new storage: the old addresses must never reach C."""
    model = _model()
    table = weights_of(model, 2, torch.float32)
    model.to(torch.bfloat16).to(torch.float32)
    assert weights_of(model, 2, torch.float32) is not table
    assert _o_proj_address(model, torch.float32) == \
        model.layers[1].self_attn.o_proj.weight.data_ptr()


def test_cast_model_rebuilds_the_table(without_sentinels: None) -> None:
    model = _model()
    weights_of(model, 2, torch.float32)
    cast_model(cast_model(model, torch.bfloat16), torch.float32)
    assert _o_proj_address(model, torch.float32) == \
        model.layers[1].self_attn.o_proj.weight.data_ptr()


def test_the_move_into_huge_pages_rebuilds_the_table(monkeypatch: pytest.MonkeyPatch,
                                                     without_sentinels: None) -> None:
    monkeypatch.setattr(huge_pages, "huge_pages_available", lambda: True)
    model = _model()
    weights_of(model, 2, torch.float32)
    assert huge_pages.into_huge_pages(model) > 0
    assert _o_proj_address(model, torch.float32) == \
        model.layers[1].self_attn.o_proj.weight.data_ptr()


def test_a_load_that_assigns_rebuilds_the_table(without_sentinels: None) -> None:
    model = _model()
    weights_of(model, 2, torch.float32)
    state = {name: t.clone() for name, t in model.state_dict().items()
             if not name.startswith("rope.")}
    model.load_weights(state, assign=True)
    assert _o_proj_address(model, torch.float32) == \
        model.layers[1].self_attn.o_proj.weight.data_ptr()


def test_a_whole_model_moved_unseen_is_caught_by_the_sentinels() -> None:
    """A move by code that does not forget the table (each parameter's `.data` swapped)
    changes the first and last weight's addresses, which each step checks."""
    model = _model()
    table = weights_of(model, 2, torch.float32)
    for param in model.parameters():
        param.data = param.data.clone()
    assert weights_of(model, 2, torch.float32) is not table


def test_a_weight_swapped_alone_stays_readable_at_its_old_address() -> None:
    """One parameter given new storage behind the table's back: the table's address still
    points at live memory holding the weight as it was (never freed under C)."""
    model = _model()
    proj = model.layers[1].self_attn.o_proj
    before = proj.weight.detach().clone()
    address = _o_proj_address(model, torch.float32)
    proj.weight.data = torch.zeros_like(proj.weight)
    gc.collect()
    [alias] = [t for t in weights_of(model, 2, torch.float32).aliases
               if t.data_ptr() == address]
    assert torch.equal(alias, before)
