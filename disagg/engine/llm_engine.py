"""The single-node engine: scheduler, model runner and sampler in one loop (S1).

`LLMEngine.step()` is the whole serving loop: schedule a batch, tell the observers which chunks
it holds (S3a), run it, tell them what it produced, then sample and advance (or let the
speculator do that, S8). Who observes is fixed when the engine is built: a node's builder
passes its messenger (and a decoder's speculator) in; nothing is attached later. The parts an
engine is made of (`EngineParts`) are built first, so plug-ins can be given the same cache,
allocator and scheduler the engine steps. With `cuda_graph` the runner sends pure-decode steps
through static buffers and CUDA graphs (S3b, `cuda_graphs.py`). An exception while stepping
one request fails that request alone, and one in the batched forward fails that batch's
requests; the engine goes on (X5a, `isolation.py`, which says what still propagates).
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from disagg.config import CacheConfig, EngineConfig, ModelConfig
from disagg.engine.batch import Batch, ForwardOutput, TokenEvent
from disagg.engine.cuda_graphs import DecodeGraphs, useful_batch_sizes
from disagg.engine.fork_hooks import ForkHooks
from disagg.engine.isolation import MAX_FORWARD_FAILURES, EngineFailure, RequestIsolation
from disagg.engine.logprobs import TokenLogprob
from disagg.engine.model_runner import ModelRunner
from disagg.engine.page_allocator import PageAllocator
from disagg.engine.prefix_cache import PrefixCache, cache_salt
from disagg.engine.request import Request, RequestState, SamplingParams
from disagg.engine.scheduler import Scheduler
from disagg.engine.token_chooser import TokenChooser
from disagg.errors import ConfigError, RankError
from disagg.model.huge_pages import into_huge_pages
from disagg.model.kv_cache import KVCache, PagedKVCache
from disagg.model.layer_counter import LayerCounter
from disagg.model.sharded_kv_cache import ShardedKVCache
from disagg.model.sharding import Sharding
from disagg.model.precision import cast_model
from disagg.model.transformer import Transformer
from disagg.parallel.leader import TPLeader, start_leader

if TYPE_CHECKING:
    from disagg.engine.guided import GuideCompiler


class StepObserver(Protocol):
    """Told about every step: a prefiller's messenger plans and ships pages from these (S3a)."""

    def on_batch(self, batch: Batch) -> None:
        """Before the forward: the chunks this step runs."""

    def after_forward(self, batch: Batch, output: ForwardOutput) -> None:
        """After the forward, before sampling: what it produced."""


class StepFinisher(Protocol):
    """What replaces sampling and postprocessing when the engine speculates (S8)."""

    def finish_step(self, batch: Batch, output: ForwardOutput) -> list[TokenEvent]: ...


