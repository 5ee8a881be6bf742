"""Speculative decoding (S8): verifying drafts, the proposers, the speculative step.
"""
