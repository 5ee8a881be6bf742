"""TP 2 as real rank processes gives TP 1's greedy tokens and KV (S3c, S5a): the one TP test of
the inner loop (a few seconds); `test_ranks.py` runs the wider matrix, marked slow."""

from __future__ import annotations

import torch

from disagg.engine.batch import Batch, ForwardOutput
from disagg.engine.llm_engine import EngineParts, LLMEngine, build_model
from disagg.engine.request import SamplingParams
from disagg.model.loading.registry import load_model
from tests.disagg.parallel.test_ranks import engine_config, prompts

PARAMS = SamplingParams(max_tokens=6, ignore_eos=True)


class PageRecorder:
    """The page ids of the one request, as of its last step (freed, not wiped, after it)."""

    def __init__(self) -> None:
        self.page_ids: list[int] = []

    def on_batch(self, batch: Batch) -> None:
        self.page_ids = list(batch.chunks[0].request.page_ids)

    def after_forward(self, batch: Batch, output: ForwardOutput) -> None:
        pass


def run(tp: int) -> tuple[list[int], list[tuple[torch.Tensor, torch.Tensor]]]:
    """Greedy tokens of one prompt at `tp`, and every layer's K/V of its tokens read back
    through the leader's view (at TP 2: rank 1's heads from its process's memory)."""
    loaded = load_model("tiny")
    config = engine_config(loaded, tp, "HND")
    recorder = PageRecorder()
    engine = LLMEngine(EngineParts.build(config, build_model(config, loaded.state_dict,
                                                             model_spec="tiny")),
                       observers=[recorder])
    try:
        prompt = prompts(loaded.config.vocab_size)[1]  # 11 tokens: two chunks of 8
        (output,) = engine.generate([prompt], PARAMS)
        num_tokens = len(prompt) + len(output.output_token_ids) - 1  # the last one never ran
        pages = torch.tensor(recorder.page_ids)
        kv = [tuple(t.clone() for t in engine.kv_cache.gather(layer, pages, num_tokens))
              for layer in range(engine.kv_cache.num_layers)]
        if tp > 1:  # the second rank's shard is really its own memory, and was written
            rank1 = engine.kv_cache.shards[1]
            assert rank1.buffer.data_ptr() != engine.kv_cache.shards[0].buffer.data_ptr()
            assert bool(rank1.buffer.abs().sum() > 0)
        return output.output_token_ids, kv  # type: ignore[return-value]
    finally:
        engine.close()


def test_two_rank_processes_give_one_process_tokens_and_kv() -> None:
    """Greedy tokens are equal; every layer's K and V, both ranks' heads, agree with TP 1's
    (to float rounding: the ranks' all-reduce adds in another order)."""
    tokens_tp2, kv_tp2 = run(2)
    tokens_tp1, kv_tp1 = run(1)
    assert tokens_tp2 == tokens_tp1
    for (k2, v2), (k1, v1) in zip(kv_tp2, kv_tp1, strict=True):
        assert k2.shape == k1.shape and k1.shape[0] == 4  # every KV head, both ranks' halves
        torch.testing.assert_close(k2, k1, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(v2, v1, rtol=1e-4, atol=1e-5)
