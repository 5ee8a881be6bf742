"""Step 10: the CUDA path - decode graphs with the counter inside, device KV on the fabric (S3b).

Runs on a GPU if there is one, else on the CPU, with the same code: on CPU the decode steps
take the static-buffer path eagerly (nothing to capture), and the KV goes through the staged
path because we ask for it (on a GPU without FI_HMEM, "auto" picks it by itself).
1. Greedy tokens of 6 requests with `cuda_graph=True` equal the default engine's.
2. A layer counter made for the device, watched by a `CounterPoller`, moves num_layers per step.
3. The prompt's KV pages go from the first engine's cache to a second cache through the chosen
   memory path: staged out, written by libfabric into the peer's shadow, staged in. Equal.
Pairs with docs/tutorials/10-the-cuda-path.md.
"""

from __future__ import annotations

import threading

import torch

from disagg.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from disagg.engine.llm_engine import EngineParts, LLMEngine
from disagg.engine.request import SamplingParams
from disagg.model.layer_counter import LayerCounter, NullLayerCounter
from disagg.model.transformer import Transformer
from transfer_core.engine import TransferEngine
from transfer_core.poller import CounterPoller
from transfer_core.staging import register_kv
from transfer_core.transport import PagedWrite

IMM = 10


def main() -> None:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    config = ModelConfig.from_name("small")
    model = Transformer(config)
    prompts = [torch.randint(1, config.vocab_size, (n,)).tolist() for n in (5, 17, 30, 9, 44, 2)]
    params = SamplingParams(max_tokens=12, ignore_eos=True)

    def engine(cuda_graph: bool) -> LLMEngine:
        return LLMEngine(EngineParts.build(EngineConfig(
            config, CacheConfig(page_size=4, num_pages=128), SchedulerConfig(max_num_seqs=8),
            device=device, cuda_graph=cuda_graph), model))

    # 1. The same requests, eager and through the decode graphs' static buffers.
    eager = [r.output_token_ids for r in engine(False).generate(prompts, params)]
    graphed_engine = engine(True)
    counter = LayerCounter.for_device(device)  # mapped pinned host memory on a GPU
    model.layer_counter = counter
    bumps = []
    with CounterPoller([counter.poll_target], lambda _, old, new: bumps.append(new - old)
                       ) as poller:
        graphed = [r.output_token_ids for r in graphed_engine.generate(prompts, params)]
        poller.wait_for(0, counter.read())
    model.layer_counter = NullLayerCounter()
    stats = graphed_engine.runner.graph_stats
    print(f"device {device}: tokens equal eager: {graphed == eager}")
    assert graphed == eager, "the static-buffer decode steps changed the tokens"
    print(f"steps: {stats['static']} static-buffer decode steps ({stats['replays']} graph "
          f"replays, {stats['captures']} captures), {stats['eager']} eager (prefill) steps")
    steps = stats["static"] + stats["eager"]
    print(f"2. counter: {sum(bumps)} bumps seen by the poller = {steps} steps x "
          f"{config.num_layers} layers: {sum(bumps) == steps * config.num_layers}")

    # 3. One request's KV to a second cache through the memory path for this device.
    cache = graphed_engine.kv_cache
    request = graphed_engine.add_request(prompts[4], SamplingParams(max_tokens=2))
    graphed_engine.step()  # its prefill; the request (and its pages) lives on for one more token
    pages = request.page_ids
    path = "auto" if device == "cuda" else "staged"  # CPU memory would go "host" by itself
    with TransferEngine("tcp") as sender, TransferEngine("tcp") as receiver:
        src = register_kv(sender, cache.buffer, "prefill-kv", path)
        dst = register_kv(receiver, torch.zeros_like(cache.buffer), "decode-kv", path)
        landed = threading.Event()
        receiver.expect_imm_count(IMM, len(pages) * config.num_layers, landed.set)
        for layer in range(config.num_layers):
            src.stage_out(layer, pages)  # the copy engine's job on a GPU; no-op unless staged
            sender.post_paged_writes(PagedWrite(
                src_mr=src.region, src_page_ids=pages, src_page_stride=cache.page_nbytes,
                src_offset=layer * cache.layer_nbytes, dst_mr=dst.descriptor, dst_page_ids=pages,
                dst_page_stride=cache.page_nbytes, dst_offset=layer * cache.layer_nbytes,
                nbytes=cache.page_nbytes, imm=IMM))
        if not landed.wait(30):
            raise TimeoutError(f"{receiver.imm_counted(IMM)} writes landed")
        dst.stage_in(pages)  # the receiving side's copy back into the cache
        same = torch.equal(dst.tensor[:, pages], cache.buffer[:, pages])
        print(f"3. memory path: {src.path.kind} ({src.path.reason})")
        print(f"   {len(pages)} pages x {config.num_layers} layers arrived equal: {same}; "
              f"staged {src.staged_bytes} bytes out, {dst.staged_bytes} in")
        assert same, "the pages that arrived differ from the ones sent"
        src.close(sender)
        dst.close(receiver)
    while graphed_engine.has_unfinished():
        graphed_engine.step()
    graphed_engine.allocator.check_invariants(expect_all_free=True)


if __name__ == "__main__":
    main()
