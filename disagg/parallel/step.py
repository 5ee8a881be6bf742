"""One step's model inputs as the leader broadcasts them and a rank receives them (S3c)."""

from __future__ import annotations

from dataclasses import replace

import torch

from disagg.model.attention import AttentionMetadata, SequenceSlice

Step = tuple[torch.Tensor, torch.Tensor, AttentionMetadata]


def _to(tensor: torch.Tensor | None, device: str | torch.device) -> torch.Tensor | None:
    return None if tensor is None else tensor.to(device)


def step_to(step: Step, device: str | torch.device) -> Step:
    """`step` with every tensor on `device` (host memory to broadcast, a rank's device to run)."""
    input_ids, positions, meta = step
    sequences = [SequenceSlice(s.query_start, s.query_len, s.context_len, s.page_ids.to(device))
                 for s in meta.sequences]
    meta = replace(meta, slot_page_ids=meta.slot_page_ids.to(device),
                   slot_offsets=meta.slot_offsets.to(device), sequences=sequences,
                   decode_page_table=_to(meta.decode_page_table, device),
                   decode_kv_lens=_to(meta.decode_kv_lens, device))
    return input_ids.to(device), positions.to(device), meta
