"""TP ranks as processes: same tokens as one process, the leader-only counter, dead ranks (S3c,
S5a). Every test here runs real rank processes (gloo over loopback, memfd KV)."""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Any

import pytest
import torch

from disagg.config import CacheConfig, EngineConfig, ParallelConfig, SchedulerConfig
from disagg.engine.batch import Batch, ForwardOutput
from disagg.engine.llm_engine import EngineParts, LLMEngine, build_engine
from disagg.engine.request import SamplingParams
from disagg.errors import RankError
from disagg.model.layer_counter import LayerCounter
from disagg.model.loading.registry import load_model
from disagg.model.sharding import Sharding
from disagg.parallel.leader import start_leader
from tests.process_stat import parent_of
from transfer_core.poller import CounterPoller

pytestmark = pytest.mark.slow  # rank processes: each test starts torch two to four more times

PARAMS = SamplingParams(max_tokens=10, ignore_eos=True)


def prompts(vocab: int, seed: int = 0) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=generator).tolist() for n in (3, 11, 26)]


def engine_config(loaded: Any, tp: int, kv_layout: str, replicated: bool = False,  # noqa: ANN401
                  ) -> EngineConfig:
    return EngineConfig(loaded.config, CacheConfig(page_size=4, num_pages=96, kv_layout=kv_layout,
                                                   prefix_caching=False),
                        SchedulerConfig(chunk_size=8, max_num_batched_tokens=8),
                        ParallelConfig(tp, replicated))


def tokens(spec: str, tp: int, kv_layout: str, replicated: bool = False) -> list[list[int]]:
    loaded = load_model(spec)
    engine = build_engine(engine_config(loaded, tp, kv_layout, replicated), loaded.state_dict,
                          model_spec=spec)
    try:
        return [r.output_token_ids for r in engine.generate(prompts(loaded.config.vocab_size),
                                                            PARAMS)]
    finally:
        engine.close()


# Each layout meets GQA and MQA, TP 2 and TP 4 (heads split, and replicated when the ranks
# outnumber the KV heads): pairs, not the full product, since every case starts 2-4 ranks.
@pytest.mark.parametrize(("num_kv_heads", "tp", "kv_layout"),
                         [(2, 2, "NHD"), (2, 4, "HND"), (1, 2, "HND"), (1, 4, "NHD")],
                         ids=["gqa-tp2-NHD", "gqa-tp4-replicated-heads-HND", "mqa-tp2-HND",
                              "mqa-tp4-NHD"])
def test_random_checkpoints_match_one_process(make_hf_llama_checkpoint: Any, num_kv_heads: int,
                                              tp: int, kv_layout: str) -> None:
    """8 query heads over 2 (GQA) or 1 (MQA) KV heads: TP 2 and 4 give TP 1's tokens."""
    spec = str(make_hf_llama_checkpoint(num_heads=8, num_kv_heads=num_kv_heads))
    assert tokens(spec, tp, kv_layout) == tokens(spec, 1, kv_layout)


def test_replicated_kv_matches_one_process() -> None:
    """The MLA-style cache, every head on every rank, each rank attending with its own."""
    assert tokens("tiny", 4, "HND", replicated=True) == tokens("tiny", 1, "HND")


