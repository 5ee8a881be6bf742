"""A module that writes 256 KiB to stderr when imported, four times a pipe's buffer: a fork
server preloading it must still come up (X5f). Its `main()` does nothing."""

import sys

sys.stderr.write(("x" * 1023 + "\n") * 256)
sys.stderr.flush()


def main() -> None:
    pass
