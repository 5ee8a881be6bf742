"""Test doubles of the transfer engine: fault injection, and an in-process loopback engine.
"""
