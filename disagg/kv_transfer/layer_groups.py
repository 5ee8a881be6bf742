"""Which layers of a forward post their writes, and which ride with a later layer's (X9a).

S3 sends a layer's pages as soon as the layer is done, so that the wire works while the model
computes. That pays when a layer's KV takes the wire a while; for a short prompt it does not: a
SmolLM2 layer of 6 tokens is 9 KiB, microseconds of wire, while posting it costs the prefiller
a fixed few hundred microseconds of CPU (the poller's Python, the submission, the completion's
callback), taken from the forward on a host whose cores it shares. So layers are posted in
groups: a group closes at the first layer at which its layers together carry `min_bytes`,
and always at the last layer, so that nothing is left to post when the forward ends. A layer
that carries `min_bytes` alone is a group of its own (S3 as written), as is every layer when
`min_bytes` is 0. What a group leaves for the tail is at most `min_bytes` more on the wire.
"""

from __future__ import annotations


def layer_groups(layer_bytes: int, num_layers: int, min_bytes: int) -> tuple[range, ...]:
    """Consecutive ranges of layers covering `0..num_layers - 1`, each posted when its last
    layer is done: every range but the last carries at least `min_bytes`, at `layer_bytes`
    per layer, and no range is longer than it needs to be.

    >>> layer_groups(layer_bytes=9_216, num_layers=30, min_bytes=256 * 1024)
    (range(0, 29), range(29, 30))
    >>> layer_groups(layer_bytes=600_000, num_layers=3, min_bytes=256 * 1024)
    (range(0, 1), range(1, 2), range(2, 3))
    """
    if num_layers < 1 or layer_bytes < 0 or min_bytes < 0:
        raise ValueError(f"need num_layers >= 1 and bytes >= 0: {num_layers} layers, "
                         f"{layer_bytes} bytes each, {min_bytes} at least")
    if layer_bytes == 0:  # nothing to send: one post at the end, of nothing
        return (range(num_layers),)
    per_group = max(1, -(-min_bytes // layer_bytes))
    return tuple(range(start, min(start + per_group, num_layers))
                 for start in range(0, num_layers, per_group))
