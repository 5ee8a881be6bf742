"""Decode steps through static input buffers, captured as CUDA graphs per bucket (S3b).

`DecodeGraphs` runs pure-decode batches (one token per chunk) padded up to a batch-size bucket
and a page-table-width bucket. Every input lives in one preallocated buffer that a step fills
with one copy; on CUDA one graph per (batch bucket, pages bucket) replays the whole forward,
layer-counter bumps included, and on CPU the very same code runs eagerly over the same
buffers. It is not a general graph runner: prefill, mixed and multi-token chunks stay eager
(`ModelRunner`), and it never samples.
"""

from __future__ import annotations

import logging

import torch

from disagg.config import GRAPH_BATCH_SIZES
from disagg.engine.batch import Batch, ForwardOutput, ScheduledChunk
from disagg.model.attention import AttentionMetadata
from disagg.model.kv_cache import KVCache
from disagg.model.layer_counter import LayerCounter, NullLayerCounter
from disagg.model.transformer import Transformer

logger = logging.getLogger(__name__)

_NUM_WARMUP_RUNS = 2
_NUM_ROW_FIELDS = 5  # input id, position, slot page, slot offset, kv len

# NOTE on prefill chunks: they are not captured. A 512-token chunk spends its time in GEMMs that
# fill the GPU, so the few dozen kernel launches a graph saves are noise next to them (the
# launch overhead a graph removes only dominates when qo_len is tiny, S1). A captured chunk would
# also need static shapes for every request mix: token counts, per-request causal masks and
# prefix lengths, so it would pad attention to the longest context the bucket allows and pay
# O(max context) on every chunk. Decodes are where graphs pay, and their shapes are regular.


def page_buckets(max_pages: int) -> tuple[int, ...]:
    """Page-table widths that get a graph: powers of two below `max_pages`, then `max_pages`.

    A step gathers only its bucket's width, so its attention costs O(its own longest context).

    >>> page_buckets(100)
    (1, 2, 4, 8, 16, 32, 64, 100)
    >>> page_buckets(1)
    (1,)
    """
    if max_pages < 1:
        raise ValueError(f"max_pages must be >= 1, got {max_pages}")
    widths = []
    width = 1
    while width < max_pages:
        widths.append(width)
        width *= 2
    return (*widths, max_pages)


def smallest_bucket(size: int, buckets: tuple[int, ...]) -> int | None:
    """The first bucket that holds `size` (buckets ascending), or None if none does."""
    return next((bucket for bucket in buckets if bucket >= size), None)


def useful_batch_sizes(batch_sizes: tuple[int, ...], max_num_seqs: int) -> tuple[int, ...]:
    """Drop buckets a scheduler that runs at most `max_num_seqs` requests can never fill.

    >>> useful_batch_sizes((1, 2, 4, 8, 16, 32), max_num_seqs=10)
    (1, 2, 4, 8, 16)
    """
    cover = smallest_bucket(max_num_seqs, batch_sizes) or batch_sizes[-1]
    return tuple(size for size in batch_sizes if size <= cover)


