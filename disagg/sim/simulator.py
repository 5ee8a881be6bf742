"""Discrete-event simulator of a serving cluster: mixed nodes, or prefillers feeding decoders.

Mixed (S1): every node batches decodes with prefill chunks, so a chunk stalls the decodes it
rides with. Disaggregated (S2, S3, S8, S9): decoders reserve pages and hand prompts to
prefillers, which stream KV layer by layer. Per request it records TTFT, tokens/s and every
inter-token gap; per instance, utilisation.
"""

# NOTE on the model. Each instance (a TP group or one DP rank) is idle or running exactly one
# step, whose length `cost_model.step_time` fixes from the batch it holds when it starts.
# Mixed nodes follow `disagg.engine.scheduler`: decodes first, prefill chunks fill the rest of the
# token budget, the last prompt chunk samples the first token. Disaggregated requests start
# at the least loaded decoder (pages reserved, S2a), go to the least loaded prefiller, which
# computes every prompt token but the last (S8) and streams KV so only the last layer's tail
# adds to TTFT (S3); the decoder runs the last prompt token as a decode step, which yields
# the first token. Events (arrival, step end, KV ready) are ordered by time, then insertion,
# so one seed gives one history. DP ranks are simulated independently and assumed to carry
# equal batches when they meet in the expert all-to-all.

from __future__ import annotations

import heapq
import itertools
import math
from collections import deque
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from disagg.errors import ConfigError
from disagg.sim.cost_model import BatchShape, Parallel, kv_capacity_tokens, kv_transfer, step_time
from disagg.sim.hardware import Hardware
from disagg.sim.models import SimModel
from disagg.sim.results import SimRequest, SimResult
from disagg.sim.workload import Arrival

Mode = Literal["mixed", "disagg"]
Kind = Literal["mixed", "prefill", "decode"]


