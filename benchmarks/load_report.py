"""What `load.py` saw, and the promises it checks: one `Run` record, then the table's rows.

`Run` is the client's view of each request (submit time, decoder, retries, terminal state,
tokens) and of the nodes (when each fault hit, time-stamped log lines, metrics scraped around
a freeze). `summarize` turns it into the load promises' figures (X4: every request ends once,
in time, token-exact; survivors exit clean) plus one row per new fault (S5); each row's check
says what would show that the fault did nothing or that the system broke a promise under it.
Nothing here starts or signals a process.
"""

from __future__ import annotations

import collections
import json
import queue
import sys
import threading
import time
from typing import Any

from disagg.node.router import SILENCE_S, Router

FINISHED = ("finished_length", "finished_stopped")
BACK_MARGIN_S = 0.5  # from a decoder taking the prefiller back to the router hearing it
SILENCE_MARGIN_S = 0.5  # from the router's silence window ending to it taking effect
PREFILLED = "disagg:kv_sent_requests_total"  # a prefiller's transfers ended, from its /metrics


class Run:
    """What the client saw of each request, and when each fault hit."""

    def __init__(self, num_requests: int) -> None:
        self.num_requests = num_requests
        self.submitted: dict[str, float] = {}
        self.routed: dict[str, int | None] = {}  # decoder index; None when refused
        self.final: dict[str, tuple[str, str | None, float]] = {}  # state, cause, when
        self.retries: dict[str, list[str]] = collections.defaultdict(list)  # their causes
        self.tokens: dict[str, list[int]] = collections.defaultdict(list)
        self.duplicates: list[str] = []
        self.done = threading.Event()
        self.at: dict[tuple[str, str], float] = {}  # (action, node) -> when
        self.seen: list[tuple[float, str, str]] = []  # (when, node, log line)
        self.metrics: dict[str, dict[str, float]] = {}  # node (or node@end) -> its metrics
        self._lock = threading.Lock()

    def end(self, request_id: str, state: str, cause: str | None) -> None:
        """A terminal state (a second one for the same request is a broken promise)."""
        with self._lock:
            if request_id in self.final:
                self.duplicates.append(request_id)
            self.final[request_id] = (state, cause, time.monotonic())
            if len(self.final) >= self.num_requests:
                self.done.set()

    def collect(self, router: Router) -> None:
        """Thread: the router's events into this record, until every request ended."""
        while not self.done.is_set():
            try:
                event = router.events.get(timeout=0.2)
            except queue.Empty:
                continue
            self.tokens[event.request_id] += event.token_ids
            cause = event.cause.value if event.cause is not None else None
            if event.state.is_terminal():
                self.end(event.request_id, event.state.value, cause)
            elif cause is not None:  # a retry names its cause; progress reports do not
                self.retries[event.request_id].append(cause)

    def state(self, request_id: str) -> str:
        return self.final.get(request_id, ("none", None, 0.0))[0]

    def cause(self, request_id: str) -> str | None:
        return self.final.get(request_id, ("none", None, 0.0))[1]

    def submitted_in(self, start: float, end: float = float("inf")) -> list[str]:
        return [rid for rid, at in self.submitted.items() if start <= at < end]

    def outcomes(self, request_ids: list[str]) -> dict[str, int]:
        """Terminal states (with the failure cause) of these requests, counted."""
        return dict(collections.Counter(
            state if cause in (None, "aborted") else f"{state}:{cause}"
            for state, cause, _ in (self.final.get(r, ("none", None, 0.0)) for r in request_ids)))


def tracebacks(logs: dict[str, list[str]]) -> dict[str, str]:
    """Node -> the last traceback in its log: its innermost frame and exception line. Log
    lines of the node's other threads ("<node> LEVEL ...") may be interleaved; they are
    skipped."""
    found = {}
    for name, lines in logs.items():
        inside, frame = False, ""
        for line in lines:
            if line.startswith("Traceback"):
                inside, frame = True, ""
            elif not inside or line.startswith(f"{name} "):
                continue
            elif line.startswith("  File "):
                frame = line.strip()
            elif line and not line.startswith(" "):
                found[name], inside = f"{line[:200]} (at {frame[:200]})", False
    return found


