"""From a scheduled `Batch` to model inputs, one forward, and the rows to sample (S1, S3b).

The runner packs every chunk's tokens on one axis, computes where each token's K/V goes (page
and slot), and tells attention which rows belong to which request. It returns the hidden states
of the rows that sample, so a prefiller can ship them (S4a), and their logits, so an engine can
sample; a prefiller's runner never samples (S8) and skips the LM head.
Given `DecodeGraphs`, pure-decode batches that fit a bucket take its static-buffer path (CUDA
graphs on a GPU, `cuda_graphs.py`); everything else runs here, eagerly. On a tensor-parallel
node the runner is the leader's: it broadcasts each step's inputs to the other ranks before
its own forward (`disagg/parallel/`), and its cache is rank 0's shard.
"""

from __future__ import annotations

import torch

from disagg.engine.batch import Batch, ForwardOutput
from disagg.engine.cuda_graphs import DecodeGraphs
from disagg.model.attention import AttentionMetadata, SequenceSlice
from disagg.model.kv_cache import KVCache
from disagg.model.transformer import Transformer
from disagg.parallel.ranks import TPRanks


class ModelRunner:
    """Runs a `Transformer` over a paged `KVCache` one batch at a time."""

    def __init__(self, model: Transformer, kv_cache: KVCache,
                 graphs: DecodeGraphs | None = None, ranks: TPRanks | None = None,
                 samples: bool = True) -> None:
        if graphs is not None and ranks is not None:
            raise ValueError("decode graphs run on one process: not with TP rank processes")
        self.model = model
        self.kv_cache = kv_cache
        self.device = kv_cache.device
        self.graphs = graphs
        self.ranks = ranks
        self.samples = samples  # else no logits: nothing reads them
        self._num_eager = 0

    @property
    def graph_stats(self) -> dict[str, int]:
        """Steps per path: ``static`` (static buffers; ``replays`` of them replayed a CUDA
        graph), ``captures`` (graphs recorded) and ``eager`` (the packed path below)."""
        stats = {"static": 0, "replays": 0, "captures": 0}
        if self.graphs is not None:
            stats |= self.graphs.stats
        return stats | {"eager": self._num_eager}

    def prepare(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """Token ids ``[num_tokens]``, positions ``[num_tokens]`` and attention metadata."""
        page_size = self.kv_cache.page_size
        token_ids: list[int] = []
        sequences = []
        for chunk in batch.chunks:
            request = chunk.request
            sequences.append(SequenceSlice(
                query_start=len(token_ids), query_len=chunk.num_tokens, context_len=chunk.start,
                page_ids=torch.tensor(request.page_ids, dtype=torch.int64, device=self.device)))
            token_ids += request.token_ids(chunk.start, chunk.end)  # drafts follow (S8)
        positions = torch.cat([torch.arange(c.start, c.end) for c in batch.chunks]).to(self.device)
        page_index = positions // page_size  # which of the request's pages, per token
        slot_pages = torch.cat([seq.page_ids[page_index[seq.query_start:seq.query_start
                                                        + seq.query_len]] for seq in sequences])
        meta = AttentionMetadata(slot_page_ids=slot_pages, slot_offsets=positions % page_size,
                                 sequences=sequences)
        if batch.is_pure_decode and len(sequences) > 1:
            meta.decode_page_table = self._padded_page_table(sequences)
            meta.decode_kv_lens = torch.tensor([s.kv_len for s in sequences], device=self.device)
        input_ids = torch.tensor(token_ids, dtype=torch.int64, device=self.device)
        return input_ids, positions, meta

    @torch.inference_mode()
    def execute(self, batch: Batch) -> ForwardOutput:
        """Run the batch; K/V land in the cache, sampling rows come back."""
        if self.graphs is not None:
            bucket = self.graphs.bucket(batch)
            if bucket is not None:
                return self.graphs.run(batch, bucket)
        self._num_eager += 1
        input_ids, positions, meta = self.prepare(batch)
        if self.ranks is not None:
            self.ranks.broadcast_step((input_ids, positions, meta))
        hidden = self.model(input_ids, positions, self.kv_cache, meta)
        sample_chunk_indices = [i for i, chunk in enumerate(batch.chunks) if chunk.samples]
        last_rows = torch.tensor([meta.sequences[i].query_start + meta.sequences[i].query_len - 1
                                  for i in sample_chunk_indices], dtype=torch.int64,
                                 device=self.device)
        sample_hidden = hidden.index_select(0, last_rows)
        logits = self.model.compute_logits(sample_hidden) if self.samples else None
        return ForwardOutput(sample_chunk_indices, sample_hidden, logits, hidden)

    def close(self) -> None:
        """Stop the TP ranks, if any (idempotent)."""
        if self.ranks is not None:
            self.ranks.stop()

    def _padded_page_table(self, sequences: list[SequenceSlice]) -> torch.Tensor:
        max_pages = max(-(-s.kv_len // self.kv_cache.page_size) for s in sequences)
        # Pad with page 0: padded keys are masked by kv_len, so which page fills them is moot.
        table = torch.zeros((len(sequences), max_pages), dtype=torch.int64, device=self.device)
        for row, seq in enumerate(sequences):
            used = -(-seq.kv_len // self.kv_cache.page_size)
            table[row, :used] = seq.page_ids[:used]
        return table
