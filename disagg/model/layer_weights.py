"""The table of weight addresses a decode step's one C call reads (X8e), built once per model.

`decode_layers.c` takes every weight by address, DL_WEIGHTS of them per layer (a MoE layer's
experts through a table of their own). Walking the modules for those addresses cost 0.9 ms of
a SmolLM2 step and 1.1 ms of a Qwen3-MoE one, so the table is built at a model's first
decode in a dtype and kept beside it. Checking every weight's address at each step cost 7% of
a Qwen3-MoE step (its 456 tensors' objects are out of the cache after the layers streamed
their weights), so the table is forgotten where weights move instead: a cast or move of the
model (`Transformer._apply`, `precision.cast_model`), a load that assigns new tensors, the move
into huge pages (X8f). Each step still checks the first and last weight's address, which any
whole-model move changes. The table keeps an alias of every weight it names, so its addresses
stay readable whatever happens to the parameters: a weight given new storage by other means
after the first decode (`param.data = ...` on one parameter) is read as it was when the table
was built, never freed under C. Nothing in the engine does that once it serves.
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
    none); `expert_tables`: the MoE layers' tables they point into; `aliases`: every tensor
    named, detached from its parameter so that its storage lives as long as the table;
    `sentinels`: the first and last weight named, with the addresses they had."""

    addresses: torch.Tensor
    expert_tables: list[torch.Tensor]
    aliases: list[torch.Tensor]
    sentinels: tuple[tuple[torch.Tensor, int], ...]

    def current(self) -> bool:
        return all(weight.data_ptr() == pointer for weight, pointer in self.sentinels)


def weights_of(model: nn.Module, num_layers: int, dtype: torch.dtype) -> LayerWeights:
    """The table of `model`'s first `num_layers` layers in `dtype` (a `Transformer`)."""
    tables = _TABLES.setdefault(model, {})
    table = tables.get((num_layers, dtype))
    if table is None or not table.current():
        table = tables[num_layers, dtype] = _build(model, num_layers, dtype)
    return table


def forget(model: nn.Module) -> None:
    """Drop the tables of `model` and of every module in it: call it after giving any of their
    weights new storage, so that the next decode builds its table from the new addresses."""
    for module in model.modules():
        _TABLES.pop(module, None)


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
    ends = (kept[0], kept[-1])
    return LayerWeights(torch.tensor(addresses, dtype=torch.int64), expert_tables,
                        [weight.detach() for weight in kept],
                        tuple((weight, weight.data_ptr()) for weight in ends))
