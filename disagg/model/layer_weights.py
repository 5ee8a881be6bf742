"""The table of weight addresses a decode step's one C call reads (X8e), built once per model.

`decode_layers.c` takes every weight by address, DL_WEIGHTS of them per layer (a MoE layer's
experts through a table of their own). Walking the modules for those addresses cost 0.9 ms of
a SmolLM2 step and 1.1 ms of a Qwen3-MoE one, so the table is built at a model's first
decode in a dtype and kept beside it. Each step first checks that every weight it names still
has the address it was built from (about 0.13 us a tensor: 36 us for SmolLM2's 270): a cast
swaps `param.data`, and the table is rebuilt then, before C could read the freed storage.
Loading copies into the parameters in place. What the check cannot see is a parameter
replaced by a new `Parameter` object after the first decode: the table would keep the old
one (alive, so still safe to read, but not the model's weight any more); nothing in the
engine does that once it serves.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
from torch import nn

from disagg.errors import KernelError
from disagg.model.moe import MoE

# model -> (num_layers, dtype) -> its table; a model that goes away takes its tables along.
_TABLES: weakref.WeakKeyDictionary[nn.Module, dict[tuple[int, torch.dtype], LayerWeights]] = (
    weakref.WeakKeyDictionary())


@dataclass(frozen=True)
class LayerWeights:
    """`addresses`: DL_WEIGHTS int64 addresses a layer, in decode_layers.c's DL_* order (0:
    none); `expert_tables`: the MoE layers' tables they point into; `weights` and `pointers`:
    every tensor named and the address it had."""

    addresses: torch.Tensor
    expert_tables: list[torch.Tensor]
    weights: list[torch.Tensor]
    pointers: list[int]

    def current(self) -> bool:
        return [weight.data_ptr() for weight in self.weights] == self.pointers


def weights_of(model: nn.Module, num_layers: int, dtype: torch.dtype) -> LayerWeights:
    """The table of `model`'s first `num_layers` layers in `dtype` (a `Transformer`)."""
    tables = _TABLES.setdefault(model, {})
    table = tables.get((num_layers, dtype))
    if table is None or not table.current():
        table = tables[num_layers, dtype] = _build(model, num_layers, dtype)
    return table


def _build(model: nn.Module, num_layers: int, dtype: torch.dtype) -> LayerWeights:
    addresses, expert_tables, kept = [], [], []

    def address(weight: torch.Tensor | None) -> int:
        if weight is None:
            return 0
        if weight.dtype != dtype or not weight.is_contiguous() or not weight.is_cpu:
            raise KernelError(f"decode layers: a {weight.dtype} weight of shape "
                              f"{tuple(weight.shape)} in a {dtype} step")
        kept.append(weight)
        return weight.data_ptr()

    for layer in model.layers[:num_layers]:
        attn, mlp = layer.self_attn, layer.mlp
        moe = mlp if isinstance(mlp, MoE) else None
        dense = (None,) * 3 if moe is not None else (mlp.gate_proj, mlp.up_proj, mlp.down_proj)
        norms = (attn.q_norm, attn.k_norm)
        addresses += [address(weight) for weight in (
            layer.input_layernorm.weight, attn.q_proj.weight, attn.k_proj.weight,
            attn.v_proj.weight, attn.o_proj.weight, layer.post_attention_layernorm.weight,
            *(None if proj is None else proj.weight for proj in dense),
            attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias, attn.o_proj.bias,
            *(None if norm is None else norm.weight for norm in norms),
            None if moe is None else moe.gate.weight)]
        if moe is None:
            addresses.append(0)
            continue
        experts = torch.tensor([address(proj.weight) for expert in moe.experts
                                for proj in (expert.gate_proj, expert.up_proj,
                                             expert.down_proj)], dtype=torch.int64)
        expert_tables.append(experts)
        addresses.append(experts.data_ptr())
    return LayerWeights(torch.tensor(addresses, dtype=torch.int64), expert_tables, kept,
                        [weight.data_ptr() for weight in kept])
