"""Processes around the messengers: the builder that wires a node once, prefill and decode
nodes, the router, `serve`, and a local cluster of real processes (S1, S2).
"""
