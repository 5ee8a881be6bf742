"""Processes around the messengers: a node's `NodeConfig`, the builder that wires a node once,
prefill and decode nodes, the router, `serve`, and a local cluster of real processes (S1, S2).
"""
