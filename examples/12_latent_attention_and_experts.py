"""Step 12: MLA's one-row cache, why tensor parallelism replicates it, and the MoE block (S9a).

What a token caches per layer (MLA vs GQA); a decode step (absorbed) equal to a prefill of the
same tokens (up-projected); two TP rank processes' bit-identical latent rows; a TP 2 prefiller
moving the bytes the latent row predicts (processes over tcp); the experts tokens pick. Pairs
with docs/tutorials/12-latent-attention-and-experts.md.
"""

from __future__ import annotations

import random

import torch

from disagg import CacheConfig, EngineConfig, ParallelConfig, SamplingParams, build_engine
from disagg.control.messages import Submit
from disagg.kv_transfer.context_slot import context_slot_nbytes
from disagg.kv_transfer.transfer_plan import expected_write_count, num_pages, plan_request
from disagg.model.attention import AttentionMetadata, SequenceSlice
from disagg.model.kv_cache import PagedKVCache
from disagg.model.loading.registry import init_random_weights
from disagg.model.page_geometry import PageGeometry
from disagg.model.sharding import Sharding
from disagg.model.transformer import Transformer
from disagg.model_catalog import PUBLISHED
from disagg.model_config import ModelConfig
from disagg.node.cluster_config import ClusterConfig
from disagg.node.local_cluster import LocalCluster
from disagg.node.router import Router

MLA, GQA = ModelConfig.from_name("tiny-mla-moe"), ModelConfig.from_name("tiny-qwen3-moe")
CACHE = CacheConfig(page_size=16, num_pages=8, kv_layout="HND")
PAGES = torch.tensor([3, 5])  # the one request's pages
PROMPT = list(range(100, 120))  # 20 token ids: the tiny presets have no tokenizer


def forward(model: Transformer, cache: PagedKVCache, ids: list[int], start: int) -> torch.Tensor:
    """The final hidden states of token `ids`, at positions `start`, ... of the one request."""
    positions = torch.arange(start, start + len(ids))
    meta = AttentionMetadata(PAGES[positions // 16], positions % 16,
                             [SequenceSlice(0, len(ids), start, PAGES)])
    with torch.no_grad():
        return model(torch.tensor(ids), positions, cache, meta)


def show_cache() -> None:
    for config in (MLA, GQA, PUBLISHED["deepseek-r1"], PUBLISHED["qwen3-coder-480b"]):
        print(f"{config.name}: {config.kv_values_per_token_layer} values per token and layer, "
              f"cache {PagedKVCache.buffer_shape(config, CACHE)} for 8 pages")


def show_two_forms(model: Transformer) -> None:
    cache = PagedKVCache(MLA, CACHE)
    forward(model, cache, PROMPT, 0)
    stepped = forward(model, cache, [7], len(PROMPT))[0]  # one query row: absorbed
    one_pass = forward(model, PagedKVCache(MLA, CACHE), [*PROMPT, 7], 0)[-1]  # up-projected
    torch.testing.assert_close(stepped, one_pass, atol=1e-5, rtol=0)
    print(f"decode step vs one prefill: largest difference {(stepped - one_pass).abs().max():.1e}")


def show_replicated_ranks() -> None:
    engine = build_engine(EngineConfig(MLA, CACHE, parallel=ParallelConfig(tp=2)),
                          init_random_weights(MLA), model_spec="tiny-mla-moe")
    engine.generate([PROMPT], SamplingParams(max_tokens=4, ignore_eos=True))
    shards = [s.buffer for s in engine.kv_cache.shards]  # each rank process's own memory
    engine.close()  # ends the rank process
    assert shards[0].abs().sum() > 0 and torch.equal(shards[0], shards[1])
    print(f"TP 2, {engine.kv_cache.sharding}: the ranks' caches are bit-identical, every layer")


def show_wire() -> None:
    # deepseek-r1's deployment, smaller: TP 2 (not 4) and one DP decoder (not 3), to start fast.
    config = ClusterConfig.from_options(model="tiny-mla-moe", prefill_tp=2, num_decoders=1,
                                        kv_layout="HND", page_size=CACHE.page_size, num_pages=64)
    plan = plan_request(Sharding.of_model(MLA, 2), Sharding.of_model(MLA, 1),
                        PageGeometry.of(PagedKVCache(MLA, CACHE)), random.Random(0))
    with LocalCluster(config) as cluster:
        router = Router(cluster.decoder_addresses, config.router_config())
        # Prompts with no page in common, so the prefix cache holds nothing back (tutorial 11).
        for index, (first, length) in enumerate(((10, 17), (100, 28), (300, 46))):
            router.route(Submit(f"req-{index}", list(range(first, first + length)), max_tokens=4))
            moved = (0, 0)
            while not (event := router.events.get(timeout=60)).state.is_terminal():
                if event.kv_writes:
                    moved = event.kv_writes, event.kv_bytes
            # Every prefilled page (all but the last token) of every layer, then the context.
            pages = num_pages(length - 1, CACHE.page_size) * MLA.num_layers
            expected = (expected_write_count(length, CACHE.page_size, MLA.num_layers, len(plan)),
                        pages * sum(w.nbytes for w in plan) + context_slot_nbytes(MLA))
            assert moved == expected, (moved, expected)
            print(f"{length} prompt tokens: {moved[0]} writes, {moved[1]} bytes, as predicted")
        router.close()


def show_routing(deepseek: Transformer) -> None:
    qwen = Transformer(GQA).eval()
    qwen.load_weights(init_random_weights(GQA))
    for name, model, block in (("sigmoid_grouped", deepseek, deepseek.layers[1].mlp),  # 0: dense
                               ("softmax", qwen, qwen.layers[0].mlp)):
        seen = {}  # the block's input: the hidden states it routes
        hook = block.register_forward_pre_hook(lambda _m, args, seen=seen: seen.update(x=args[0]))
        forward(model, PagedKVCache(model.config, CACHE), PROMPT, 0)
        hook.remove()
        weights, experts = block.gate(seen["x"][:4])
        print(f"{name}: experts {experts.tolist()}, weights sum to "
              f"{[round(s, 3) for s in weights.sum(dim=-1).tolist()]}")


def main() -> None:
    model = Transformer(MLA).eval()
    model.load_weights(init_random_weights(MLA))  # what load_model("tiny-mla-moe") loads
    show_cache()
    show_two_forms(model)
    show_replicated_ranks()
    show_wire()
    show_routing(model)


if __name__ == "__main__":
    main()
