"""How a node process leaves after a clean shutdown (S2): its exit handlers run and its exit
code stands, but the interpreter does not tear torch's modules down (seconds on a loaded
host, long enough for a parent's grace period to end in a SIGTERM). A real child process."""

from __future__ import annotations

import subprocess
import sys

CHILD = """
import atexit, sys
from disagg.node.serve import exit_without_teardown

class TornDown:
    def __del__(self):
        sys.stdout.write("torn down\\n")

kept = TornDown()  # a module global: only the interpreter's teardown would drop it
atexit.register(lambda: sys.stdout.write("exit handler ran\\n"))
sys.stdout.write("buffered, not flushed")
exit_without_teardown(int(sys.argv[1]))
"""


def run_child(code: int) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", CHILD, str(code)], capture_output=True,
                          text=True, timeout=120, check=False)


def test_the_exit_code_stands_and_the_exit_handlers_run() -> None:
    done = run_child(3)
    assert done.returncode == 3, done.stderr
    assert "exit handler ran" in done.stdout
    assert done.stdout.startswith("buffered, not flushed")  # stdout flushed before leaving


def test_the_interpreter_s_teardown_is_skipped() -> None:
    done = run_child(0)
    assert done.returncode == 0, done.stderr
    assert "torn down" not in done.stdout