def summarize(run: Run, expected: list[list[int]], finished_in_time: bool, deadline_s: float,
              killed: list[str], exit_codes: dict[str, int | None],
              logs: dict[str, list[str]]) -> tuple[dict[str, Any], bool]:
    """The load promises' figures (X4): every request ended once, in time, and token-exact;
    survivors exit clean. Returns the rows and whether those promises held."""
    wrong = sorted(rid for rid, (state, _, _) in run.final.items()
                   if state in FINISHED and run.tokens[rid] != expected[int(rid[1:])])
    late = [rid for rid, (_, _, t) in run.final.items() if t - run.submitted[rid] > deadline_s]
    clean = all(code == 0 for name, code in exit_codes.items() if name not in killed)
    checksum = sorted(rid for rid in run.final
                      if "checksum" in run.retries.get(rid, []) or run.cause(rid) == "checksum")
    rows = {
        "requests": run.num_requests, "terminal": len(run.final),
        "all_terminal": finished_in_time,
        "states": dict(collections.Counter(s for s, _, _ in run.final.values())),
        "failure_causes": dict(collections.Counter(  # "missing": an event without its cause
            c or "missing" for s, c, _ in run.final.values() if s == "finished_failed")),
        "retries_by_cause": dict(collections.Counter(
            c for causes in run.retries.values() for c in causes)),
        "routed_per_decoder": dict(sorted(collections.Counter(
            "refused" if d is None else f"decode-{d}" for d in run.routed.values()).items())),
        "wrong_outputs": len(wrong), "wrong_ids": wrong[:10],
        "checksum_retried_or_failed": checksum[:10],
        "duplicate_terminal_states": len(run.duplicates), "late": len(late),
        "deadline_s": deadline_s, "killed": killed, "exit_codes": exit_codes,
        "survivors_clean": clean, "tracebacks": tracebacks(logs),
    }
    return rows, finished_in_time and not wrong and not run.duplicates and not late and clean


def prefiller_freeze(run: Run, node: str, address: str,
                     decoders: list[str]) -> tuple[dict[str, Any], bool]:
    """It really froze: requests submitted meanwhile were refused or failed. Once thawed:
    every decoder alive then takes it back (its "is back" log line), it prefills again, and
    no request submitted after that is refused or fails for want of a prefiller."""
    stop, cont = run.at["stop", node], run.at["cont", node]
    backs: dict[str, float] = {}
    for t, name, line in run.seen:
        if t >= cont and "is back" in line and address in line:
            backs.setdefault(name, t - cont)
    alive = {n for n in decoders if run.at.get(("kill", n), float("inf")) > cont}
    back_at = cont + max(backs.values(), default=float("inf"))
    unserved = [r for r in run.submitted_in(back_at + BACK_MARGIN_S) if run.state(r) ==
                "refused" or run.cause(r) in ("no_prefiller", "prefiller_died")]
    frozen = run.submitted_in(stop, cont)
    end = run.metrics.get(node + "@end", {})  # empty: it did not answer (dead)
    prefilled = end[PREFILLED] - run.metrics[node].get(PREFILLED, 0) if end else None
    row = {"frozen_s": round(cont - stop, 1), "while_frozen": run.outcomes(frozen),
           "taken_back_after_s": {n: round(s, 2) for n, s in sorted(backs.items())},
           "served_after_thaw": sum(run.state(r) in FINISHED for r in run.submitted_in(cont)),
           "prefilled_by_it_after_thaw": prefilled and int(prefilled),
           "refused_or_no_prefiller_after_back": (unserved[:10], len(unserved))}
    hurt = sum(run.state(r) in ("refused", "finished_failed") for r in frozen)
    return row, set(backs) >= alive and not unserved and hurt > 0 and bool(prefilled)


def decoder_freeze(run: Run, node: str) -> tuple[dict[str, Any], bool]:
    """Once its silence shows, no request is routed to it; those it held end exactly once
    (the run's own check); after the thaw it is routed to again."""
    index = int(node.split("-")[1])
    stop, cont = run.at["stop", node], run.at["cont", node]
    quiet = stop + SILENCE_S + SILENCE_MARGIN_S
    to_it = [rid for rid, d in run.routed.items() if d == index]
    held = [r for r in to_it if run.submitted[r] < stop
            and run.final.get(r, ("", None, float("inf")))[2] > stop]
    after_silence = [r for r in to_it if quiet <= run.submitted[r] < cont]
    row = {"frozen_s": round(cont - stop, 1), "held_when_frozen": run.outcomes(held),
           "routed_in_silence_window": run.outcomes(
               [r for r in to_it if stop <= run.submitted[r] < quiet]),
           "routed_while_frozen_after_silence": len(after_silence),
           "routed_after_thaw": sum(run.submitted[r] >= cont for r in to_it)}
    return row, not after_silence and row["routed_after_thaw"] > 0


def hostile_rows(run: Run, counts: dict[str, Any], victim: str) -> tuple[dict[str, Any], bool]:
    """What the attacker sent and how the prefillers answered; how the victim's requests
    ended. The promise: no forged Hello accepted (wrong tokens are the run's own check)."""
    index = int(victim.split("-")[1])
    on_victim = [rid for rid, d in run.routed.items() if d == index]
    rows = {"hostile": counts, f"hostile_victim_{victim}": {
        "requests": len(on_victim), "retried": sum(bool(run.retries[r]) for r in on_victim),
        "outcomes": run.outcomes(on_victim)}}
    return rows, counts["forged_hellos_accepted"] == 0 and counts["guessed_key_writes"] > 0


def print_result(result: dict[str, Any], title: str, as_json: bool) -> None:
    """The run's figures as one JSON line, or as a table."""
    if as_json:
        sys.stdout.write(json.dumps(result) + "\n")
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    table.add_column("figure")
    table.add_column("value")
    for key, value in result.items():
        table.add_row(key, str(value))
    Console().print(table)
