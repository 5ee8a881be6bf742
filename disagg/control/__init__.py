"""The control plane (S2): framed, authenticated messages between front doors, routers and nodes.

`framing` (the codec), `messages` (router/node messages), `channel` (one connection),
`secret`, `address`, `liveness` (heartbeats and silence) and `backoff` (reconnection waits).
It imports nothing of `disagg.kv_transfer`: the messengers add their own messages on top.
"""