@dataclass(frozen=True, slots=True)
class EngineParts:
    """What one engine is made of. Built before the engine, so that a builder can hand the
    same cache, allocator and scheduler to the engine's plug-ins (messenger, speculator)."""

    config: EngineConfig
    model: Transformer
    kv_cache: KVCache
    allocator: PageAllocator
    scheduler: Scheduler
    runner: ModelRunner
    isolation: RequestIsolation  # fails one request whose step raised (X5a)
    chooser: TokenChooser  # each request's next token: logits shaped, masked, sampled
    forks: ForkHooks  # who takes part in forking an n > 1 request (plug-ins register here)

    @staticmethod
    def build(config: EngineConfig, model: Transformer | TPLeader,
              guides: GuideCompiler | None = None) -> EngineParts:
        """Cache, allocator, scheduler and runner for `model` (moved to `config.device`), or
        for a TP leader's shard, its ranks and every rank's KV; `guides` compiles grammars
        for structured output (None: the model has no tokenizer, so none is served)."""
        leader = model if isinstance(model, TPLeader) else None
        model = leader.model if leader else model.to(config.device).eval()
        if not leader:
            into_huge_pages(model)  # its CPU weights: a decode streams them (X8f)
        check_cache_fits(model.config, config.cache)
        kv_cache = leader.kv_cache if leader else make_kv_cache(model.config, config)
        # With decode graphs the cache's last page is the padding rows' scratch page: the
        # allocator never manages it, so no request gets it and leak checks stay exact.
        cache = config.cache
        num_request_pages = cache.num_pages - 1 if config.cuda_graph else cache.num_pages
        prefix_cache = None
        if cache.prefix_caching:
            salt = cache_salt(repr(model.config), cache.kv_layout, cache.page_size,
                              str(cache.dtype))
            prefix_cache = PrefixCache(cache.page_size, salt)
        allocator = PageAllocator(num_request_pages, prefix_cache)
        max_model_len = min(model.config.max_position_embeddings,
                            num_request_pages * cache.page_size)
        # Forks of n > 1 requests (X6c): the cache copies their last page (at TP the leader's
        # cache has every rank copy its shard), and each fork's token choice starts afresh.
        forks = ForkHooks()
        chooser = TokenChooser(model.config.vocab_size, guides)
        forks.add(copy_page=kv_cache.copy_page,
                  on_fork=lambda _, children: [chooser.admit(child) for child in children])
        scheduler = Scheduler(config.scheduler, allocator, cache.page_size, max_model_len,
                              copy_page=forks.copy_page, on_fork=forks.on_fork)
        graphs = None
        if config.cuda_graph:
            graphs = DecodeGraphs(model, kv_cache, padding_page=cache.num_pages - 1,
                                  max_pages=-(-max_model_len // cache.page_size),
                                  batch_sizes=useful_batch_sizes(
                                      config.graph_batch_sizes, config.scheduler.max_num_seqs))
        samples = config.scheduler.mode != "prefill_only"  # a prefiller never samples (S8)
        runner = (ModelRunner(model, leader.local_cache, ranks=leader.ranks, samples=samples)
                  if leader else ModelRunner(model, kv_cache, graphs, samples=samples))
        return EngineParts(config, model, kv_cache, allocator, scheduler, runner,
                           RequestIsolation(scheduler), chooser, forks)


class LLMEngine:
    """Serves many requests at once on one node with continuous batching."""

    def __init__(self, parts: EngineParts, observers: Sequence[StepObserver] = (),
                 finisher: StepFinisher | None = None) -> None:
        self.config = parts.config
        self.model = parts.model
        self.kv_cache = parts.kv_cache
        self.allocator = parts.allocator
        self.scheduler = parts.scheduler
        self.runner = parts.runner
        self.isolation = parts.isolation
        self.chooser = parts.chooser
        self.observers = tuple(observers)  # in the order they are told
        self.finisher = finisher  # a speculator verifies, samples and drafts instead (S8)
        self._ids = itertools.count()
        self.num_steps = 0  # batches run so far
        self.last_batch: Batch | None = None
        self._forward_failures = 0  # in a row (X5a)

    def add_request(self, prompt_token_ids: list[int], params: SamplingParams | None = None,
                    request_id: str | None = None) -> Request:
        """Queue a prompt; returns its `Request`, which fills in as steps run."""
        request = Request(request_id or f"req-{next(self._ids)}", list(prompt_token_ids),
                          params or SamplingParams(), self.model.config.eos_token_ids)
        self.chooser.admit(request)
        self.scheduler.add_request(request)
        return request

    def close(self) -> None:
        """Stop what the engine runs besides this process: its TP ranks (idempotent)."""
        self.runner.close()

    def has_unfinished(self) -> bool:
        """Whether any request still needs steps."""
        return self.scheduler.has_unfinished()

    def step(self) -> list[TokenEvent]:
        """Run one batch; return the tokens it produced. Requests it failed instead (X5a) are
        in `take_failures`."""
        batch = self.scheduler.schedule()
        if batch.is_empty:
            return []
        self.last_batch = batch
        output = self._forward(batch)
        if output is None:
            return []
        if self.finisher is not None:
            return self.finisher.finish_step(batch, output)
        if self.config.scheduler.mode == "prefill_only":
            self.scheduler.postprocess(batch, {})  # a prefiller never samples (S8)
            return []
        sampled: dict[str, int] = {}
        for row, chunk_idx in enumerate(output.sample_chunk_indices):
            request = batch.chunks[chunk_idx].request
            with self.isolation.guard(request, "sampling"):
                sampled[request.request_id] = self.chooser.choose(request, output.logits[row])
        for chunk in batch.chunks:
            if not chunk.request.is_finished:  # else it failed above
                with self.isolation.guard(chunk.request, "appending its token"):
                    self.scheduler.advance(chunk, sampled.get(chunk.request.request_id))
        sampling_requests = [batch.chunks[i].request for i in output.sample_chunk_indices]
        return [TokenEvent(request, sampled[request.request_id], request.is_finished,
                           self._last_logprob(request))
                for request in sampling_requests
                if request.state is not RequestState.FINISHED_FAILED]  # failed this step

    def _last_logprob(self, request: Request) -> TokenLogprob | None:
        logprobs = self.chooser.logprobs(request)
        return logprobs[-1] if logprobs else None

    def take_failures(self) -> list[EngineFailure]:
        """Requests the engine failed since the last call (X5a): the node reports each to its
        client as `FINISHED_FAILED` with the failure's cause and detail."""
        return self.isolation.take_failures()

    def _forward(self, batch: Batch) -> ForwardOutput | None:
        """The observers and the batched forward; None when they raised and the batch's
        requests failed instead (see `isolation.py` for what propagates)."""
        self.num_steps += 1  # a batch that fails ran too: its requests made progress (they ended)
        try:
            for observer in self.observers:
                observer.on_batch(batch)
            output = self.runner.execute(batch)
            for observer in self.observers:
                observer.after_forward(batch, output)
        except RankError:
            raise  # a dead rank: the node cannot step at all
        except Exception as error:
            self._forward_failures += 1
            if (self.config.scheduler.mode == "prefill_only"
                    or self._forward_failures >= MAX_FORWARD_FAILURES):
                raise
            self.isolation.fail([chunk.request for chunk in batch.chunks],
                                "the batched forward", error)
            return None
        self._forward_failures = 0
        return output

    def generate(self, prompts: Iterable[list[int]],
                 params: SamplingParams | None = None) -> list[Request]:
        """Serve every prompt to completion; requests come back in prompt order (with `n > 1`,
        each prompt's forks in choice order)."""
        requests = [self.add_request(prompt, params) for prompt in prompts]
        while self.has_unfinished():
            steps_before = self.num_steps
            self.step()
            if self.num_steps == steps_before:
                # Requests wait but nothing could be scheduled: a bug, never a silent hang.
                raise RuntimeError(f"engine made no progress ({self.allocator.num_free} pages "
                                   f"free, {len(self.scheduler.waiting)} waiting)")
        return [fork for request in requests for fork in (request.forks or [request])]


def make_kv_cache(model: ModelConfig, config: EngineConfig) -> KVCache:
    """The cache of a one-process engine. A sharded node's comes from its TP leader, whose
    ranks hold their own shards (`disagg.parallel.leader`)."""
    parallel = config.parallel
    if parallel.tp > 1:
        raise ConfigError(f"TP {parallel.tp} runs {parallel.tp} rank processes: build the "
                          "engine from `disagg.parallel.leader.start_leader`")
    local = PagedKVCache(model, config.cache, config.device)
    sharding = Sharding.of_model(model, 1, parallel.replicated_kv)
    if not sharding.replicated:
        return local
    return ShardedKVCache(model, config.cache, sharding, [local])


def check_cache_fits(model: ModelConfig, cache: CacheConfig) -> None:
    """Refuse a page size or cache size that cannot work, naming the numbers."""
    if cache.page_size > model.max_position_embeddings:
        raise ConfigError(f"page size {cache.page_size} does not fit: the model's context is "
                          f"{model.max_position_embeddings} tokens")
    nbytes = (model.num_layers * cache.num_tokens * model.kv_values_per_token_layer
              * torch.empty(0, dtype=cache.dtype).element_size())
    limit = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2
    if nbytes > limit:
        raise ConfigError(f"KV cache of {cache.num_pages} pages x {cache.page_size} tokens needs "
                          f"{nbytes / 2**30:.1f} GiB, more than half of this machine's memory")


def load_transformer(config: EngineConfig, state_dict: dict[str, torch.Tensor],
                     layer_counter: LayerCounter | None = None) -> Transformer:
    """A model holding `state_dict` (names as in `Transformer.load_weights`), in the engine's
    dtype (`model/precision.py`)."""
    return cast_model(Transformer.holding(config.model, state_dict, layer_counter),
                      config.dtype)


def build_model(config: EngineConfig, state_dict: dict[str, torch.Tensor] | None,
                layer_counter: LayerCounter | None = None, *, model_spec: str | None = None,
                threads: int | None = None, node_id: str = "node",
                on_failure: Callable[[BaseException], None] = lambda _: None,
                ) -> Transformer | TPLeader:
    """What `EngineParts.build` takes: the model holding `state_dict` at TP 1, else the leader
    of rank processes that load `model_spec` themselves (`on_failure`: a rank died). At TP > 1
    a `state_dict` of None lets rank 0 read its own slices."""
    parallel = config.parallel
    if parallel.tp == 1:
        if state_dict is None:
            raise ConfigError("TP 1 builds the model in this process: it needs the weights")
        return load_transformer(config, state_dict, layer_counter)
    if model_spec is None:
        raise ConfigError(f"TP {parallel.tp}: the rank processes load the model themselves, "
                          "so they need its model_spec")
    sharding = Sharding.of_model(config.model, parallel.tp, parallel.replicated_kv)
    return start_leader(model_spec, config.model, state_dict, config.cache, sharding,
                        device=config.device, dtype=config.dtype, threads=threads,
                        node_id=node_id, layer_counter=layer_counter, on_failure=on_failure)


def build_engine(config: EngineConfig, state_dict: dict[str, torch.Tensor],
                 layer_counter: LayerCounter | None = None,
                 model_spec: str | None = None) -> LLMEngine:
    """A plain engine (no observers) whose model holds `state_dict`. At TP > 1 it leads rank
    processes that load `model_spec` themselves (`close()` the engine to stop them)."""
    return LLMEngine(EngineParts.build(config, build_model(config, state_dict, layer_counter,
                                                           model_spec=model_spec)))
