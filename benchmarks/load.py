"""Load under failure (X4, S5): many requests, random aborts, nodes killed, frozen, attacked.

Starts prefillers and decoders as processes over the tcp provider, sends N requests at a steady
rate, aborts a fraction at random moments and, on a timeline scaled to the run (`schedule`):
SIGKILLs prefill-0; SIGSTOPs the other prefiller, now the only one, past the decoders' 10 s
peer timeout, SIGKILLs the last decoder meanwhile, then SIGCONTs; SIGSTOPs decode-0 past the
router's 5 s silence window, then SIGCONTs. A hostile process (`hostile.py`) attacks decode-1
throughout. The promises (`load_report.py`): every request reaches exactly one terminal state
before its deadline (a submission the router refuses, no decoder taking requests, ends there
as "refused"); every finished request decoded the single-node engine's tokens; every
surviving node, the frozen ones included, exits 0 after its own leak check; every decoder
takes the thawed prefiller back, and no request submitted after that is refused or fails for
want of a prefiller; nothing is routed to the frozen decoder once its silence shows; no forged
Hello is accepted. Prints a table, or one JSON object with `--json`. Each new fault can be
switched off: `--freeze-prefiller-s 0`, `--freeze-decoder-s 0`, `--no-hostile`.
Run: `python benchmarks/load.py [--requests 1000] [--rate 25] [--decoders 3] [--prefillers 2]`.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import signal
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any, NamedTuple

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hostile import HostileClient  # noqa: E402
from load_report import (  # noqa: E402
    Run,
    decoder_freeze,
    hostile_rows,
    prefiller_freeze,
    print_result,
    summarize,
)

from disagg.config import (  # noqa: E402
    CacheConfig,
    EngineConfig,
    SchedulerConfig,
)
from disagg.control.channel import parse_address  # noqa: E402
from disagg.control.messages import Submit  # noqa: E402
from disagg.engine.llm_engine import build_engine  # noqa: E402
from disagg.engine.request import SamplingParams  # noqa: E402
from disagg.errors import PeerClosedError  # noqa: E402
from disagg.model.loading.registry import load_model  # noqa: E402
from disagg.node.cluster_config import ClusterConfig  # noqa: E402
from disagg.node.local_cluster import LocalCluster  # noqa: E402
from disagg.node.router import Router  # noqa: E402
from disagg.utils.metrics import parse_metrics  # noqa: E402

VICTIM = "decode-1"  # the decoder the hostile process attacks
FROZEN_DECODER = "decode-0"  # at light load the router's first choice (ties: lowest index)


class Fault(NamedTuple):
    """At `at_s` into the run: kill, stop (SIGSTOP) or cont (SIGCONT) node `node`."""

    at_s: float
    action: str
    node: str


def schedule(args: argparse.Namespace) -> list[Fault]:
    """The faults, in time order: kill prefill-0; freeze the last prefiller (now the only
    one), kill the last decoder while it holds requests waiting on it, thaw the prefiller;
    3 s later freeze decode-0 (at light load the router's first choice: ties go to the lowest
    index) and thaw it. Without freezes: the kills, at 10% and 50% of the run.

    >>> [f"{f.action} {f.node} {f.at_s:g}" for f in schedule(argparse.Namespace(
    ...     requests=1000, rate=25, prefillers=2, decoders=3, freeze_prefiller_s=12,
    ...     freeze_decoder_s=7, hostile=True))]  # doctest: +NORMALIZE_WHITESPACE
    ['kill prefill-0 4', 'stop prefill-1 6', 'kill decode-2 12', 'cont prefill-1 18',
     'stop decode-0 21', 'cont decode-0 28']
    """
    window = args.requests / args.rate
    if (args.freeze_prefiller_s > 0 or args.freeze_decoder_s > 0 or args.hostile) and (
            args.prefillers < 2 or args.decoders < 3):
        raise ValueError("the new faults need --prefillers >= 2 and --decoders >= 3 (a "
                         "decoder is killed, one frozen, one attacked)")
    prefiller, killed = f"prefill-{args.prefillers - 1}", f"decode-{args.decoders - 1}"
    at = 0.1 * window
    faults = [Fault(at, "kill", "prefill-0")]
    if args.freeze_prefiller_s > 0:
        at += 0.05 * window
        faults += [Fault(at, "stop", prefiller),
                   Fault(at + args.freeze_prefiller_s / 2, "kill", killed),
                   Fault(at + args.freeze_prefiller_s, "cont", prefiller)]
        at += args.freeze_prefiller_s + 3.0  # the decoders take it back meanwhile
    else:
        faults.append(Fault(0.5 * window, "kill", killed))
    if args.freeze_decoder_s > 0:
        faults += [Fault(at, "stop", FROZEN_DECODER),
                   Fault(at + args.freeze_decoder_s, "cont", FROZEN_DECODER)]
    faults.sort()
    if faults[-1].at_s > 0.9 * window:
        raise ValueError(f"the faults need about {faults[-1].at_s / 0.9:.0f} s of traffic; "
                         f"--requests / --rate gives {window:.0f} s")
    return faults


def reference_tokens(model: str, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    loaded = load_model(model)
    engine = build_engine(EngineConfig(loaded.config, CacheConfig(page_size=16, num_pages=4096),
                                       SchedulerConfig(max_num_seqs=256,
                                                       max_num_batched_tokens=2048)),
                          loaded.state_dict)
    return [r.output_token_ids for r in engine.generate(prompts, SamplingParams(max_tokens))]


def _scrape(cluster: LocalCluster, name: str) -> dict[str, float]:
    """One node's metrics (`LocalCluster.scrape_metrics` would wait on a frozen one); empty
    if it does not answer."""
    try:
        with urllib.request.urlopen(f"http://{cluster.metrics_addresses[name]}/metrics",
                                    timeout=5) as response:
            return parse_metrics(response.read().decode())
    except (OSError, KeyError):
        return {}


def _watch_logs(cluster: LocalCluster, stop: threading.Event,
                seen: list[tuple[float, str, str]]) -> None:
    """Time-stamp the decoders' reconnection and refusal lines, and every traceback."""
    read: collections.Counter[str] = collections.Counter()
    while not stop.wait(0.05):
        for name, log in list(cluster.logs.items()):
            for line in log[read[name]:]:
                if any(w in line for w in ("is back", "new requests", "Traceback")):
                    seen.append((time.monotonic(), name, line))
                read[name] += 1


