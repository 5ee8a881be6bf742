"""A prefiller never samples a token (S8).

It prefills every prompt token but the last and ships KV and the last position's hidden state;
the first token is sampled on the decoder, by an ordinary decode step of the last prompt token.
Here the sampling function is counted per node thread, wherever a `disagg` module imported it,
over a whole disaggregated request on real nodes (threads, tcp): the prefiller's thread never
calls it, the decoder's once per output token. Nor does the prefiller run the LM head: no
logits are computed on its thread.
"""

from __future__ import annotations

import sys
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from disagg.config import CacheConfig, SchedulerConfig
from disagg.control.messages import Submit
from disagg.engine import sampling
from disagg.engine.request import RequestState
from disagg.model.transformer import Transformer
from disagg.node.builder import build_node
from disagg.node.decode_node import DecodeNode
from disagg.node.node_config import NodeConfig, NodeRole
from disagg.node.prefill_node import PrefillNode
from tests.disagg.node.running_nodes import running

pytestmark = pytest.mark.fabric

CACHE = CacheConfig(page_size=4, num_pages=64)
MAX_TOKENS = 4


def counted_by_thread(original: Callable[..., Any]) -> tuple[Callable[..., Any], Counter[str]]:
    """`original` wrapped to count its calls per thread name, and the counter."""
    calls: Counter[str] = Counter()

    def counted(*args: Any, **kwargs: Any) -> Any:  # noqa: ANN401
        calls[threading.current_thread().name] += 1
        return original(*args, **kwargs)

    return counted, calls


def count_sampling_by_thread(monkeypatch: pytest.MonkeyPatch) -> Counter[str]:
    """Route `sampling.sample_token`, in every loaded `disagg` module holding it, through a
    counter of calls per thread name."""
    original = sampling.sample_token
    counted, calls = counted_by_thread(original)
    holders = [module for name, module in list(sys.modules.items())
               if name.startswith("disagg") and getattr(module, "sample_token", None)
               is original]
    assert sampling in holders
    for module in holders:
        monkeypatch.setattr(module, "sample_token", counted)
    return calls


@pytest.fixture
def serve() -> Iterator[Callable[[list[int]], RequestState]]:
    """A prefiller (thread "prefill-node") and a decoder (thread "decode-node"), and a function
    that serves one prompt through a router and returns its final state."""
    prefill = build_node(NodeConfig("tiny", CACHE, SchedulerConfig(
        chunk_size=5, max_num_batched_tokens=5, mode="prefill_only"), role=NodeRole.PREFILL))
    assert isinstance(prefill, PrefillNode)
    decode = build_node(NodeConfig("tiny", CACHE, SchedulerConfig(
        chunk_size=8, max_num_batched_tokens=8), role=NodeRole.DECODE,
        prefillers=(prefill.address,)))
    assert isinstance(decode, DecodeNode)
    with running(prefill, decode) as router:

        def one(prompt: list[int]) -> RequestState:
            router.route(Submit("r0", prompt, MAX_TOKENS))
            while not (event := router.events.get(timeout=30)).state.is_terminal():
                pass
            return event.state

        yield one


def test_the_prefiller_never_samples_and_the_decoder_samples_each_token(
        serve: Callable[[list[int]], RequestState], monkeypatch: pytest.MonkeyPatch) -> None:
    """A 12-token prompt prefilled in 3 chunks, 4 tokens out: no sampling call on the
    prefiller's thread, 4 on the decoder's (the first from the last prompt token's step)."""
    calls = count_sampling_by_thread(monkeypatch)
    assert serve(list(range(3, 15))) is RequestState.FINISHED_LENGTH
    assert calls == Counter({"decode-node": MAX_TOKENS}), f"sampling calls: {dict(calls)}"


def test_the_prefiller_computes_no_logits(serve: Callable[[list[int]], RequestState],
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Its forwards skip the LM head (nothing would read the logits): the prefiller's thread
    never calls `compute_logits`, the decoder's once per decode step."""
    counted, calls = counted_by_thread(Transformer.compute_logits)
    monkeypatch.setattr(Transformer, "compute_logits", counted)
    assert serve(list(range(3, 15))) is RequestState.FINISHED_LENGTH
    assert calls == Counter({"decode-node": MAX_TOKENS}), f"compute_logits calls: {dict(calls)}"
