"""A child for the fork server's tests (X5f): one command on stdin. "exit N" exits with N;
"nest" asks the server that forked it for a child of its own (which exits with 7) and prints
"grandchild PID CODE". Light, so the tests' servers preload no model code."""

from __future__ import annotations

import sys

from disagg.utils.forked_process import inherited_server


def main() -> None:
    command = sys.stdin.readline().split()
    if command[0] == "exit":
        raise SystemExit(int(command[1]))
    forks = inherited_server()
    assert forks is not None, "forked, so it has a server"
    grandchild = forks.start(__name__)
    assert grandchild.stdin is not None
    grandchild.stdin.write("exit 7\n")
    grandchild.stdin.close()
    print(f"grandchild {grandchild.pid} {grandchild.wait(timeout=30)}", flush=True)
