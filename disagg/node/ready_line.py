"""The line a node process prints once it accepts control connections (S2), in one place.

`READY <host:port> [ranks=PID,...] [metrics=<host:port>]`: `serve.py` writes it, and the
parents that wait for it, `LocalCluster` and the Ray `NodeActor`, read it with `ReadyLine.parse`,
so the words and their order are written once. Kept apart from `serve.py`, which imports the
whole node: the parents only start processes.
"""

from __future__ import annotations

from dataclasses import dataclass

READY = "READY"


@dataclass(frozen=True, slots=True)
class ReadyLine:
    """Where a started node listens: its control address, its TP ranks 1..N-1 (their pids)
    and, with a metrics port, where it serves /metrics.

    >>> line = ReadyLine("127.0.0.1:7000", (41, 42), "127.0.0.1:9100").format()
    >>> line
    'READY 127.0.0.1:7000 ranks=41,42 metrics=127.0.0.1:9100'
    >>> ReadyLine.parse(line + "\\n") == ReadyLine("127.0.0.1:7000", (41, 42), "127.0.0.1:9100")
    True
    """

    address: str
    rank_pids: tuple[int, ...] = ()
    metrics_address: str | None = None

    def format(self) -> str:
        """The line, without its newline."""
        words = [READY, self.address]
        if self.rank_pids:
            words.append("ranks=" + ",".join(str(pid) for pid in self.rank_pids))
        if self.metrics_address is not None:
            words.append(f"metrics={self.metrics_address}")
        return " ".join(words)

    @staticmethod
    def parse(line: str) -> ReadyLine | None:
        """The `ReadyLine` that `line` is, or None for any other output of the node."""
        words = line.split()
        if len(words) < 2 or words[0] != READY:
            return None
        options = dict(word.partition("=")[::2] for word in words[2:])
        ranks = options.get("ranks")
        return ReadyLine(words[1], tuple(int(pid) for pid in ranks.split(",")) if ranks else (),
                         options.get("metrics"))
