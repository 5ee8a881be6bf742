"""Example 7: speculative decoding, and the last-token handoff that feeds it (S4a, S8).

Run: `python examples/07_speculative.py` (CPU, a few seconds). On the random `tiny` model:
1. greedy speculation yields the non-speculative tokens with fewer target forwards;
2. one speculative step up close: drafts, one verify forward, accepted tokens, rollback;
3. what a prefiller ships for an MTP head, and the writes a decoder therefore expects;
4. rejection sampling keeps the target's distribution, whatever the draft's.
"""

from __future__ import annotations

import torch

from disagg.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, SpeculativeConfig
from disagg.engine.llm_engine import LLMEngine, build_engine
from disagg.engine.request import SamplingParams
from disagg.kv_transfer.draft_kv import draft_kv_pages
from disagg.kv_transfer.transfer_plan import expected_write_count
from disagg.model.loading.registry import init_random_weights
from disagg.speculative.speculator import build_speculative_engine
from disagg.speculative.verify import verify_sampled

CONFIG = ModelConfig.from_name("tiny")
WEIGHTS = init_random_weights(CONFIG, seed=0)
PROMPT = [17, 254, 93, 402, 77, 5, 311, 128, 64]


def make_engine(spec: SpeculativeConfig | None = None) -> LLMEngine:
    config = EngineConfig(CONFIG, CacheConfig(page_size=4, num_pages=64),
                          SchedulerConfig(chunk_size=16))
    if spec is None:
        return build_engine(config, WEIGHTS)
    return build_speculative_engine(config, WEIGHTS, spec)


def same_tokens_fewer_forwards() -> None:
    print("1. greedy, 24 tokens: forwards and tokens")
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    reference = make_engine()
    expected = reference.generate([PROMPT], params)[0].output_token_ids
    print(f"   no speculation      : {reference.num_steps} forwards")
    for kind in ("early-exit", "mtp"):
        engine = make_engine(SpeculativeConfig(kind, num_draft_tokens=3, draft_layers=1))
        request = engine.generate([PROMPT], params)[0]
        rate = request.num_accepted_tokens / request.num_draft_tokens
        print(f"   {kind:<10} k=3      : {engine.num_steps} forwards, {rate:.0%} of drafts "
              f"accepted, same tokens: {request.output_token_ids == expected}")


def one_step_up_close() -> None:
    print("2. speculative steps up close (early exit after 1 of 2 layers, k=4)")
    engine = make_engine(SpeculativeConfig("early-exit", num_draft_tokens=4, draft_layers=1))
    request = engine.add_request(PROMPT, SamplingParams(max_tokens=24, ignore_eos=True))
    engine.step()  # prefill: the first token, then 4 drafts for the next step
    for _ in range(3):
        drafts, before = list(request.spec_token_ids), len(request.output_token_ids)
        print(f"   computed {request.num_computed_tokens} of {request.num_tokens} tokens, "
              f"drafts {drafts}, pages {request.page_ids}")
        engine.step()  # one forward over the last token and the drafts verifies them
        new = request.output_token_ids[before:]
        print(f"   -> one forward of {1 + len(drafts)} tokens appends {new}: "
              f"{len(new) - 1} drafts accepted, {len(drafts) - len(new) + 1} rolled back")
        engine.allocator.check_invariants()


def handoff_write_counts() -> None:
    print("3. a 35-token prompt, 16-token pages, 30 layers (SmolLM2's shape)")
    plain = expected_write_count(35, page_size=16, num_layers=30)
    extra = draft_kv_pages(35, page_size=16)
    print(f"   prefill covers tokens 0..33: {plain - 1} page writes + 1 context write = {plain}")
    print(f"   with an MTP head: + {extra} pages of the head's K/V (positions 0..32) "
          f"= {plain + extra} writes counted by the decoder")
    print("   the head's position 33 runs on the decoder, from the shipped hidden state")


def rejection_sampling_keeps_the_target() -> None:
    print("4. rejection sampling, 3000 chunks: first token frequencies")
    generator = torch.Generator().manual_seed(0)
    p = torch.tensor([[0.5, 0.3, 0.2, 0.0], [0.1, 0.1, 0.4, 0.4]])  # the target, 2 positions
    q = torch.tensor([[0.1, 0.1, 0.4, 0.4]])  # a poor draft
    counts = torch.zeros(4)
    for _ in range(3000):
        draft = int(torch.multinomial(q[0], 1, generator=generator))
        counts[verify_sampled([draft], q, p, generator)[0]] += 1
    show = lambda values: " ".join(f"{v:.2f}" for v in values)  # noqa: E731
    print(f"   target {show(p[0])} | draft {show(q[0])} | observed {show(counts / 3000)}")


def main() -> None:
    same_tokens_fewer_forwards()
    one_step_up_close()
    handoff_write_counts()
    rejection_sampling_keeps_the_target()


if __name__ == "__main__":
    main()