class DecodeGraphs:
    """Static-buffer decode steps for batches of up to `batch_sizes[-1]` requests.

    `padding_page` is a page no request ever owns: padding rows write their K/V there and read
    only it (kv len 1), so they cannot touch a request's pages. `max_pages` is the most pages
    one request can hold (its context over the page size). On CUDA, graphs are captured lazily
    on first use or all at once with `capture_all()`; they bump whatever `model.layer_counter`
    was at capture time, so replacing the counter drops them for recapture.
    """

    def __init__(self, model: Transformer, kv_cache: KVCache, padding_page: int, max_pages: int,
                 batch_sizes: tuple[int, ...] = GRAPH_BATCH_SIZES) -> None:
        if not 0 <= padding_page < kv_cache.num_pages:
            raise ValueError(f"padding page {padding_page} is not a page of the cache "
                             f"({kv_cache.num_pages} pages)")
        self.model = model
        self.kv_cache = kv_cache
        self.padding_page = padding_page
        self.batch_sizes = tuple(batch_sizes)
        self.page_buckets = page_buckets(max_pages)
        self.device = kv_cache.device
        self.use_graphs = self.device.type == "cuda"
        self.stats = {"static": 0, "replays": 0, "captures": 0}
        max_batch = self.batch_sizes[-1]
        # One int64 buffer holds every input, so a step fills it with one host->device copy:
        # five per-row fields of `max_batch` slots each, then the page table, last so that a
        # bucket's table is a contiguous prefix. [5 * max_batch + max_batch * max_pages]
        self._inputs = torch.zeros(_NUM_ROW_FIELDS * max_batch + max_batch * max_pages,
                                   dtype=torch.int64, device=self.device)
        self._graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        # Every graph copies its hidden states and logits into the first rows of these, so
        # outputs cost one buffer pair, not one per graph. Allocated at the first capture.
        self._static_outputs: tuple[torch.Tensor, torch.Tensor] | None = None
        self._pool: tuple[int, int] | None = None
        self._captured_counter: LayerCounter | None = None
        self._warned_counter = False
        if not self.use_graphs:
            logger.info("CUDA graph capture is CUDA-only: decode steps on %s run the static-"
                        "buffer path eagerly", self.device)

    def bucket(self, batch: Batch) -> tuple[int, int] | None:
        """`(batch bucket, pages bucket)` the batch runs in, or None if it must run eagerly."""
        if not batch.is_pure_decode or not self._counter_capturable():
            return None
        batch_bucket = smallest_bucket(len(batch.chunks), self.batch_sizes)
        pages = max(self._num_pages(chunk) for chunk in batch.chunks)
        pages_bucket = smallest_bucket(pages, self.page_buckets)
        if batch_bucket is None or pages_bucket is None:
            return None
        return batch_bucket, pages_bucket

    def run(self, batch: Batch, bucket: tuple[int, int]) -> ForwardOutput:
        """One decode step of `batch` in `bucket` (from `bucket(batch)`)."""
        if self.use_graphs:
            if self.model.layer_counter is not self._captured_counter:
                self._drop_graphs()
            if bucket not in self._graphs:
                self._capture(bucket)
            self._fill(batch, bucket)
            self._graphs[bucket].replay()
            self.stats["replays"] += 1
            hidden, logits = (out[:bucket[0]] for out in self._static_outputs)
        else:
            self._fill(batch, bucket)
            hidden, logits = self._forward(bucket)
        self.stats["static"] += 1
        # The outputs are static buffers the next replay overwrites: hand out copies.
        sample_chunk_indices = [i for i, chunk in enumerate(batch.chunks) if chunk.samples]
        rows = torch.tensor(sample_chunk_indices, dtype=torch.int64, device=self.device)
        return ForwardOutput(sample_chunk_indices, hidden.index_select(0, rows),
                             logits.index_select(0, rows), hidden[:len(batch.chunks)].clone())

    @torch.inference_mode()
    def capture_all(self) -> None:
        """Capture every bucket now (engine start-up), largest first as the pool prefers."""
        if not self.use_graphs:
            logger.info("capture_all: nothing to capture on %s", self.device)
            return
        if self.model.layer_counter is not self._captured_counter:
            self._drop_graphs()
        for batch_bucket in reversed(self.batch_sizes):
            for pages_bucket in reversed(self.page_buckets):
                if (batch_bucket, pages_bucket) not in self._graphs:
                    self._capture((batch_bucket, pages_bucket))

    # Static buffers.

    def _views(self, bucket: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor,
                                                       AttentionMetadata]:
        """Input ids, positions and metadata of `bucket`: views into the one input buffer."""
        batch_bucket, pages_bucket = bucket
        stride = self.batch_sizes[-1]
        ids, positions, slot_pages, slot_offsets, kv_lens = (
            self._inputs[field * stride:field * stride + batch_bucket]
            for field in range(_NUM_ROW_FIELDS))
        table_start = _NUM_ROW_FIELDS * stride
        page_table = self._inputs[table_start:table_start + batch_bucket * pages_bucket]
        meta = AttentionMetadata(slot_page_ids=slot_pages, slot_offsets=slot_offsets,
                                 sequences=[], decode_page_table=page_table.view(
                                     batch_bucket, pages_bucket), decode_kv_lens=kv_lens)
        return ids, positions, meta

    def _fill(self, batch: Batch, bucket: tuple[int, int]) -> None:
        """Write the batch's rows, then padding rows, over everything `bucket` reads.

        Every slot the bucket's graph reads is rewritten here, so values left by an earlier,
        bigger batch can never reach this step's results.
        """
        batch_bucket, pages_bucket = bucket
        stride, page_size, pad = self.batch_sizes[-1], self.kv_cache.page_size, self.padding_page
        num_padding = stride - len(batch.chunks)
        fields: list[list[int]] = [[] for _ in range(_NUM_ROW_FIELDS)]
        page_table: list[int] = []
        for chunk in batch.chunks:
            request, position = chunk.request, chunk.start
            used = self._num_pages(chunk)
            for field, value in zip(fields, (_token_at(chunk), position,
                                             request.page_ids[position // page_size],
                                             position % page_size, position + 1), strict=True):
                field.append(value)
            page_table += request.page_ids[:used] + [pad] * (pages_bucket - used)
        # Padding rows: token 0 at position 0, K/V into slot 0 of the padding page, which is
        # also the one key they attend to.
        for field, value in zip(fields, (0, 0, pad, 0, 1), strict=True):
            field += [value] * num_padding
        page_table += [pad] * (pages_bucket * (batch_bucket - len(batch.chunks)))
        host = torch.tensor([value for field in fields for value in field] + page_table,
                            dtype=torch.int64)
        self._inputs[:host.numel()].copy_(host)

    def _fill_padding(self, bucket: tuple[int, int]) -> None:
        self._fill(Batch(), bucket)

    def _num_pages(self, chunk: ScheduledChunk) -> int:
        """Pages holding the chunk's keys after this step (its own token included)."""
        return -(-(chunk.start + 1) // self.kv_cache.page_size)

    # The forward, eager or captured.

    def _forward(self, bucket: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Final-norm hidden states ``[batch_bucket, hidden_size]`` and logits
        ``[batch_bucket, vocab_size]`` of the rows in the static buffers."""
        input_ids, positions, meta = self._views(bucket)
        hidden = self.model(input_ids, positions, self.kv_cache, meta)
        return hidden, self.model.compute_logits(hidden)

    def _capture(self, bucket: tuple[int, int]) -> None:
        """Warm up on a side stream, then record `bucket`'s forward into the shared pool."""
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        self._fill_padding(bucket)  # warm-up runs really execute: keep them off request pages
        counter = self.model.layer_counter
        # Warm-up forwards are real forwards; a poller watching the real counter would take
        # their bumps for a step's layers, so they bump a throwaway counter instead.
        self.model.layer_counter = LayerCounter(torch.zeros(1, dtype=torch.int64,
                                                            device=self.device))
        try:
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                for _ in range(_NUM_WARMUP_RUNS):
                    hidden, logits = self._forward(bucket)
            torch.cuda.current_stream(self.device).wait_stream(side)
        finally:
            self.model.layer_counter = counter
        if self._static_outputs is None:
            rows = self.batch_sizes[-1]
            self._static_outputs = (hidden.new_empty((rows, hidden.shape[1])),
                                    logits.new_empty((rows, logits.shape[1])))
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            for out, value in zip(self._static_outputs, self._forward(bucket), strict=True):
                out[:bucket[0]].copy_(value)
        self._graphs[bucket] = graph
        self._captured_counter = counter
        self.stats["captures"] += 1
        logger.debug("captured decode graph for batch %d x pages %d", *bucket)

    def _drop_graphs(self) -> None:
        if self._graphs:
            logger.info("layer counter changed: dropping %d decode graphs for recapture",
                        len(self._graphs))
        self._graphs.clear()
        self._pool = None
        self._captured_counter = self.model.layer_counter

    def _counter_capturable(self) -> bool:
        """Whether a graph can bump the model's counter: it must live on the model's device."""
        counter = self.model.layer_counter
        if not self.use_graphs or isinstance(counter, NullLayerCounter):
            return True
        device = counter.value.device
        if device.type == self.device.type and (device.index or 0) == (self.device.index or 0):
            return True
        if not self._warned_counter:
            self._warned_counter = True
            logger.warning("layer counter lives on %s, not %s: a graph cannot bump it, so "
                           "decode steps run eagerly (use LayerCounter.for_device)", device,
                           self.device)
        return False


def _token_at(chunk: ScheduledChunk) -> int:
    """The input token of a one-token chunk, without concatenating the request's lists."""
    request, position = chunk.request, chunk.start
    prompt, outputs = request.prompt_token_ids, request.output_token_ids
    if position < len(prompt):
        return prompt[position]
    if position < len(prompt) + len(outputs):
        return outputs[position - len(prompt)]
    return request.spec_token_ids[position - len(prompt) - len(outputs)]  # drafts (S8)