@dataclass(frozen=True, slots=True)
class SimClusterConfig:
    """The deployment: a policy, node counts, layouts and scheduler limits.

    `chunk_size` is the prefill token budget of one step (SGLang's `chunked_prefill_size`;
    8,192 is its order of magnitude on 80 GB-class GPUs). `spec_tokens` is the number of
    draft tokens per decode step (None: one per MTP module the model ships), each accepted
    with `spec_acceptance` (DeepSeek-V3 report: 85-90% for its MTP module; we take 85%).
    """

    mode: Mode = "disagg"
    num_nodes: int = 4  # mixed
    prefillers: int = 1  # disagg, nodes
    decoders: int = 3  # disagg, nodes
    decoder_parallel: Parallel = field(default_factory=Parallel)
    prefill_parallel: Parallel = field(default_factory=Parallel)  # and the mixed nodes'
    chunk_size: int = 8192
    max_num_seqs: int = 256
    spec_tokens: int | None = None
    spec_acceptance: float = 0.85
    kv_memory_fraction: float = 0.9  # of the HBM that weights leave free

    def __post_init__(self) -> None:
        if self.mode not in ("mixed", "disagg"):
            raise ConfigError(f"unknown mode {self.mode!r}: expected 'mixed' or 'disagg'")
        for name in ("num_nodes", "prefillers", "decoders", "chunk_size", "max_num_seqs"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.prefill_parallel.dp > 1:
            raise ConfigError("prefillers and mixed nodes are modelled as TP groups only")
        if not 0 <= self.spec_acceptance <= 1:
            raise ConfigError(f"spec_acceptance must be in [0, 1], got {self.spec_acceptance}")

    @property
    def total_nodes(self) -> int:
        """Nodes the deployment occupies."""
        return self.num_nodes if self.mode == "mixed" else self.prefillers + self.decoders


@dataclass(eq=False)
class _Instance:
    name: str
    kind: Kind
    parallel: Parallel
    kv_capacity: float  # tokens
    nics: int
    waiting: deque[SimRequest] = field(default_factory=deque)  # to prefill, or KV arrived
    prefilling: list[SimRequest] = field(default_factory=list)
    running: list[SimRequest] = field(default_factory=list)  # decoding
    blocked: deque[SimRequest] = field(default_factory=deque)  # waiting for KV pages
    kv_used: float = 0.0
    load: float = 0.0  # what the router balances
    busy: bool = False
    busy_time: float = 0.0
    steps: int = 0
    prefill_steps: int = 0
    batch_sum: int = 0
    nic_free_at: float = 0.0
    step_prefills: list[tuple[SimRequest, int]] = field(default_factory=list)
    step_decodes: list[SimRequest] = field(default_factory=list)


class ClusterSimulator:
    """Replays one arrival stream through one deployment."""

    def __init__(self, model: SimModel, hw: Hardware, config: SimClusterConfig, seed: int = 0
                 ) -> None:
        self.model, self.hw, self.config = model, hw, config
        self.spec = model.mtp_layers if config.spec_tokens is None else config.spec_tokens
        self.rng = np.random.default_rng(seed + 1)
        self.events: list[tuple[float, int, str, object]] = []
        self._order = itertools.count()
        self.now = 0.0
        self.gaps: list[float] = []
        self.mixed = self._instances("mixed", config.num_nodes, config.prefill_parallel) \
            if config.mode == "mixed" else []
        self.prefillers = self._instances("prefill", config.prefillers, config.prefill_parallel) \
            if config.mode == "disagg" else []
        self.decoders = self._instances("decode", config.decoders, config.decoder_parallel) \
            if config.mode == "disagg" else []

    def _instances(self, kind: Kind, nodes: int, parallel: Parallel) -> list[_Instance]:
        per_node = parallel.dp  # a DP rank is an instance of its own
        capacity = kv_capacity_tokens(self.model, self.hw, parallel,
                                      self.config.kv_memory_fraction)
        nics = max(1, self.hw.nics_per_node * parallel.tp // self.hw.devices_per_node)
        return [_Instance(f"{kind}{n}" + (f".{r}" if per_node > 1 else ""), kind, parallel,
                          capacity, nics) for n in range(nodes) for r in range(per_node)]

    def run(self, arrivals: list[Arrival], warmup_s: float, horizon_s: float) -> SimResult:
        """Serve every arrival (until `horizon_s` at most); measure those after `warmup_s`."""
        requests = [SimRequest(i, a.time, a.prompt_len, a.output_len, a.time >= warmup_s)
                    for i, a in enumerate(arrivals)]
        for request in requests:
            self._push(request.arrival, "arrive", request)
        while self.events and self.events[0][0] <= horizon_s:
            self.now, _, kind, payload = heapq.heappop(self.events)
            if kind == "arrive":
                self._arrive(payload)  # type: ignore[arg-type]
            elif kind == "step_end":
                self._step_end(payload)  # type: ignore[arg-type]
            else:
                request, decoder = payload  # type: ignore[misc]
                self._kv_ready(request, decoder)
        instances = self.mixed + self.prefillers + self.decoders
        return SimResult(requests=[r for r in requests if r.measured], itl_gaps=np.array(self.gaps),
                         instances=[_stats(i, self.now) for i in instances], end_time=self.now)

    # Events.

    def _push(self, time: float, kind: str, payload: object) -> None:
        heapq.heappush(self.events, (time, next(self._order), kind, payload))

    def _arrive(self, request: SimRequest) -> None:
        if self.config.mode == "mixed":
            node = min(self.mixed, key=lambda i: i.load)
            node.load += 1
            node.waiting.append(request)
            self._kick(node)
            return
        decoder = min(self.decoders, key=lambda i: i.load)
        decoder.load += 1
        request.decoder = decoder
        decoder.blocked.append(request)
        self._unblock(decoder)

    def _unblock(self, decoder: _Instance) -> None:
        """Reserve pages for queued requests in order (S2a), then hand them to prefillers."""
        while decoder.blocked:
            request = decoder.blocked[0]
            need = request.prompt_len + request.output_len
            if decoder.kv_used + need > decoder.kv_capacity and decoder.kv_used > 0:
                return
            decoder.blocked.popleft()
            decoder.kv_used += need
            prefiller = min(self.prefillers, key=lambda i: i.load)
            prefiller.load += request.prompt_len
            request.prefill_target = request.prompt_len - 1  # the decoder runs the last (S8)
            prefiller.waiting.append(request)
            self._kick(prefiller)

    def _kv_ready(self, request: SimRequest, decoder: _Instance) -> None:
        request.kv_ready = self.now
        decoder.waiting.append(request)
        self._kick(decoder)

    def _kick(self, inst: _Instance) -> None:
        if inst.busy:
            return
        chunks = self._plan(inst)
        if not chunks:
            return
        shape = BatchShape.from_chunks(chunks, max_decode_len=1 + self.spec)
        extra = self.model.mtp_layers if self.spec and inst.step_decodes else 0
        duration = step_time(self.model, self.hw, inst.parallel, shape, extra_layers=extra)
        inst.busy, inst.busy_time, inst.steps = True, inst.busy_time + duration, inst.steps + 1
        inst.prefill_steps += bool(inst.step_prefills)
        inst.batch_sum += len(chunks)
        self._push(self.now + duration, "step_end", inst)

    def _plan(self, inst: _Instance) -> list[tuple[int, int]]:
        """This step's chunks as `(qo_len, context_len)`: decodes first, then prefill chunks."""
        cfg = self.config
        if inst.kind == "decode":
            while inst.waiting and len(inst.running) < cfg.max_num_seqs:
                inst.running.append(inst.waiting.popleft())
        inst.step_decodes = list(inst.running)
        chunks = [(1 + self.spec if r.generated else 1, r.prompt_len + r.generated - 1)
                  for r in inst.step_decodes]
        budget = cfg.chunk_size - sum(q for q, _ in chunks)
        inst.step_prefills = []
        if inst.kind == "decode":
            return chunks
        while inst.waiting and len(inst.prefilling) + len(inst.running) < cfg.max_num_seqs:
            request, need = inst.waiting[0], inst.waiting[0].prompt_len
            need += request.output_len if inst.kind == "mixed" else 0
            if inst.kv_used + need > inst.kv_capacity and inst.kv_used > 0:
                break
            inst.kv_used += need
            inst.prefilling.append(inst.waiting.popleft())
            if inst.kind == "mixed":
                request.prefill_target = request.prompt_len
        for request in inst.prefilling:
            if budget <= 0:
                break
            qo = min(request.prefill_target - request.prefilled, budget)
            if math.isnan(request.prefill_start):
                request.prefill_start = self.now
            inst.step_prefills.append((request, qo))
            chunks.append((qo, request.prefilled))
            budget -= qo
        return chunks

    def _step_end(self, inst: _Instance) -> None:
        inst.busy = False
        for request, qo in inst.step_prefills:
            request.prefilled += qo
            if request.prefilled < request.prefill_target:
                continue
            inst.prefilling.remove(request)
            if inst.kind == "mixed":  # the prefill's last row samples the first token
                request.generated, request.first_token = 1, self.now
                request.last_token = self.now
                inst.running.append(request)
            else:
                self._ship(inst, request, qo)
        if inst.step_decodes:
            self._advance_decodes(inst)
        self._kick(inst)

    def _ship(self, prefiller: _Instance, request: SimRequest, last_chunk: int) -> None:
        """Stream the KV to the decoder; it lands a layer's worth after the prefill ends (S3)."""
        decoder = request.decoder
        nics = min(prefiller.nics, decoder.nics)
        cost = kv_transfer(self.model, self.hw, request.prefill_target, last_chunk, nics)
        pipe = cost.nbytes / (prefiller.nics * self.hw.nic_bandwidth * self.hw.comm_efficiency)
        start = max(request.prefill_start, prefiller.nic_free_at)
        prefiller.nic_free_at = start + pipe
        ready = max(self.now + cost.tail_s, request.prefill_start + cost.stream_s,
                    prefiller.nic_free_at)
        prefiller.load -= request.prompt_len
        prefiller.kv_used -= request.prompt_len  # freed once the writes complete (S4b)
        self._push(ready, "kv_ready", (request, decoder))

    def _advance_decodes(self, inst: _Instance) -> None:
        decodes = inst.step_decodes
        accepted = np.zeros(len(decodes), dtype=np.int64)
        if self.spec:
            draws = self.rng.random((len(decodes), self.spec)) < self.config.spec_acceptance
            accepted = np.cumprod(draws, axis=1).sum(axis=1)
        for request, extra in zip(decodes, accepted.tolist(), strict=True):
            if request.generated == 0:  # disagg: the last prompt token's step (S8)
                request.generated, request.first_token = 1, self.now
            else:
                request.generated = min(request.output_len, request.generated + 1 + extra)
                if request.measured:
                    self.gaps.append(self.now - request.last_token)
            request.last_token = self.now
            if request.generated >= request.output_len:
                request.finish = self.now
                inst.running.remove(request)
                inst.kv_used -= request.prompt_len + request.output_len
                inst.load -= 1
                if inst.kind == "decode":
                    self._unblock(inst)


def _stats(inst: _Instance, end_time: float) -> dict[str, object]:
    return {"name": inst.name, "kind": inst.kind, "steps": inst.steps,
            "utilisation": inst.busy_time / end_time if end_time else 0.0,
            "prefill_step_share": inst.prefill_steps / inst.steps if inst.steps else 0.0,
            "mean_batch": inst.batch_sum / inst.steps if inst.steps else 0.0}
