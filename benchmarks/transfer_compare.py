"""Our transfer core against peer engines (NIXL, Mooncake, libfabric's fi_rma_bw), side by
side in one run (S5).

Every contender runs the same workload (2048 pages of 64 KiB into shuffled slots of another
process's region, checksum-verified, plus a 4 KiB write latency): ours through
`benchmarks/transfer.py --json --provider {tcp,shm}` (latency on the callback path), our
small writes through `benchmarks/small_write.py` in each of its modes (latency only:
callback, waited, waited-new, prepared), the messengers' KV path against prepared writes
through `benchmarks/messenger_path.py` (`ours-messenger`), the peers through the harnesses in
`benchmarks/peers/` (NIXL and Mooncake under `.venv-peers`, `fi_rma_bw` once
`build_fi_rma_bw.sh` has built it; each skipped with a note when missing). The paged workload
runs twice: at `--pages` (128 MiB by default) and at `--small-pages` (64 pages, 4 MiB: one
layer's batch is that size), as contenders `NAME` and `NAME-small`; ratios pair equal sizes.
Every paged contender warms up and times the same number of batches back to back (`--warmup`,
`--iters`: the peers' harness defaults, 3 and 10), so that no one's median holds first batches
that others leave out (`fi_rma_bw` runs its own iterations per server/client pair). Runs are
interleaved round-robin, each after the CPUs have been quiet for a moment; medians and spread go
to a rich table and to JSON with the ratios ours/peer per transport class.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.table import Table

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from transfer_core.errors import ReferenceToolError  # noqa: E402
from transfer_core.fi_rma_bw import find_fi_rma_bw  # noqa: E402

PEERS_PYTHON = ROOT / ".venv-peers" / "bin" / "python"
METRICS = ("gbps", "us_per_page", "latency_us_p50", "latency_us_p99")
# Ours to the sender's own completions (`transfer_core.bench`): where the peers' harnesses stop
# their clocks. Our "gbps" waits for the receiver's count and ack, which they do not.
INITIATOR = "gbps_initiator"
# benchmarks/messenger_path.py's per-write cost of the KV path over a prepared write's.
MESSENGER_RATIO = "messenger_over_prepared"
# benchmarks/small_write.py's modes, each a latency-only contender "ours-MODE".
SMALL_MODES = ("callback", "waited", "waited-new", "prepared")
log = logging.getLogger("transfer_compare")


@dataclass(frozen=True, slots=True)
class Contender:
    engine: str
    transport: str  # the transport class: "tcp" or "shm"
    cmd: tuple[str, ...]
    latency_only: bool = False  # runs the 4 KiB latency alone, not the paged workload
    pages: int | None = None  # the paged workload's batch it must report (None: not checked)


@dataclass(frozen=True, slots=True)
class Quiet:
    quiet: bool
    waited_s: float
    busy: float  # fraction of CPU time not idle over the last window


@dataclass(slots=True)
class Run:
    engine: str
    transport: str
    repeat: int
    quiet: Quiet
    result: dict | None = None
    error: str | None = None


@dataclass(slots=True)
class Summary:
    engine: str
    transport: str
    runs_ok: int
    runs_total: int
    quiet_runs: int
    verified: bool
    median: dict[str, float] = field(default_factory=dict)
    low: dict[str, float] = field(default_factory=dict)
    high: dict[str, float] = field(default_factory=dict)


def _cpu_times() -> tuple[int, int]:
    """(total, idle) jiffies over all CPUs; idle counts iowait too."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    return sum(fields[:8]), fields[3] + fields[4]


def cpu_busy(window_s: float) -> float:
    total0, idle0 = _cpu_times()
    time.sleep(window_s)
    total1, idle1 = _cpu_times()
    return 1.0 - (idle1 - idle0) / max(total1 - total0, 1)


def wait_quiet(threshold: float = 0.10, window_s: float = 2.0, cap_s: float = 60.0) -> Quiet:
    """Wait until the CPUs were < threshold busy for a whole window; give up after cap_s."""
    start = time.monotonic()
    while True:
        busy = cpu_busy(window_s)
        waited = time.monotonic() - start
        if busy < threshold:
            return Quiet(True, waited, busy)
        if waited >= cap_s:
            log.warning("CPUs still %.0f%% busy after %.0f s; running anyway", busy * 100, waited)
            return Quiet(False, waited, busy)


