"""Leaf utilities every layer may use: Chrome traces, merging them, node metrics, optional
dependencies.
"""
