"""One naming rule for every series the project exports (X4): the `disagg:` prefix, no
`_created` series, counters and only counters end in `_total`, histograms name their unit.
Checked on what the nodes' and the front door's registries really render, and on a broken
exposition (so the checker itself is known to catch each case)."""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest
from prometheus_client import generate_latest

from disagg.engine.page_allocator import PageAllocator
from disagg.engine.prefix_cache import PrefixCache
from disagg.kv_transfer.prefill_messenger import STATS
from disagg.node.node_metrics import decode_metrics, prefill_metrics
from disagg.server.generation import Timings
from disagg.server.metrics import ServerMetrics
from disagg.utils.metrics import Metrics
from disagg.utils.tally import Tally

UNITS = ("_seconds", "_bytes", "_tokens", "_pages")


def naming_violations(text: str) -> list[str]:
    """Every way the exposition `text` breaks the rule, one line each (empty: it holds). Read
    line by line, not through prometheus_client's parser: that one renames a counter's
    samples to end in `_total`, which would hide the very break looked for."""
    kinds: dict[str, str] = {}  # family name -> type, from its `# TYPE` line
    problems = []
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(maxsplit=3)
            kinds[name] = kind
            if (kind == "counter") != name.endswith("_total"):
                problems.append(f"{name}: a {kind} {'not ' if kind == 'counter' else ''}"
                                "ending in _total")
            if kind == "histogram" and not name.endswith(UNITS):
                problems.append(f"{name}: a histogram without a unit {UNITS}")
        elif line and not line.startswith("#"):
            name = re.match(r"[^{\s]+", line).group()  # type: ignore[union-attr]
            family = name if name in kinds else re.sub(r"_(bucket|sum|count)$", "", name)
            if not name.startswith("disagg:"):
                problems.append(f"{name}: not under the disagg: prefix")
            if name.endswith("_created"):
                problems.append(f"{name}: a _created series")
            if kinds.get(family) is None:
                problems.append(f"{name}: a sample without a # TYPE line")
    return problems


class Quarantine(list):
    forced_releases = 0


def engine() -> SimpleNamespace:
    allocator = PageAllocator(16, PrefixCache(4))
    return SimpleNamespace(allocator=allocator, runner=SimpleNamespace(graph_stats={"static": 0}))


def transfer() -> SimpleNamespace:
    return SimpleNamespace(stats=lambda: [SimpleNamespace(bytes_written=10)] * 2)


def test_the_checker_catches_every_kind_of_break() -> None:
    broken = "\n".join([
        "# TYPE disagg_old_style gauge", "disagg_old_style 1",
        "# TYPE disagg:pages_total gauge", "disagg:pages_total 1",
        "# TYPE disagg:writes counter", "disagg:writes 1",
        "# TYPE disagg:writes_created gauge", "disagg:writes_created 1.7e9",
        "# TYPE disagg:wait histogram", 'disagg:wait_bucket{le="+Inf"} 1',
        "disagg:wait_count 1", "disagg:wait_sum 1", "disagg:loose 1", ""])
    problems = naming_violations(broken)
    for needle in ("disagg_old_style: not under", "disagg:pages_total: a gauge ending",
                   "disagg:writes: a counter not ending", "disagg:writes_created: a _created",
                   "disagg:wait: a histogram without a unit", "disagg:loose: a sample without"):
        assert any(p.startswith(needle) for p in problems), (needle, problems)


def test_a_prefillers_series_follow_the_rule() -> None:
    messenger = SimpleNamespace(stats=Tally(*STATS), num_in_flight=0)
    messenger.stats.add(**dict.fromkeys(STATS, 1))
    text = prefill_metrics(engine(), messenger, transfer()).render()  # type: ignore[arg-type]
    assert naming_violations(text) == []
    assert "disagg:kv_pages_capacity 16.0" in text and "disagg:kv_sent_bytes_total 1.0" in text


def test_a_decoders_series_follow_the_rule() -> None:
    messenger = SimpleNamespace(pending=[], quarantine=Quarantine(),
                                kv=[SimpleNamespace(staged_bytes=0)])
    metrics = decode_metrics(engine(), messenger, transfer())  # type: ignore[arg-type]
    # What the decoder node itself records, under the names it uses.
    metrics.inc("requests_total", state="finished_length")
    metrics.inc("kv_bytes_total", 4096)
    metrics.inc("kv_writes_total", 4)
    metrics.inc("failures_total", cause="deadline")
    metrics.observe("kv_transfer_seconds", 0.01)
    text = metrics.render()
    assert naming_violations(text) == []
    assert "disagg:kv_pages_in_use 0.0" in text and "disagg:kv_pages_capacity 16.0" in text


def test_the_front_doors_series_follow_the_rule() -> None:
    metrics = ServerMetrics("tiny", waiting=lambda: 0)
    metrics.record(Timings(arrival=0.0, first_event=0.1, token_times=[0.2, 0.3], end=0.3),
                   prompt_tokens=5, reason="stop", cached_tokens=4)
    text = generate_latest(metrics.registry).decode()
    assert naming_violations(text) == []
    assert 'disagg:request_success_total{finished_reason="stop",model_name="tiny"} 1.0' in text


@pytest.mark.parametrize(("use", "name"), [
    (lambda m: m.gauge("pages_total", lambda: 0), "pages_total"),
    (lambda m: m.observe("wait_total", 1.0), "wait_total"),
    (lambda m: m.inc("writes"), "writes"),
    (lambda m: m.counter_from("bytes", lambda: 0), "bytes"),
    (lambda m: m.counters_from("bytes", "domain", dict), "bytes"),
])
def test_metrics_refuses_a_name_that_breaks_the_rule(use, name: str) -> None:  # noqa: ANN001
    with pytest.raises(ValueError, match=f"{name!r}.*_total"):
        use(Metrics())
