"""Step 4: layer-by-layer streaming with a layer counter and a poller thread (S3, S3b).

An 8-layer model prefills a 512-token prompt in one forward. After each layer's attention the
model bumps a counter (no Python callback: this is what a captured CUDA graph can do). A
`CounterPoller` thread sees each bump and posts that layer's 32 page writes to a second
transfer engine at once, while the forward moves on. We print, per layer, when attention
finished, when the poller saw it, and when its writes completed, against the forward's end.
Pairs with docs/tutorials/04-layer-streaming.md.
"""

from __future__ import annotations

import threading
import time
from dataclasses import replace

import torch

from disagg.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from disagg.engine.llm_engine import EngineParts, LLMEngine
from disagg.engine.request import SamplingParams
from disagg.model.layer_counter import LayerCounter
from disagg.model.transformer import Transformer
from transfer_core.engine import TransferEngine
from transfer_core.poller import CounterPoller
from transfer_core.transport import PagedWrite

IMM = 7


def main() -> None:
    torch.manual_seed(0)
    config = replace(ModelConfig.from_name("small"), num_layers=8, name="small-8")
    # The model bumps this counter after each layer's attention; a poller watches it (S3b).
    counter = LayerCounter()
    engine = LLMEngine(EngineParts.build(
        EngineConfig(config, CacheConfig(page_size=16, num_pages=64),
                     SchedulerConfig(chunk_size=512, max_num_batched_tokens=512,
                                     mode="prefill_only")), Transformer(config, counter)))
    cache = engine.kv_cache
    request = engine.add_request(torch.randint(3, config.vocab_size, (512,)).tolist(),
                                 SamplingParams(max_tokens=1))

    # Two transfer engines over tcp on loopback: this process is prefiller and decoder.
    sender, receiver = TransferEngine("tcp"), TransferEngine("tcp")
    src, _ = sender.register_memory(cache.buffer, name="prefill-kv")
    remote = torch.zeros_like(cache.buffer)  # the decoder's cache, same geometry
    _, remote_descriptor = receiver.register_memory(remote, name="decode-kv")
    all_landed, landed = threading.Event(), []
    # 32 pages x 8 layers writes, each carrying IMM: the decoder's "KV is here" (S4c).
    num_writes = 32 * config.num_layers
    receiver.expect_imm_count(IMM, num_writes, lambda: (landed.append(time.perf_counter()),
                                                         all_landed.set()))

    # The ground truth, for display only: when each layer's attention returned.
    attention_done: dict[int, float] = {}
    for i, layer in enumerate(engine.model.layers):
        layer.self_attn.register_forward_hook(
            lambda *_, i=i: attention_done.__setitem__(i, time.perf_counter()))

    seen: dict[int, float] = {}
    written: dict[int, float] = {}

    def on_counter(index: int, old: int, new: int) -> None:
        """Poller thread: each bump between `old` and `new` is one finished layer."""
        for value in range(old + 1, new + 1):
            _, layer = LayerCounter.decode(value, config.num_layers)
            seen[layer] = time.perf_counter()
            write = PagedWrite(
                src_mr=src, src_page_ids=request.page_ids, src_page_stride=cache.page_nbytes,
                src_offset=layer * cache.layer_nbytes, dst_mr=remote_descriptor,
                dst_page_ids=request.page_ids, dst_page_stride=cache.page_nbytes,
                dst_offset=layer * cache.layer_nbytes, nbytes=cache.page_nbytes, imm=IMM)
            sender.post_paged_writes(
                write, on_done=lambda layer=layer: written.__setitem__(layer, time.perf_counter()))

    with CounterPoller([counter.value], on_counter, name="layer-poller"):
        start = time.perf_counter()
        engine.step()  # the whole prefill: one forward of 512 tokens
        forward_end = time.perf_counter()
        if not all_landed.wait(timeout=30):
            raise TimeoutError(f"{receiver.imm_counted(IMM)} of {num_writes} writes landed")

    def ms(t: float) -> str:
        return f"{(t - start) * 1e3:7.1f}"

    print("layer  attention done  poller saw (lag)  32 writes done   (ms from forward start)")
    for layer in range(config.num_layers):
        lag_us = (seen[layer] - attention_done[layer]) * 1e6
        print(f"{layer:>5}  {ms(attention_done[layer]):>14}  {ms(seen[layer])} "
              f"({lag_us:4.0f} µs)  {ms(written[layer]):>15}")
    print(f"forward ended at {ms(forward_end).strip()} ms; the decoder's counter reached "
          f"{num_writes} at {ms(landed[0]).strip()} ms")
    pages = torch.tensor(request.page_ids)
    same = torch.equal(remote[:, pages], cache.buffer[:, pages])
    print(f"decoder's copy of the request's pages equals the prefiller's: {same}")
    assert same, "the pages that arrived differ from the prefiller's"
    sender.close()
    receiver.close()


if __name__ == "__main__":
    main()
