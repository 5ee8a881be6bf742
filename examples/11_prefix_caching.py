"""Step 11: prefix caching across the split (X2): a conversation whose turns move only their
new pages.

Starts a prefiller and a decoder of the `tiny` model as real processes over libfabric (tcp on
loopback), twice: with the prefix cache (the default) and with `prefix_caching=False`. Each
time it plays the same three-turn conversation, every turn's prompt being the last prompt, its
answer and five new tokens, and prints per turn the prompt length, the tokens the decoder found
in its cache, and the writes and bytes of KV the turn moved. The answers must not change.
Pairs with docs/tutorials/11-prefix-caching.md. Runs on a CPU in a few seconds.
"""

from __future__ import annotations

from dataclasses import dataclass

from disagg.control.messages import Submit
from disagg.node.cluster_config import ClusterConfig
from disagg.node.local_cluster import LocalCluster
from disagg.node.router import Router

FIRST_PROMPT = list(range(100, 140))  # 40 token ids: the tiny preset has no tokenizer
NEW_TOKENS = [[7, 8, 9, 10, 11], [12, 13, 14, 15, 16], [17, 18, 19, 20, 21]]


@dataclass
class Turn:
    prompt_tokens: int
    cached_tokens: int = 0
    kv_writes: int = 0
    kv_bytes: int = 0
    answer: tuple[int, ...] = ()


def serve(router: Router, request_id: str, prompt: list[int]) -> Turn:
    """One request to its end: what the decoder's events said about it."""
    router.route(Submit(request_id, prompt, max_tokens=8))
    turn, answer = Turn(len(prompt)), []
    while True:
        event = router.events.get(timeout=60)
        turn.cached_tokens = max(turn.cached_tokens, event.num_cached_tokens)
        if event.kv_writes:  # the counter fired: what the transfer took
            turn.kv_writes, turn.kv_bytes = event.kv_writes, event.kv_bytes
        answer += event.token_ids
        if event.state.is_terminal():
            turn.answer = tuple(answer)
            return turn


def conversation(prefix_caching: bool) -> list[Turn]:
    config = ClusterConfig.from_options(model="tiny", num_decoders=1, page_size=16, num_pages=64,
                                        chunk_size=16, prefix_caching=prefix_caching)
    turns, prompt = [], FIRST_PROMPT
    with LocalCluster(config) as cluster:
        router = Router(cluster.decoder_addresses, config.router_config())
        for index, new in enumerate(NEW_TOKENS):
            turn = serve(router, f"turn-{index + 1}", prompt)
            turns.append(turn)
            prompt = prompt + list(turn.answer) + new
        router.close()
    return turns


def main() -> None:
    runs = {"with the cache": conversation(True), "without": conversation(False)}
    for name, turns in runs.items():
        print(name)
        for index, t in enumerate(turns):
            print(f"  turn {index + 1}: {t.prompt_tokens} prompt tokens, {t.cached_tokens} "
                  f"cached, {t.kv_writes} KV writes, {t.kv_bytes} bytes moved")
    cached, cold = runs.values()
    assert [t.answer for t in cached] == [t.answer for t in cold], "the cache changed an answer"
    assert all(t.cached_tokens > 0 for t in cached[1:]), "a later turn found nothing cached"
    assert all(a.kv_bytes < b.kv_bytes for a, b in zip(cached[1:], cold[1:], strict=True))
    print("same answers; later turns moved only their new pages")


if __name__ == "__main__":
    main()
