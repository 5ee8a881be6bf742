"""The MTP head drafts across the split what it drafts on one node (S4a, S8).

A decoder's MTP head starts from the hidden state the prefiller shipped in the context slot
(the last prefilled position's) and the head's KV the prefiller wrote. The tiny model's random
head accepts nothing, so tokens and acceptance counts cannot tell whether that state arrived;
the drafts themselves can. Here every draft the decoder's proposer chooses is recorded with
the draft logits it was chosen from, and compared with those of one speculating node (no
prefiller) on the same prompt, greedy: the same tokens, logits equal to float rounding (1e-7
here). A decoder that lost the shipped hidden state (zeros in its place) drafts from logits
3e-3 to 3e-2 away; the random head's argmax often hides that, so the logits are compared too.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator

import pytest
import torch

from disagg.config import CacheConfig, EngineConfig, SchedulerConfig, SpeculativeConfig
from disagg.control.messages import Submit
from disagg.engine.request import Request, SamplingParams
from disagg.model.loading.registry import load_model
from disagg.node.builder import build_node
from disagg.node.decode_node import DecodeNode
from disagg.node.node_config import NodeConfig, NodeRole
from disagg.node.prefill_node import PrefillNode
from disagg.node.router import Router
from tests.disagg.node.running_nodes import running
from disagg.speculative.proposers import Choose
from disagg.speculative.speculator import Speculator, build_speculative_engine

pytestmark = pytest.mark.fabric

CACHE = CacheConfig(page_size=4, num_pages=128)
MTP = SpeculativeConfig("mtp", 3, draft_layers=1)
MAX_TOKENS = 8
PROMPT_LENGTHS = [2, 7, 22]  # prefilled in 1, 2 and 5 chunks of at most 5 tokens
LOGITS_ATOL = 1e-5
Draft = tuple[int, torch.Tensor]  # a draft token, and the draft logits it was chosen from
Drafts = dict[tuple[int, ...], list[Draft]]  # prompt -> every draft, in order


def prompts() -> list[list[int]]:
    generator = torch.Generator().manual_seed(11)
    return [torch.randint(3, 512, (n,), generator=generator).tolist() for n in PROMPT_LENGTHS]


def record_drafts(speculator: Speculator | None) -> Drafts:
    """Route `speculator`'s proposer through a recorder of every draft it chooses, per prompt."""
    assert speculator is not None, "a speculating engine finishes its steps with a Speculator"
    drafts: Drafts = defaultdict(list)
    propose = speculator.proposer.propose

    def recording(requests: list[Request], num_drafts: list[int], choose: Choose
                  ) -> list[list[int]]:
        def chosen(i: int, logits: torch.Tensor) -> int:
            token = choose(i, logits)
            drafts[tuple(requests[i].prompt_token_ids)].append((token, logits.clone()))
            return token
        return propose(requests, num_drafts, chosen)

    speculator.proposer.propose = recording  # type: ignore[method-assign]
    return drafts


def single_node_drafts() -> Drafts:
    """The reference: one speculating engine prefills and decodes each prompt itself."""
    loaded = load_model("tiny")
    config = EngineConfig(loaded.config, CACHE, SchedulerConfig(chunk_size=5,
                                                                max_num_batched_tokens=16))
    engine = build_speculative_engine(config, loaded.state_dict, MTP)
    drafts = record_drafts(engine.finisher)  # type: ignore[arg-type]
    for prompt in prompts():
        engine.generate([prompt], SamplingParams(max_tokens=MAX_TOKENS))
    return drafts


@pytest.fixture
def split() -> Iterator[tuple[Router, DecodeNode]]:
    """A prefiller and an MTP-drafting decoder in threads (tcp), and a router to the decoder."""
    prefill = build_node(NodeConfig("tiny", CACHE, SchedulerConfig(
        chunk_size=5, max_num_batched_tokens=5, mode="prefill_only"), role=NodeRole.PREFILL))
    assert isinstance(prefill, PrefillNode)
    decode = build_node(NodeConfig("tiny", CACHE, SchedulerConfig(
        chunk_size=5, max_num_batched_tokens=16), role=NodeRole.DECODE,
        prefillers=(prefill.address,), speculative=MTP))
    assert isinstance(decode, DecodeNode)
    with running(prefill, decode) as router:
        yield router, decode


def test_mtp_drafts_across_the_split_are_the_single_node_drafts(
        split: tuple[Router, DecodeNode]) -> None:
    """Prompts of 2, 7 and 22 tokens, each served alone: every draft of the decoder's MTP head
    (whose first catch-up runs from the shipped hidden state) is the single node's, the same
    token from the same draft logits."""
    router, decode = split
    drafts = record_drafts(decode.engine.finisher)  # type: ignore[arg-type]
    for i, prompt in enumerate(prompts()):
        router.route(Submit(f"r{i}", prompt, MAX_TOKENS))
        while not router.events.get(timeout=30).state.is_terminal():
            pass
    reference = single_node_drafts()
    for prompt in prompts():
        ours, theirs = drafts[tuple(prompt)], reference[tuple(prompt)]
        assert theirs, "the single node proposed no draft"
        assert [t for t, _ in ours] == [t for t, _ in theirs], f"{len(prompt)}-token prompt"
        for n, ((_, got), (_, want)) in enumerate(zip(ours, theirs, strict=True)):
            error = (got - want).abs().max().item()
            assert error <= LOGITS_ATOL, (
                f"{len(prompt)}-token prompt, draft {n}: logits {error:.1e} from the single "
                "node's")
