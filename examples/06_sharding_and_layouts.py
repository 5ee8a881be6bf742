"""Step 6: tensor-parallel KV sharding and what NHD vs HND costs on the wire (S6, S7).

Shows (1) which KV heads each rank holds, including replication when there are fewer heads
than ranks; (2) the transfer plan of one page between two shardings and its write count in
both layouts; (3) what a page and each write weigh in float32 and in bf16 (`--kv-dtype`);
(4) that the model run as TP rank processes (each holding its heads and its KV shard, which
this process maps) produces the same tokens as one process. Pairs with
docs/tutorials/06-sharding-and-layouts.md.
"""

from __future__ import annotations

import torch

from disagg.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig
from disagg.engine.llm_engine import build_engine
from disagg.engine.request import SamplingParams
from disagg.kv_transfer.transfer_plan import plan_page_writes
from disagg.model.kv_cache import PagedKVCache
from disagg.model.loading.registry import load_model
from disagg.model.page_geometry import PageGeometry
from disagg.model.sharding import Sharding


def show_heads() -> None:
    for sharding in (Sharding(4, 8), Sharding(8, 4), Sharding(2, 4, replicated=True)):
        heads = {rank: list(sharding.heads_of(rank)) for rank in range(sharding.tp)}
        print(f"tp={sharding.tp} kv_heads={sharding.num_kv_heads} "
              f"replicated={sharding.replicated}: {heads}")
        print(f"  replica sets: {sharding.replica_sets()}")


def show_plans() -> None:
    print("writes for one page of one layer (8 KV heads, 16-token pages, head_dim 128, bf16):")
    for src_tp, dst_tp in ((8, 8), (1, 8), (8, 1), (8, 4)):
        counts = []
        for layout in ("NHD", "HND"):
            geometry = PageGeometry(layout, page_size=16, head_dim=128, element_size=2)
            counts.append(len(plan_page_writes(Sharding(src_tp, 8), Sharding(dst_tp, 8),
                                               geometry)))
        print(f"  prefill TP {src_tp} -> decode TP {dst_tp}: NHD {counts[0]:4d}, "
              f"HND {counts[1]:3d}")
    first = plan_page_writes(Sharding(1, 8), Sharding(8, 8), PageGeometry("HND", 16, 128, 2))
    print(f"  HND, TP 1 -> 8, the first two writes: {first[:2]}")


def show_page_bytes() -> None:
    dtypes = (torch.float32, torch.bfloat16)
    print("bytes of one page of one layer, and of one write (8 KV heads, 16-token pages, "
          "head_dim 128):")
    print(f"  {'':32s}{'float32':>9s}{'bfloat16':>10s}")
    cases = (("one page, K and V of 8 heads", None, "HND"),
             ("TP 8 -> TP 8, one write", (8, 8), "HND"),
             ("TP 1 -> TP 8, NHD, one write", (1, 8), "NHD"),
             ("TP 1 -> TP 8, HND, one write", (1, 8), "HND"))
    for label, tps, layout in cases:
        sizes = []
        for dtype in dtypes:
            geometry = PageGeometry(layout, 16, 128, element_size=dtype.itemsize)
            sizes.append(geometry.page_nbytes(8) if tps is None else plan_page_writes(
                Sharding(tps[0], 8), Sharding(tps[1], 8), geometry)[0].nbytes)
        print(f"  {label:32s}{sizes[0]:9d}{sizes[1]:10d}")
    # The cache the engine allocates at --kv-dtype bfloat16: what every page write moves.
    tiny = [PagedKVCache(ModelConfig.from_name("tiny"), CacheConfig(page_size=4, num_pages=32,
                                                                    dtype=dtype))
            for dtype in dtypes]
    print(f"  {'the tiny model, a 4-token page':32s}{tiny[0].page_nbytes:9d}"
          f"{tiny[1].page_nbytes:10d}")


def show_sharded_decode() -> None:
    loaded = load_model("tiny")  # at TP > 1 every rank process loads it too, keeping its shard
    prompts = [[5, 6, 7, 8, 9, 10, 11], [42, 43]]
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    outputs = {}
    for tp in (1, 2, 4):
        engine = build_engine(EngineConfig(loaded.config, CacheConfig(page_size=4, num_pages=32,
                                                                      kv_layout="HND"),
                                           parallel=ParallelConfig(tp=tp)),
                              loaded.state_dict, model_spec="tiny")
        shard_shapes = [tuple(s.buffer.shape) for s in engine.kv_cache.shards]
        outputs[tp] = [r.output_token_ids for r in engine.generate(prompts, params)]
        ranks = engine.runner.ranks
        pids = [] if ranks is None else ranks.pids
        engine.close()  # ends the rank processes
        print(f"tp={tp}: {len(shard_shapes)} region(s) of shape {shard_shapes[0]}, "
              f"{len(pids)} rank process(es) besides this one")
    assert outputs[1] == outputs[2] == outputs[4]
    print(f"same tokens at TP 1, 2 and 4: {outputs[1][0]}")


def main() -> None:
    show_heads()
    show_plans()
    show_page_bytes()
    show_sharded_decode()


if __name__ == "__main__":
    main()
