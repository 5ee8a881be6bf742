"""One Chrome/Perfetto trace from the per-process traces of a run, on one clock (S1, S3, S4c).

Every node of `disagg demo` writes its own file (`trace.py`); the router records, per request,
its submission, first token and end. `merge_traces` puts them in one file with one process per
node, times relative to the first event, each request's spans on a track of their own, and
one derived kind: per-layer forward spans on the prefiller, cut at the counter bumps its
poller reported (S3b). It only reshapes recorded events; it never invents a timestamp.
"""

from __future__ import annotations

import json
import logging
from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from disagg.utils.trace import Tracer

logger = logging.getLogger(__name__)

Event = dict[str, Any]
REQUEST_TRACK_BASE = 2**29  # tids of per-request tracks (real Linux tids stay below 2**22)
LAYER_TRACK = 2**29 - 1  # tid of the derived per-layer track on a prefiller


def load_trace(path: str | Path) -> list[Event]:
    """The events of one Chrome trace file (object form or bare list)."""
    data = json.loads(Path(path).read_text())
    events = data["traceEvents"] if isinstance(data, dict) else data
    check_events(events, str(path))
    return events


def check_events(events: list[Event], where: str = "trace") -> None:
    """Raise `ValueError` naming the first event Perfetto would not load."""
    for i, event in enumerate(events):
        missing = [key for key in ("name", "ph", "pid", "tid") if key not in event]
        if event.get("ph") != "M" and "ts" not in event:
            missing.append("ts")
        if missing:
            raise ValueError(f"{where}: event {i} ({event.get('name')!r}) lacks {missing}")
        if event["ph"] == "X" and not event.get("dur", -1) >= 0:
            raise ValueError(f"{where}: span {i} ({event['name']!r}) has no duration >= 0")


def process_names(events: Iterable[Event]) -> dict[int, str]:
    """pid -> process name, from the metadata events."""
    return {e["pid"]: e["args"]["name"] for e in events
            if e["ph"] == "M" and e["name"] == "process_name"}


def kinds_by_process(trace: dict[str, Any]) -> dict[str, set[str]]:
    """Process name -> the kinds of events it holds (`cat` if set, else the name)."""
    events = trace["traceEvents"]
    names = process_names(events)
    kinds: dict[str, set[str]] = defaultdict(set)
    for event in events:
        if event["ph"] != "M":
            kinds[names.get(event["pid"], str(event["pid"]))].add(event.get("cat", event["name"]))
    return dict(kinds)


def _sort_key(name: str) -> tuple[int, str]:
    order = {"router": 0, "prefill": 1, "decode": 2, "mixed": 2}
    return order.get(name.split("-")[0], 3), name


def _request_tracks(events: list[Event]) -> list[Event]:
    """Move each request's spans to a track per request, so overlapping requests never share
    a row (Perfetto needs the spans of one track to nest)."""
    tracks: dict[tuple[int, str], int] = {}
    meta = []
    for event in events:
        request_id = event.get("args", {}).get("request_id")
        if event["ph"] != "X" or request_id is None or event["tid"] >= REQUEST_TRACK_BASE:
            continue
        key = (event["pid"], request_id)
        if key not in tracks:
            tracks[key] = REQUEST_TRACK_BASE + len(tracks)
            meta.append({"name": "thread_name", "ph": "M", "pid": event["pid"],
                         "tid": tracks[key], "args": {"name": request_id}})
        event["tid"] = tracks[key]
    return meta


def layer_spans(events: list[Event]) -> list[Event]:
    """Per-layer forward spans of one prefiller, derived from its `layer_writes_posted`
    instants: layer L of forward F runs from the bump of layer L-1 (or the start of the
    engine step holding it) to its own bump, as the counter poller saw them (S3b)."""
    posts = sorted((e for e in events if e["name"] == "layer_writes_posted"),
                   key=lambda e: e["ts"])
    steps = sorted((e for e in events if e["name"] == "step" and e["ph"] == "X"),
                   key=lambda e: e["ts"])
    spans: list[Event] = []
    previous: dict[int, float] = {}  # forward -> ts of its last bump seen
    for post in posts:
        forward, layer = post["args"]["forward"], post["args"]["layer"]
        start = previous.get(forward)
        if start is None:
            holding = [s for s in steps if s["ts"] <= post["ts"] <= s["ts"] + s["dur"]]
            if not holding:
                continue  # no step recorded around it: leave the gap rather than guess
            start = holding[-1]["ts"]
        previous[forward] = post["ts"]
        spans.append({"name": f"layer {layer}", "cat": "layer", "ph": "X", "ts": start,
                      "dur": post["ts"] - start, "pid": post["pid"], "tid": LAYER_TRACK,
                      "args": {"forward": forward, "layer": layer,
                               "source": "counter bumps seen by the poller"}})
    if spans:
        spans.append({"name": "thread_name", "ph": "M", "pid": spans[0]["pid"],
                      "tid": LAYER_TRACK, "args": {"name": "layers (counter bumps)"}})
    return spans


def merge_traces(paths: Iterable[str | Path]) -> dict[str, Any]:
    """One trace from several per-process files: processes ordered router, prefillers,
    decoders; times in µs from the earliest event; `otherData.t0_unix_us` keeps the origin."""
    events: list[Event] = []
    for path in paths:
        loaded = load_trace(path)
        # Two files from one process (in-process nodes, tests) would share a pid: renumber.
        taken = {e["pid"] for e in events}
        clash = {pid for pid in {e["pid"] for e in loaded} if pid in taken}
        fresh = {pid: max(taken) + 1 + i for i, pid in enumerate(sorted(clash))}
        for event in loaded:
            event["pid"] = fresh.get(event["pid"], event["pid"])
        events.extend(loaded)
    names = process_names(events)
    derived: list[Event] = []
    for pid, name in names.items():
        if name.startswith("prefill"):
            derived.extend(layer_spans([e for e in events if e["pid"] == pid]))
    events += derived
    events += _request_tracks(events)
    timed = [e["ts"] for e in events if e["ph"] != "M"]
    t0 = min(timed) if timed else 0.0
    for event in events:
        if event["ph"] != "M":
            event["ts"] -= t0
    for index, (pid, _) in enumerate(sorted(names.items(), key=lambda kv: _sort_key(kv[1]))):
        events.append({"name": "process_sort_index", "ph": "M", "pid": pid, "tid": 0,
                       "args": {"sort_index": index}})
    check_events(events, "merged trace")
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"clock": "time.time()", "t0_unix_us": t0,
                          "processes": sorted(names.values(), key=_sort_key)}}


def merge_trace_dir(directory: str | Path, out: str | Path,
                    expected: Iterable[str] = ()) -> dict[str, Any]:
    """Merge every `*.json` of `directory` into `out`; warn about each `expected` process
    name that left no file (a node killed before it could write one)."""
    paths = sorted(Path(directory).glob("*.json"))
    missing = sorted(set(expected) - {p.stem for p in paths})
    if missing:
        logger.warning("no trace from %s (did it exit cleanly?)", ", ".join(missing))
    trace = merge_traces(paths)
    Path(out).write_text(json.dumps(trace))
    return trace


def record_request(tracer: Tracer, request_id: str, kind: str, at_s: float,
                   **args: Any) -> None:
    """A router-side milestone of one request (`submit`, `first_token`, `done`) on its track."""
    tracer.instant(kind, at_s=at_s, track=request_id, request_id=request_id, **args)