def apply(run_: Run, cluster: LocalCluster, fault: Fault, stopped: set[str]) -> None:
    """Kill, freeze or thaw a node; a freeze first reads what the node has served so far."""
    process = cluster.processes[cluster.names.index(fault.node)]
    if fault.action == "stop":
        run_.metrics[fault.node] = _scrape(cluster, fault.node)
    if fault.action == "kill":
        cluster.kill(fault.node)
    elif fault.action == "stop":
        os.kill(process.pid, signal.SIGSTOP)
        stopped.add(fault.node)
    else:
        os.kill(process.pid, signal.SIGCONT)
        stopped.discard(fault.node)
    run_.at[fault.action, fault.node] = time.monotonic()


def run(args: argparse.Namespace) -> dict[str, Any]:
    faults = schedule(args)
    rng = random.Random(args.seed)
    vocab = load_model(args.model).config.vocab_size
    generator = torch.Generator().manual_seed(args.seed)
    prompts = [torch.randint(3, vocab, (rng.randint(2, args.max_prompt),),
                             generator=generator).tolist() for _ in range(args.requests)]
    expected = reference_tokens(args.model, prompts, args.max_tokens)
    aborted = set(rng.sample(range(args.requests), int(args.abort_fraction * args.requests)))
    config = ClusterConfig.from_options(model=args.model, num_decoders=args.decoders,
                                        num_prefillers=args.prefillers, page_size=8, chunk_size=64,
                                        num_pages=1024, kv_timeout=args.kv_timeout)
    deadline_s = args.kv_timeout * 3 + 30
    # Started before the cluster, so that its tap sees the decoders' handshakes.
    hostile = HostileClient(VICTIM) if args.hostile else None
    run_, stopped, counts = Run(args.requests), set[str](), {}
    watching = threading.Event()
    with LocalCluster(config) as cluster:
        if hostile is not None:
            ports = {parse_address(cluster.decoder_addresses[int(VICTIM[-1])])[1],
                     parse_address(cluster.metrics_addresses[VICTIM])[1]}
            pid = cluster.processes[cluster.names.index(VICTIM)].pid
            hostile.arm(cluster.prefiller_addresses, pid, ports)
        threading.Thread(target=_watch_logs, args=(cluster, watching, run_.seen),
                         daemon=True).start()
        router = Router(cluster.decoder_addresses)
        threading.Thread(target=run_.collect, args=(router,), daemon=True).start()
        pending = list(faults)
        started = time.monotonic()
        try:
            if hostile is not None:
                hostile.go()
            for i, prompt in enumerate(prompts):
                time.sleep(max(0.0, started + i / args.rate - time.monotonic()))
                while pending and pending[0].at_s <= time.monotonic() - started:
                    apply(run_, cluster, pending.pop(0), stopped)
                request_id = f"r{i}"
                run_.submitted[request_id] = time.monotonic()
                try:
                    run_.routed[request_id] = router.route(Submit(request_id, prompt,
                                                                   args.max_tokens))
                except PeerClosedError:  # no decoder takes requests: refused, its one end
                    run_.routed[request_id] = None
                    run_.end(request_id, "refused", None)
                if i in aborted:
                    threading.Timer(rng.uniform(0, 0.3), router.abort,
                                    args=(request_id,)).start()
            finished_in_time = run_.done.wait(deadline_s)
            wall_s = time.monotonic() - started
            for name in list(run_.metrics):
                run_.metrics[name + "@end"] = _scrape(cluster, name)
        finally:
            for name in stopped:  # never leave a node stopped: it could not shut down
                os.kill(cluster.processes[cluster.names.index(name)].pid, signal.SIGCONT)
            if hostile is not None:
                counts = hostile.stop()
            router.close()
            watching.set()
    exit_codes = dict(zip(cluster.names, cluster.exit_codes(), strict=True))
    killed = sorted(f.node for f in faults if f.action == "kill")
    result, ok = summarize(run_, expected, finished_in_time, deadline_s, killed, exit_codes,
                           cluster.logs)
    result.update(aborts_sent=len(aborted), wall_s=round(wall_s, 1),
                  faults_at_s=[f"{f.action} {f.node} @{f.at_s:.1f}" for f in faults])
    for fault in faults:
        if fault.action == "stop" and fault.node.startswith("prefill"):
            address = cluster.prefiller_addresses[int(fault.node.split("-")[1])]
            decoders = [n for n in cluster.names if n.startswith("decode")]
            result["prefiller_freeze"], good = prefiller_freeze(run_, fault.node, address,
                                                                decoders)
            ok = ok and good
        elif fault.action == "stop":
            result["decoder_freeze"], good = decoder_freeze(run_, fault.node)
            ok = ok and good
    if counts:
        rows, good = hostile_rows(run_, counts, VICTIM)
        result.update(rows)
        ok = ok and good
    result["ok"] = ok
    if args.dump:
        Path(args.dump).write_text(json.dumps({
            "started": started, "faults": {f"{a} {n}": t for (a, n), t in run_.at.items()},
            "requests": {r: [run_.submitted[r], run_.routed[r], run_.final.get(r),
                             run_.retries.get(r)] for r in run_.submitted},
            "seen": run_.seen, "logs": cluster.logs}))
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--decoders", type=int, default=3)
    parser.add_argument("--prefillers", type=int, default=2)
    parser.add_argument("--rate", type=float, default=25.0, help="requests per second")
    parser.add_argument("--max-prompt", type=int, default=48)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--abort-fraction", type=float, default=0.1)
    parser.add_argument("--kv-timeout", type=float, default=10.0)
    parser.add_argument("--freeze-prefiller-s", type=float, default=12.0,
                        help="SIGSTOP the last prefiller this long (0: no freeze)")
    parser.add_argument("--freeze-decoder-s", type=float, default=7.0,
                        help="SIGSTOP decode-0 this long (0: no freeze)")
    parser.add_argument("--hostile", action=argparse.BooleanOptionalAction, default=True,
                        help=f"a hostile process attacks {VICTIM} throughout")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dump", help="write each request's timeline and the nodes' logs "
                        "here, as JSON (to dig into a failure)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    try:
        schedule(args)
    except ValueError as error:
        parser.error(str(error))  # one line, exit 2
    result = run(args)
    print_result(result, "load under failure", "--json" in sys.argv)
    sys.exit(0 if result["ok"] else 1)


if __name__ == "__main__":
    main()
