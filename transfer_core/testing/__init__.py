"""Test doubles of the transfer engine: the in-process loopback engine and its fabric (S5).

Production code never imports this package (`tests/test_import_direction.py`); fault
injection, which a node may run with (`--faults`), is `transfer_core/faults.py`.
"""
