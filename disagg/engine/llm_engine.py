"""The single-node engine: scheduler, model runner and sampler in one loop (S1).

`LLMEngine.step()` is the whole serving loop in four lines: schedule a batch, tell whoever
listens which chunks it holds (S3a), run it, sample and advance. The prefiller and decoder engines
of a disaggregated deployment are these same parts rearranged. With `cuda_graph` the runner
sends pure-decode steps through static buffers and CUDA graphs (S3b, `graph_runner.py`).
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Protocol

import torch

from disagg.config import CacheConfig, EngineConfig, ModelConfig
from disagg.engine.batch import Batch
from disagg.engine.cuda_graphs import DecodeGraphs, useful_batch_sizes
from disagg.engine.model_runner import ForwardOutput, ModelRunner
from disagg.engine.page_allocator import PageAllocator
from disagg.engine.request import Request, SamplingParams
from disagg.engine.sampling import sample_token
from disagg.engine.scheduler import Scheduler
from disagg.errors import ConfigError
from disagg.model.kv_cache import KVCache, PagedKVCache
from disagg.model.sharded_kv_cache import ShardedKVCache
from disagg.model.sharding import Sharding
from disagg.model.transformer import Transformer


@dataclass(frozen=True, slots=True)
class TokenEvent:
    """A token a step produced for a request; `finished` if it was the request's last."""

    request: Request
    token_id: int
    finished: bool


class StepFinisher(Protocol):
    """What replaces sampling and postprocessing when the engine speculates."""

    def finish_step(self, batch: Batch, output: ForwardOutput) -> list[TokenEvent]: ...


class LLMEngine:
    """Serves many requests at once on one node with continuous batching."""

    def __init__(self, config: EngineConfig, model: Transformer) -> None:
        self.config = config
        self.model = model.to(config.device).eval()
        check_cache_fits(model.config, config.cache)
        self.kv_cache = make_kv_cache(model.config, config)
        # With decode graphs the cache's last page is the padding rows' scratch page: the
        # allocator never manages it, so no request gets it and leak checks stay exact.
        cache = config.cache
        num_request_pages = cache.num_pages - 1 if config.cuda_graph else cache.num_pages
        self.allocator = PageAllocator(num_request_pages)
        max_model_len = min(model.config.max_position_embeddings,
                            num_request_pages * cache.page_size)
        self.scheduler = Scheduler(config.scheduler, self.allocator, cache.page_size,
                                   max_model_len)
        graphs = None
        if config.cuda_graph:
            graphs = DecodeGraphs(self.model, self.kv_cache, padding_page=cache.num_pages - 1,
                                  max_pages=-(-max_model_len // cache.page_size),
                                  batch_sizes=useful_batch_sizes(
                                      config.graph_batch_sizes, config.scheduler.max_num_seqs))
        self.runner = ModelRunner(self.model, self.kv_cache, graphs)
        # Told which chunks run before each forward (S3a), and what it produced after it.
        self.batch_listeners: list[Callable[[Batch], None]] = []
        self.forward_listeners: list[Callable[[Batch, ForwardOutput], None]] = []
        self._ids = itertools.count()
        self.num_steps = 0  # batches run so far
        self.last_batch: Batch | None = None
        # Set by `spec_engine.enable_speculation`: it then verifies, samples and drafts (issue 6).
        self.speculator: StepFinisher | None = None

    def add_request(self, prompt_token_ids: list[int], params: SamplingParams | None = None,
                    request_id: str | None = None) -> Request:
        """Queue a prompt; returns its `Request`, which fills in as steps run."""
        request = Request(request_id or f"req-{next(self._ids)}", list(prompt_token_ids),
                          params or SamplingParams(), self.model.config.eos_token_ids)
        self.scheduler.add_request(request)
        return request

    def has_unfinished(self) -> bool:
        """Whether any request still needs steps."""
        return self.scheduler.has_unfinished()

    def step(self) -> list[TokenEvent]:
        """Run one batch; return the tokens it produced."""
        batch = self.scheduler.schedule()
        if batch.is_empty:
            return []
        self.last_batch = batch
        for listener in self.batch_listeners:
            listener(batch)
        output = self.runner.execute(batch)
        self.num_steps += 1
        for forward_listener in self.forward_listeners:
            forward_listener(batch, output)
        if self.speculator is not None:
            return self.speculator.finish_step(batch, output)
        sampled: dict[str, int] = {}
        if self.config.scheduler.mode == "prefill_only":
            self.scheduler.postprocess(batch, sampled)  # a prefiller never samples (S8)
            return []
        for row, chunk_idx in enumerate(output.sample_chunk_indices):
            request = batch.chunks[chunk_idx].request
            sampled[request.request_id] = sample_token(output.logits[row],
                                                       request.sampling_params, request.generator)
        self.scheduler.postprocess(batch, sampled)
        sampling_requests = [batch.chunks[i].request for i in output.sample_chunk_indices]
        return [TokenEvent(request, sampled[request.request_id], request.is_finished)
                for request in sampling_requests]

    def generate(self, prompts: Iterable[list[int]],
                 params: SamplingParams | None = None) -> list[Request]:
        """Serve every prompt to completion; requests come back in prompt order."""
        requests = [self.add_request(prompt, params) for prompt in prompts]
        while self.has_unfinished():
            steps_before = self.num_steps
            self.step()
            if self.num_steps == steps_before:
                # Requests wait but nothing could be scheduled: a bug, never a silent hang.
                raise RuntimeError(f"engine made no progress ({self.allocator.num_free} pages "
                                   f"free, {len(self.scheduler.waiting)} waiting)")
        return requests


def make_kv_cache(model: ModelConfig, config: EngineConfig) -> KVCache:
    """One paged cache, or one per TP rank when the node is sharded (S6)."""
    parallel = config.parallel
    if parallel.tp == 1 and not parallel.replicated_kv:
        return PagedKVCache(model, config.cache, config.device)
    sharding = Sharding(parallel.tp, model.num_kv_heads, parallel.replicated_kv)
    return ShardedKVCache(model, config.cache, sharding, config.device)


def check_cache_fits(model: ModelConfig, cache: CacheConfig) -> None:
    """Refuse a page size or cache size that cannot work, naming the numbers."""
    if cache.page_size > model.max_position_embeddings:
        raise ConfigError(f"page size {cache.page_size} does not fit: the model's context is "
                          f"{model.max_position_embeddings} tokens")
    nbytes = (2 * model.num_layers * cache.num_tokens * model.num_kv_heads * model.head_dim
              * torch.empty(0, dtype=cache.dtype).element_size())
    limit = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2
    if nbytes > limit:
        raise ConfigError(f"KV cache of {cache.num_pages} pages x {cache.page_size} tokens needs "
                          f"{nbytes / 2**30:.1f} GiB, more than half of this machine's memory")


def build_engine(config: EngineConfig, state_dict: dict[str, torch.Tensor]) -> LLMEngine:
    """An engine whose model holds `state_dict` (names as in `Transformer.load_weights`)."""
    model = Transformer(config.model)
    model.load_weights(state_dict)
    return LLMEngine(config, model)
