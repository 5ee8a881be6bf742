"""The model in its serving precision: float32, bfloat16 or float16 weights and activations.

Every parameter and buffer takes the engine's dtype, except those of a module that sets
`keep_float32` (DeepSeek-V3's router, whose checkpoints and transformers keep it in float32).
Activations follow the weights: the embeddings come out in the dtype, norms compute in float32
and hand back the dtype, RoPE tables are kept in float32 and cast where applied, as
transformers does. The KV cache has its own dtype (`CacheConfig.dtype`); attention casts what
it gathers to the queries' dtype.
"""

from __future__ import annotations

import torch
from torch import nn


def cast_model(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """`model` with its floating-point parameters in `dtype`, in place; those of modules with
    `keep_float32` set stay float32. Buffers (RoPE tables, recomputed from the config) keep
    their float32 precision and are cast where they are applied."""
    for module in model.modules():
        target = torch.float32 if getattr(module, "keep_float32", False) else dtype
        for param in module.parameters(recurse=False):
            if param.is_floating_point():
                param.data = param.data.to(target)
    return model
