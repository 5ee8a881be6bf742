"""The model in its serving precision: float32, bfloat16 or float16 weights and activations (S3b).

Parameters take the engine's dtype, except those of a module that sets `keep_float32`
(DeepSeek-V3's router, which checkpoints and transformers keep in float32). Buffers are not
cast: RoPE's tables stay float32 and are cast where applied, as in transformers' half-precision
loads. Norms compute in float32 and hand back the dtype. The KV cache has its own dtype: K/V are
rounded to it when written, and cast to the queries' dtype when gathered. Cast after loading:
a state dict cast to bf16 first would already have rounded the router kept here.
"""

from __future__ import annotations

import torch
from torch import nn

from disagg.model import layer_weights


def cast_model(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """`model` with its floating-point parameters in `dtype`, in place; those of modules with
    `keep_float32` set stay float32. Buffers (RoPE tables, recomputed from the config) keep
    their float32 precision and are cast where they are applied."""
    for module in model.modules():
        target = torch.float32 if getattr(module, "keep_float32", False) else dtype
        for param in module.parameters(recurse=False):
            if param.is_floating_point():
                param.data = param.data.to(target)
    layer_weights.forget(model)  # the decode step's weight addresses moved (X8e)
    return model
