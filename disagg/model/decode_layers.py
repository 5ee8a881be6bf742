"""A decode step's layers in one C call, for the models whose layers it can run (X8e).

`Transformer.forward` hands a batch of decodes (one new token per sequence, at most
`KERNEL_ROWS` of them) to `run` when `takes` holds: the CPU has AVX-512, the weights and the cache
are CPU tensors in the step's dtype, and every layer is the pre-norm layer of Llama, Mistral,
SmolLM2, Qwen2, Qwen3 or Qwen3-MoE (a dense SwiGLU MLP or softmax-routed SwiGLU experts,
rotate-half RoPE over the whole head, with or without Q/K/V and o_proj biases and Qwen3's Q/K
norms; one TP rank, no layer counter to bump). `decode_layers.c` then runs the
layers' kernels in the loop's order, and the hidden state it leaves has the loop's bits (the
tests compare them). Everything else, and every reader's way into the model, is the PyTorch
loop in `transformer.py`. Set `ENABLED = False` (or `DISAGG_CPU_KERNELS=0`) to run the loop.
"""

from __future__ import annotations

import torch
from torch import nn

from disagg.errors import KernelError
from disagg.model.attention import AttentionMetadata
from disagg.model.cpu_kernels import AVX512, DTYPE_CODES, lib, named_call, traced
from disagg.model.kv_cache import KVCache, PagedKVCache
from disagg.model.layer_counter import NullLayerCounter
from disagg.model.layer_weights import weights_of
from disagg.model.linear import KERNEL_ROWS
from disagg.model.mlp import MLP
from disagg.model.moe import MoE
from disagg.model.rope import RotaryAngles
from disagg.model.self_attention import Attention
from disagg.model_config import MoEConfig

PROFILER_NAME = "disagg::decode_layers"
ENABLED = AVX512
_LAYOUTS = {"NHD": 0, "HND": 1}
_REFUSALS = {-1: "its dtype, layout or heads", -2: "a page id or slot outside the cache",
             -3: "a length outside its page table", -4: "heads attention cannot take",
             -5: "no memory for its scratch"}


# `model` below is a `Transformer`, typed as a module: transformer.py imports this file.


def layers_fit(model: nn.Module) -> bool:
    """Whether every layer of `model` is one `decode_layers.c` runs (see the module's doc)."""
    config = model.config
    return (config.mla is None and config.rope_dim == config.head_dim
            and model.shard.size == 1
            and all(type(layer.self_attn) is Attention and layer.self_attn.kv_heads is None
                    and _mlp_fits(layer.mlp) for layer in model.layers))


def _mlp_fits(mlp: nn.Module) -> bool:
    """A dense SwiGLU MLP, or Qwen3-MoE's experts: softmax routing, no shared experts."""
    if type(mlp) is MoE:
        return (mlp.gate.moe.routing == "softmax" and mlp.shared_experts is None
                and all(type(expert) is MLP for expert in mlp.experts))
    return type(mlp) is MLP


def takes(model: nn.Module, h: torch.Tensor, angles: RotaryAngles, kv_cache: KVCache,
          meta: AttentionMetadata, num_layers: int | None = None) -> bool:
    """Whether this forward's layers (the first `num_layers`, or all) run in one call: `h`
    holds one decode row per sequence, at most `KERNEL_ROWS` (several with the batch's padded
    page table), `model`'s layers fit (`layers_fit`, kept on it) and bump no counter, and the
    cache is a CPU tensor of `h`'s dtype with the model's heads and at least its layers."""
    rows, layers = h.shape[0], len(model.layers) if num_layers is None else num_layers
    return (ENABLED and model.layers_in_c and type(model.layer_counter) is NullLayerCounter
            and h.dtype in DTYPE_CODES and h.is_cpu
            and 0 < rows <= KERNEL_ROWS and len(meta.sequences) == rows
            and all(seq.query_len == 1 for seq in meta.sequences)
            and (rows == 1 or (meta.decode_page_table is not None
                               and meta.decode_kv_lens is not None))
            and 0 < layers <= len(model.layers) and angles.cast_cos.dtype == h.dtype
            and isinstance(kv_cache, PagedKVCache) and kv_cache.kv_parts == 2
            and kv_cache.num_layers >= layers and kv_cache.head_dim == model.config.head_dim
            and kv_cache.num_kv_heads == model.layers[0].self_attn.num_kv_heads
            and kv_cache.dtype == h.dtype and kv_cache.buffer.is_cpu
            and kv_cache.buffer.is_contiguous()
            and not torch.is_grad_enabled() and not traced())


def run(model: nn.Module, h: torch.Tensor, angles: RotaryAngles, kv_cache: PagedKVCache,
        meta: AttentionMetadata, num_layers: int) -> torch.Tensor:
    """The first `num_layers` layers over the decode rows `h` ``[rows, hidden]`` (the
    embeddings; consumed): their output before the final norm, each layer's K/V appended."""
    return named_call(PROFILER_NAME, _run, model, h, angles, kv_cache, meta, num_layers)


def _run(model: nn.Module, h: torch.Tensor, angles: RotaryAngles, kv_cache: PagedKVCache,
         meta: AttentionMetadata, num_layers: int) -> torch.Tensor:
    config, rows = model.config, h.shape[0]
    if meta.decode_page_table is not None and meta.decode_kv_lens is not None:
        table, lens = meta.decode_page_table, meta.decode_kv_lens
    else:
        [seq] = meta.sequences  # one decode: its own pages
        table, lens = seq.page_ids[None], torch.tensor([seq.kv_len])
    table = table.to(torch.int64).contiguous()
    lens = lens.to(torch.int64).contiguous()
    slot_pages = meta.slot_page_ids.to(torch.int64).contiguous()
    slot_offsets = meta.slot_offsets.to(torch.int64).contiguous()
    if table.shape[0] != rows or lens.numel() != rows or slot_pages.numel() != rows:
        raise KernelError(f"decode layers: {rows} rows, a page table for {table.shape[0]}, "
                          f"{lens.numel()} lengths and {slot_pages.numel()} slots")
    h = h.contiguous()
    weights = weights_of(model, num_layers, h.dtype)
    attn = model.layers[0].self_attn
    status = lib.dl_decode_layers(
        DTYPE_CODES[h.dtype], _LAYOUTS[kv_cache.kv_layout], weights.addresses.data_ptr(),
        num_layers, h.data_ptr(), rows, angles.cast_cos.data_ptr(), angles.cast_sin.data_ptr(),
        kv_cache.buffer.data_ptr(), kv_cache.num_pages, kv_cache.page_size, table.data_ptr(),
        table.shape[1], lens.data_ptr(), slot_pages.data_ptr(), slot_offsets.data_ptr(),
        config.hidden_size, attn.num_heads, attn.num_kv_heads, config.head_dim,
        config.intermediate_size, *_moe_shape(config.moe), config.rms_norm_eps, attn.scale,
        torch.get_num_threads())
    if status != 0:
        raise KernelError(f"decode layers refused the step: "
                          f"{_REFUSALS.get(status, f'code {status}')}")
    return h


def _moe_shape(moe: MoEConfig | None) -> tuple[int, int, int, int]:
    """decode_layers.c's num_experts, top_k, normalise and moe_inter (zeros: no MoE)."""
    if moe is None:
        return 0, 0, 0, 0
    return (moe.num_experts, moe.num_experts_per_tok, int(moe.norm_topk_prob),
            moe.moe_intermediate_size)