class SlotCheck:
    """Zeroes each step's new KV slots in every rank's shard before the forward (through the
    leader's mapping), then, at each counter bump, checks that every rank wrote them."""

    def __init__(self, engine_parts: EngineParts) -> None:
        self.cache = engine_parts.kv_cache
        self.num_layers = engine_parts.model.config.num_layers
        self.steps: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.checked = 0
        self.unwritten: list[tuple[int, int, int]] = []  # (step, layer, rank)
        self.zero_before = 0

    def on_batch(self, batch: Batch) -> None:
        pages, offsets = [], []
        for chunk in batch.chunks:
            for position in range(chunk.start, chunk.end):
                pages.append(chunk.request.page_ids[position // self.cache.page_size])
                offsets.append(position % self.cache.page_size)
        slots = torch.tensor(pages), torch.tensor(offsets)
        zeros = [torch.zeros(len(pages), s.num_kv_heads, s.head_dim) for s in self.cache.shards]
        for layer in range(self.num_layers):
            for shard, zero in zip(self.cache.shards, zeros, strict=True):
                shard.write(layer, zero, zero, *slots)
        self.zero_before += sum(not self._written(r, 0, slots)
                                for r in range(len(self.cache.shards)))
        self.steps.append(slots)

    def after_forward(self, batch: Batch, output: ForwardOutput) -> None:
        pass

    def _written(self, rank: int, layer: int, slots: tuple[torch.Tensor, torch.Tensor]) -> bool:
        k, v = self.cache.shards[rank].gather_batch(layer, slots[0][:, None])
        rows = slots[1]  # one page per row: token `offset` of it
        picked = k[torch.arange(len(rows)), :, rows], v[torch.arange(len(rows)), :, rows]
        return all(bool((p.abs().sum(-1) > 0).all()) for p in picked)

    def on_change(self, _index: int, old: int, new: int) -> None:
        for value in range(old + 1, new + 1):
            step, layer = (value - 1) // self.num_layers, (value - 1) % self.num_layers
            for rank in range(len(self.cache.shards)):
                if not self._written(rank, layer, self.steps[step]):
                    self.unwritten.append((step, layer, rank))
            self.checked += 1


def test_every_rank_wrote_its_kv_when_the_leader_bumps() -> None:
    """S3c: only the leader bumps, after the o_proj all-reduce; at every bump of 4 ranks over
    many steps, each rank's slots of that layer are already written."""
    loaded = load_model("tiny")
    config = engine_config(loaded, 4, "HND")
    counter = LayerCounter()
    leader = start_leader("tiny", loaded.config, loaded.state_dict, config.cache,
                          Sharding(4, loaded.config.num_kv_heads), layer_counter=counter)
    parts = EngineParts.build(config, leader)
    check = SlotCheck(parts)
    engine = LLMEngine(parts, observers=[check])
    poller = CounterPoller([counter.poll_target], check.on_change, name="s3c-check")
    poller.start()
    try:
        engine.generate(prompts(512) * 3, PARAMS)
    finally:
        poller.stop()
        engine.close()
    assert check.checked == engine.num_steps * loaded.config.num_layers > 60
    assert check.zero_before == 4 * engine.num_steps  # the check sees unwritten slots as such
    assert check.unwritten == []


def child_pids() -> set[int]:
    pids = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if parent_of(int(entry)) == os.getpid():
                    pids.add(int(entry))
            except OSError:
                continue
    return pids


def test_a_killed_rank_fails_the_leader_and_leaves_nothing() -> None:
    """SIGKILL rank 1: the leader hears it once (RankError), its next step fails with the same
    error, and stop leaves no process, fd or directory behind."""
    loaded = load_model("tiny")
    config = engine_config(loaded, 2, "NHD")
    fds_before, children_before = len(os.listdir("/proc/self/fd")), child_pids()
    failures: list[BaseException] = []
    failed = threading.Event()

    def on_failure(error: BaseException) -> None:
        failures.append(error)
        failed.set()

    leader = start_leader("tiny", loaded.config, loaded.state_dict, config.cache,
                          Sharding(2, loaded.config.num_kv_heads), on_failure=on_failure)
    assert leader.ranks is not None
    workdir = leader.ranks._workdir
    engine = LLMEngine(EngineParts.build(config, leader))
    engine.generate([[5, 6, 7]], PARAMS)  # it works before
    os.kill(leader.ranks.pids[0], signal.SIGKILL)
    assert failed.wait(10)
    assert "TP rank 1" in str(failures[0]) and "killed by signal 9" in str(failures[0])
    engine.add_request([8, 9, 10], PARAMS)
    with pytest.raises(RankError, match="killed by signal 9"):
        engine.step()
    engine.close()
    time.sleep(0.1)
    assert len(failures) == 1
    assert not os.path.exists(workdir)
    assert child_pids() == children_before
    assert len(os.listdir("/proc/self/fd")) <= fds_before


def test_a_rank_that_cannot_load_fails_the_start() -> None:
    """A rank that exits before sending its KV memory: start_leader raises, naming the rank
    and its exit code, and no rank is left running."""
    loaded = load_model("tiny")
    config = engine_config(loaded, 2, "NHD")
    children_before = child_pids()
    with pytest.raises(RankError, match="TP rank 1 .* before sending its KV memory: exit code 1"):
        start_leader("/no/such/checkpoint", loaded.config, loaded.state_dict, config.cache,
                     Sharding(2, loaded.config.num_kv_heads))
    assert child_pids() == children_before
