"""The address table of a decode step's one C call (`disagg.model.layer_weights`, X8e): built
once per model and dtype, and rebuilt when a weight's storage moved."""

from __future__ import annotations

import torch

from disagg.config import PRESETS
from disagg.model.layer_weights import weights_of
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


def test_a_weight_given_new_storage_rebuilds_the_table() -> None:
    """A cast swaps `param.data`: the old address must never be handed to C again."""
    model = _model()
    table = weights_of(model, 2, torch.float32)
    proj = model.layers[1].self_attn.o_proj
    proj.weight.data = proj.weight.data.clone()
    rebuilt = weights_of(model, 2, torch.float32)
    assert rebuilt is not table
    assert rebuilt.addresses.view(2, -1)[1, 4] == proj.weight.data_ptr()