def _last_json(stdout: str) -> dict:
    for line in reversed(stdout.strip().splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    raise ValueError("no JSON object on stdout")


def run_once(c: Contender, repeat: int, quiet: Quiet, timeout_s: float) -> Run:
    run = Run(c.engine, c.transport, repeat, quiet)
    try:
        proc = subprocess.run(
            c.cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout_s, check=False
        )
    except subprocess.TimeoutExpired:
        run.error = f"timed out after {timeout_s:.0f} s"
        return run
    try:
        result = _last_json(proc.stdout)
    except ValueError as exc:
        tail = proc.stderr.strip().splitlines()[-3:]
        run.error = f"exit {proc.returncode}, {exc}: {' | '.join(tail)}"
        return run
    if "error" in result:
        run.error = result["error"]
    elif proc.returncode not in (0, 1):  # 1 = ran but failed verification: keep the numbers
        run.error = f"exit {proc.returncode}"
    else:
        run.result = result
    return run


def check_workload(run: Run, pages: int | None, page_bytes: int) -> None:
    """A contender that ran a different workload than asked is an error, not a data point."""
    if run.result is None or pages is None:
        return
    got = (run.result.get("pages", run.result.get("num_pages")), run.result.get("page_bytes"))
    if got != (pages, page_bytes):
        run.error = f"ran {got[0]} x {got[1]} B, asked {pages} x {page_bytes} B"
        run.result = None


def _sizes(args: argparse.Namespace) -> list[tuple[str, int]]:
    """(name suffix, pages) of the paged workload's two batch sizes."""
    return [("", args.pages), ("-small", args.small_pages)]


def contenders(args: argparse.Namespace, notes: list[str]) -> list[Contender]:
    def work(pages: int) -> tuple[str, ...]:
        return ("--pages", str(pages), "--page-size", str(args.page_size))

    # The same warm-up and timed batches for ours and the peers' harness (`fi_rma_bw` has its
    # own per run): a first batch can be several times slower than the tenth.
    ours_reps = ("--warmup", str(args.warmup), "--reps", str(args.iters))
    peer_reps = ("--warmup", str(args.warmup), "--iters", str(args.iters))

    # --no-wait-idle: this driver already waited for quiet CPUs before every contender alike;
    # a second wait inside ours alone would hand it quieter conditions than the peers.
    ours = [
        Contender(f"ours{suffix}", p, (
            sys.executable, "benchmarks/transfer.py", "--json", "--provider", p, "--no-wait-idle",
            *work(pages), *ours_reps,
        ), pages=pages)
        for suffix, pages in _sizes(args)
        for p in ("tcp", "shm")
    ]  # fmt: skip
    ours += [
        Contender(f"ours-{mode}", p, (
            sys.executable, "benchmarks/small_write.py", "--json", "--provider", p,
            "--mode", mode, "--iters", "1000", "--rounds", "1",
        ), latency_only=True)
        for mode in SMALL_MODES
        for p in ("tcp", "shm")
    ]  # fmt: skip
    ours += [
        Contender("ours-messenger", p, (
            sys.executable, "benchmarks/messenger_path.py", "--json", "--provider", p,
        ))
        for p in ("tcp", "shm")
    ]  # fmt: skip
    try:
        fi_rma_bw = find_fi_rma_bw(also=[PEERS_PYTHON.parent])
    except ReferenceToolError as error:  # $FI_RMA_BW names something that cannot run
        notes.append(f"fi_rma_bw skipped: {error}")
        fi_rma_bw = None
    else:
        if fi_rma_bw is None:
            notes.append("fi_rma_bw not found: skipped (run benchmarks/peers/build_fi_rma_bw.sh)")
    if fi_rma_bw is not None:  # under our Python: the harness needs transfer_core, no venv
        # fi_rma_bw writes one cached page to one page: ours on that same pattern beside it
        ours += [
            Contender(f"ours-1buf{suffix}", p, (
                sys.executable, "benchmarks/transfer.py", "--json", "--provider", p,
                "--no-wait-idle", "--one-buffer", *work(pages), *ours_reps,
            ), pages=pages)
            for suffix, pages in _sizes(args)
            for p in ("tcp", "shm")
        ]  # fmt: skip
        ours += [
            Contender(f"fi_rma_bw{suffix}", p, (
                sys.executable, "benchmarks/peers/fi_rma_bw_peer.py", "--transport", p,
                "--binary", str(fi_rma_bw), *work(pages),
            ), pages=pages)
            for suffix, pages in _sizes(args)
            for p in ("tcp", "shm")
        ]  # fmt: skip
    if not PEERS_PYTHON.exists():
        notes.append(f"{PEERS_PYTHON} missing: peers skipped (run benchmarks/peers/setup_peers.sh)")
        return ours
    py = str(PEERS_PYTHON)
    nixl, mooncake = "benchmarks/peers/nixl_peer.py", "benchmarks/peers/mooncake_peer.py"
    peers = [
        Contender(f"nixl-ucx{suffix}", p, (py, nixl, "--transport", p, *work(pages), *peer_reps),
                  pages=pages)
        for suffix, pages in _sizes(args)
        for p in ("tcp", "shm")
    ]
    return ours + peers + [
        Contender("mooncake", "tcp", (py, mooncake, "--transport", "tcp", *work(args.pages),
                                      *peer_reps), pages=args.pages),
    ]


def summarise(runs: list[Run], c: Contender, quiet_only: bool) -> Summary:
    """Median and range over the runs that produced numbers (only quiet ones if asked)."""
    mine = [r for r in runs if (r.engine, r.transport) == (c.engine, c.transport)]
    ok = [r.result for r in mine if r.result is not None and (r.quiet.quiet or not quiet_only)]
    s = Summary(
        c.engine, c.transport, len(ok), len(mine), sum(r.quiet.quiet for r in mine),
        verified=bool(ok) and all(bool(r.get("verified")) for r in ok),
    )
    for m in (*METRICS, INITIATOR, MESSENGER_RATIO):
        values = [float(r[m]) for r in ok if r.get(m) is not None]
        if values:
            s.median[m] = statistics.median(values)
            s.low[m], s.high[m] = min(values), max(values)
    return s


def ratios(summaries: list[Summary]) -> dict[str, dict[str, dict[str, float]]]:
    """ours/peer per transport class, each peer against ours at the same batch size ("ours",
    "ours-small"; the latency-only "ours-MODE" paths against the full-size peers; `fi_rma_bw`
    also against "ours-1buf", ours writing its one-page pattern): > 1 on gbps
    and < 1 on latency means we are ahead. `gbps_initiator_ours_over_peer` sets our GB/s to the
    sender's completions against the peer's, both clocks stopped where the peers stop theirs.
    Keys: class -> "peer" (ours), "peer vs ours-MODE", or "ours-messenger vs ours-prepared"
    (per write, from one run of messenger_path.py)."""
    out: dict[str, dict[str, dict[str, float]]] = {}
    by_key = {(s.engine, s.transport): s for s in summaries}
    for s in summaries:
        if s.engine == "ours-messenger" and MESSENGER_RATIO in s.median:
            out.setdefault(s.transport, {})["ours-messenger vs ours-prepared"] = {
                "us_per_write_ours_over_peer": s.median[MESSENGER_RATIO]}
        if s.engine.startswith("ours") or not s.median:
            continue
        small = s.engine.endswith("-small")
        mine_all = ["ours-small"] if small else ["ours", *(f"ours-{m}" for m in SMALL_MODES)]
        if s.engine.startswith("fi_rma_bw"):  # and ours on its one-buffer pattern
            mine_all.append("ours-1buf-small" if small else "ours-1buf")
        for mine in mine_all:
            ours = by_key.get((mine, s.transport))
            if ours is None or not ours.median:
                continue
            key = s.engine if mine in ("ours", "ours-small") else f"{s.engine} vs {mine}"
            pair = {
                f"{m}_ours_over_peer": ours.median[m] / s.median[m]
                for m in METRICS
                if s.median.get(m) and ours.median.get(m)
            }
            if ours.median.get(INITIATOR) and s.median.get("gbps"):  # like with like
                pair[f"{INITIATOR}_ours_over_peer"] = ours.median[INITIATOR] / s.median["gbps"]
            if pair:  # fi_rma_bw has no latency for the latency-only paths to meet
                out.setdefault(s.transport, {})[key] = pair
    return out


def _cell(s: Summary, m: str, fmt: str) -> str:
    if m not in s.median:
        return "-"
    return escape(f"{s.median[m]:{fmt}} [{s.low[m]:{fmt}}-{s.high[m]:{fmt}}]")


def print_tables(summaries: list[Summary], ratio: dict, notes: list[str]) -> None:
    # Piped into a file the default width (80) would fold every cell; keep rows on one line.
    console = Console(width=None if sys.stdout.isatty() else 140)
    table = Table(title=escape("Peer workload: median [min-max] over repeats"))
    for col in ("engine", "class", "GB/s", "GB/s, initiator", "µs/page", "lat p50 µs",
                "lat p99 µs", "used", "quiet"):
        table.add_column(col)
    for s in summaries:
        table.add_row(
            s.engine, s.transport, _cell(s, "gbps", ".2f"), _cell(s, INITIATOR, ".2f"),
            _cell(s, "us_per_page", ".1f"), _cell(s, "latency_us_p50", ".1f"),
            _cell(s, "latency_us_p99", ".1f"),
            f"{s.runs_ok}/{s.runs_total}{'' if s.verified else ' UNVERIFIED'}",
            f"{s.quiet_runs}/{s.runs_total}",
        )
    console.print(table)
    rt = Table(title="ours / peer (GB/s > 1, latency and µs/write < 1: ahead)")
    for col in ("class", "peer", "GB/s", "GB/s, initiator", "lat p50", "lat p99", "µs/write"):
        rt.add_column(col)
    for cls, peers in ratio.items():
        for peer, r in peers.items():
            rt.add_row(cls, peer, *(
                f"{r[k]:.2f}" if k in r else "-"
                for k in ("gbps_ours_over_peer", f"{INITIATOR}_ours_over_peer",
                          "latency_us_p50_ours_over_peer",
                          "latency_us_p99_ours_over_peer", "us_per_write_ours_over_peer")
            ))
    console.print(rt)
    for note in notes:
        console.print(f"[yellow]note:[/yellow] {note}")


def _peer_versions() -> dict[str, str]:
    if not PEERS_PYTHON.exists():
        return {}
    code = (
        "import importlib.metadata as m, json\n"
        "out = {}\n"
        "for p in ('nixl-cu12', 'mooncake-transfer-engine-non-cuda'):\n"
        "    try: out[p] = m.version(p)\n"
        "    except m.PackageNotFoundError: out[p] = 'not installed'\n"
        "print(json.dumps(out))"
    )
    proc = subprocess.run([str(PEERS_PYTHON), "-c", code], capture_output=True, text=True)
    return json.loads(proc.stdout) if proc.returncode == 0 else {"error": proc.stderr[-200:]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--pages", type=int, default=2048)
    parser.add_argument("--small-pages", type=int, default=64,
                        help="the paged workload's second, small batch (NAME-small)")
    parser.add_argument("--page-size", type=int, default=64 * 1024, help="bytes per page")
    parser.add_argument("--warmup", type=int, default=3,
                        help="untimed batches before each paged contender's timed ones")
    parser.add_argument("--iters", type=int, default=10,
                        help="timed batches per run of a paged contender (its median)")
    parser.add_argument("--only", nargs="*", default=None, help="engine names to run")
    parser.add_argument("--quiet-threshold", type=float, default=0.10)
    parser.add_argument("--quiet-cap", type=float, default=60.0, help="max seconds to wait")
    parser.add_argument(
        "--quiet-only", action="store_true",
        help="summarise only runs that started on quiet CPUs (all runs stay in the JSON)",
    )
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per run")
    parser.add_argument("--out", type=Path, default=ROOT / "out" / "transfer_compare.json")
    parser.add_argument("--show", type=Path, help="only print the tables of a saved report")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    if args.show:
        saved = json.loads(args.show.read_text())
        print_tables([Summary(**d) for d in saved["summaries"]], saved["ratios"], saved["notes"])
        return 0

    notes: list[str] = []
    todo = [c for c in contenders(args, notes) if args.only is None or c.engine in args.only]
    for script in sorted({a for c in todo for a in c.cmd if a.startswith("benchmarks/")}):
        if not (ROOT / script).exists():
            notes.append(f"{script} is missing: its contenders were not run")
            todo = [c for c in todo if script not in c.cmd]
    runs: list[Run] = []
    # Round-robin, not engine after engine: slow drifts in background load hit everyone alike.
    for repeat in range(args.repeats):
        for c in todo:
            quiet = wait_quiet(args.quiet_threshold, 2.0, args.quiet_cap)
            run = run_once(c, repeat, quiet, args.timeout)
            check_workload(run, c.pages, args.page_size)
            got = (
                f"{run.result.get('gbps') or 0:.2f} GB/s, "
                f"{run.result.get('latency_us_p50') or 0:.1f} us p50"
                if run.result
                else f"error: {run.error}"
            )
            log.info("%s/%s #%d (quiet=%s): %s", c.engine, c.transport, repeat, quiet.quiet, got)
            runs.append(run)
    summaries = [summarise(runs, c, args.quiet_only) for c in todo]
    ratio = ratios(summaries)
    for s in summaries:
        errors = {r.error for r in runs if (r.engine, r.transport) == (s.engine, s.transport)}
        if errors - {None}:
            notes.append(f"{s.engine}/{s.transport}: {errors - {None}}")
    report = {
        "workload": {"pages": args.pages, "small_pages": args.small_pages,
                     "page_bytes": args.page_size, "repeats": args.repeats,
                     "warmup": args.warmup, "iters": args.iters},
        "quiet_only": args.quiet_only,
        "env": {
            "cpus": len(os.sched_getaffinity(0)),
            "kernel": platform.release(),
            "python": platform.python_version(),
            "peers": _peer_versions(),
        },
        "summaries": [asdict(s) for s in summaries],
        "ratios": ratio,
        "runs": [asdict(r) for r in runs],
        "notes": notes,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print_tables(summaries, ratio, notes)
    log.info("wrote %s", args.out)
    failed = any(r.error for r in runs) or not all(s.verified for s in summaries)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
