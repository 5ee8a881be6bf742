"""Load under failure through the HTTP front door (X5a-X5e): `load.py`'s chaos run, every
request a streamed `/v1/completions` over real HTTP to `disagg serve cluster`, with the
isolation faults added.

Starts `serve cluster` as a subprocess (tiny model, tcp on loopback, its nodes supervised,
our cluster secret in its environment) and sends N streamed requests at a steady rate; a
fraction of the clients hang up at a random moment. On a timeline scaled to the run
(`schedule`): a router that submits long requests to decode-0 and never reads
(`StalledRouter`); a second control connection on every decoder that aborts and submits the
front door's in-flight ids (`CollidingRouter`); a router that leaves decode-0 mid-decode
(`LeavingRouter`); SIGKILL a TP rank of the last decoder (`--decode-tp 2`, the
default: the node exits by itself; at TP 1 the decoder), its node's pid from `/health`: the
supervisor starts the node again. Once it is back, a few more requests are sent. The promises: every request reaches
exactly one terminal state in time (finished, refused with 429/503, failed with its reason,
or aborted by its own client); every finished request decoded the single-node engine's
tokens; every collided front-door request finishes untouched; the killed decoder is
restarted and the requests sent after that finish; pages back to 0 on every node at the end;
the server exits 0 (each node's leak check) and no node process outlives it. Whether the
stalled router was cut off, and after how long, is reported, not promised (the outbox cuts a
peer off only once its backlog outgrows the socket buffers). Prints load.py's table
(`load_report.summarize`) plus a row per fault, or one JSON object with `--json`.
Run: `python benchmarks/load_http.py [--requests 1000] [--rate 25]`.
"""

from __future__ import annotations

import argparse
import collections
import http.client
import json
import os
import random
import secrets
import signal
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from http_chaos import CollidingRouter, LeavingRouter, StalledRouter  # noqa: E402
from http_cluster import ServeCluster  # noqa: E402
from load import reference_tokens  # noqa: E402
from load_report import FINISHED, Run, print_result, summarize  # noqa: E402

from disagg.model.loading.registry import load_model  # noqa: E402

COLLIDE_EVERY = 5  # in the collision window, every 5th request is long and collided with
COLLISION_CAUSES = ("aborted", "invalid_request")  # a front-door request the intruder hit
HANG_UP_S = 0.05  # a client that hangs up does so this soon at most (8 tokens take ~0.1 s)
PAGES_SETTLE_S = 30.0  # for the nodes' pages to drain once the traffic has ended
RESTART_TIMEOUT_S = 120.0


class Fault(NamedTuple):
    """At `at_s` into the run, `action` (stall, collide, leave, kill)."""

    at_s: float
    action: str


def schedule(args: argparse.Namespace) -> list[Fault]:
    """The faults, in time order, as fractions of the run's sending window.

    >>> [f"{f.action} {f.at_s:g}" for f in schedule(argparse.Namespace(requests=100, rate=10))]
    ['stall 1', 'collide 2', 'leave 3', 'kill 4.5']
    """
    window = args.requests / args.rate
    return [Fault(0.1 * window, "stall"), Fault(0.2 * window, "collide"),
            Fault(0.3 * window, "leave"), Fault(0.45 * window, "kill")]


class Client:
    """One streamed completion per call, its terminal state recorded once in `run`."""

    def __init__(self, url: str, model: str, max_tokens: int, deadline_s: float,
                 run: Run) -> None:
        self.host, port = url.removeprefix("http://").rsplit(":", 1)
        self.port, self.model, self.max_tokens = int(port), model, max_tokens
        self.deadline_s, self.run = deadline_s, run
        self.request_ids: dict[str, str] = {}  # ours (r<i>) -> the front door's (uuid hex)

    def complete(self, rid: str, prompt: list[int], hang_up_s: float | None,
                 max_tokens: int | None = None,
                 on_first: Callable[[str, str], None] | None = None) -> None:
        """Send one request; `on_first(rid, front door id)` runs once its first chunk came."""
        max_tokens = max_tokens or self.max_tokens
        body = json.dumps({"model": self.model, "prompt": prompt, "max_tokens": max_tokens,
                           "temperature": 0, "stream": True}).encode()
        connection = http.client.HTTPConnection(self.host, self.port, timeout=self.deadline_s)
        self.run.submitted[rid] = time.monotonic()
        try:
            connection.request("POST", "/v1/completions", body,
                               {"Content-Type": "application/json"})
            reply = connection.getresponse()
            if reply.status in (429, 503):
                reply.read()
                self.run.end(rid, "refused", str(reply.status))
            elif reply.status != 200:
                reply.read()
                self.run.end(rid, "finished_failed", f"http_{reply.status}")
            else:
                self.run.end(rid, *self._read_stream(rid, reply, hang_up_s, on_first))
        except (OSError, http.client.HTTPException, ValueError) as error:
            self.run.end(rid, "finished_failed", f"client_{type(error).__name__}")
        finally:
            connection.close()

    def _read_stream(self, rid: str, reply: http.client.HTTPResponse,
                     hang_up_s: float | None,
                     on_first: Callable[[str, str], None] | None) -> tuple[str, str | None]:
        started, finish = time.monotonic(), None
        for raw in reply:
            if hang_up_s is not None and time.monotonic() - started > hang_up_s:
                return "finished_aborted", "aborted"  # we close the connection: a client gone
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                error = chunk["error"]
                return "finished_failed", str(error.get("code") or error.get("type"))
            if rid not in self.request_ids:
                self.request_ids[rid] = chunk["id"].split("-", 1)[1]
                if on_first is not None:
                    on_first(rid, self.request_ids[rid])
            for choice in chunk["choices"]:
                self.run.tokens[rid] += choice.get("token_ids") or []
                finish = choice.get("finish_reason") or finish
        if finish == "length":
            return "finished_length", None
        if finish == "stop":
            return "finished_stopped", None
        return "finished_failed", f"stream_ended:{finish}"


class Chaos:
    """The faults' state during the run, and what each one showed."""

    def __init__(self, server: ServeCluster, secret: bytes, prompt: list[int]) -> None:
        self.server, self.secret, self.prompt = server, secret, prompt
        body = server.health()
        self.nodes = {n["name"]: n for n in body["nodes"]}
        for node in body["nodes"]:
            server.note_ranks(node["pid"])
        self.decoders = [n["address"] for n in body["nodes"] if n["role"] == "decode"]
        self.stalled: StalledRouter | None = None
        self.colliding: CollidingRouter | None = None
        self.leaving: LeavingRouter | None = None
        self.leaving_probe: dict[str, int] = {}
        self.collided: set[str] = set()
        self.killed: dict[str, Any] = {}
        self.restarted = threading.Event()

    def apply(self, fault: Fault) -> None:
        if fault.action == "stall":
            self.stalled = StalledRouter(self.decoders[0], self.secret, self.prompt)
        elif fault.action == "collide":
            self.colliding = CollidingRouter(self.decoders, self.secret, self.prompt)
        elif fault.action == "leave":
            threading.Thread(target=self._leave, daemon=True).start()
        elif fault.action == "kill":
            self._kill()

    def _leave(self) -> None:
        self.leaving = LeavingRouter(self.decoders[0], self.secret, self.prompt)
        self.leaving_probe = self.leaving.probe()

    def _kill(self) -> None:
        """SIGKILL the last decoder's last TP rank (the node then exits by itself, S3c), or
        the decoder itself at TP 1; the supervisor restarts the node (X5e)."""
        name = [n for n in self.nodes if n.startswith("decode-")][-1]
        victim = self.server.health()
        node = {n["name"]: n for n in victim["nodes"]}[name]
        ranks = self.server.note_ranks(node["pid"])
        os.kill(ranks[-1] if ranks else node["pid"], signal.SIGKILL)
        self.killed = {"node": name, "pid": node["pid"], "at": time.monotonic(),
                       "sigkilled": f"tp rank {len(ranks)} (pid {ranks[-1]})" if ranks
                       else "the node process"}
        threading.Thread(target=self._await_restart, args=(name, node["pid"]),
                         daemon=True).start()

    def _await_restart(self, name: str, old_pid: int) -> None:
        def back(body: dict[str, Any]) -> bool:
            entry = {n["name"]: n for n in body["nodes"]}[name]
            return (entry["restarts"] >= 1 and entry["state"] == "ok"
                    and entry["pid"] not in (None, old_pid))
        body = self.server.health_until(back, RESTART_TIMEOUT_S)
        if body is not None:
            entry = {n["name"]: n for n in body["nodes"]}[name]
            self.killed.update(back_after_s=round(time.monotonic() - self.killed["at"], 1),
                               new_pid=entry["pid"], restarts=entry["restarts"],
                               new_ranks=len(self.server.note_ranks(entry["pid"])))
            self.killed["back_at"] = time.monotonic()
            self.restarted.set()

    def collide(self, rid: str, request_id: str) -> None:
        """A long front-door request just streamed its first tokens: collide with its id
        while the decoder still holds it."""
        if self.colliding is not None:
            self.collided.add(rid)
            self.colliding.collide(request_id)


def run(args: argparse.Namespace) -> dict[str, Any]:
    faults = schedule(args)
    rng = random.Random(args.seed)
    vocab = load_model(args.model).config.vocab_size
    generator = torch.Generator().manual_seed(args.seed)
    total = args.requests + args.after_restart
    prompts = [torch.randint(3, vocab, (rng.randint(2, args.max_prompt),),
                             generator=generator).tolist() for _ in range(total)]
    # Greedy: a request's first n tokens do not depend on its max_tokens, so one reference
    # run at the long length serves the short requests too (a prefix of it).
    reference = reference_tokens(args.model, prompts, max(args.max_tokens, args.long_tokens))
    lengths = [args.max_tokens] * total
    window = args.requests / args.rate
    collided_at = {i for i in range(args.requests) if i % COLLIDE_EVERY == 0
                   and 0.25 * window <= i / args.rate < 0.8 * window}
    for i in collided_at:
        lengths[i] = args.long_tokens
    expected = [tokens[:n] for tokens, n in zip(reference, lengths, strict=True)]
    hang_ups = set(rng.sample(range(args.requests), int(args.hang_up_fraction * args.requests)))
    deadline_s = args.kv_timeout * 3 + 30
    secret = secrets.token_hex(32)
    server = ServeCluster(["--model", args.model, "--prefillers", str(args.prefillers),
                           "--decoders", str(args.decoders), "--page-size", "8",
                           "--num-pages", "1024", "--chunk-size", "64",
                           "--decode-tp", str(args.decode_tp),
                           "--kv-timeout", str(args.kv_timeout)], secret)
    server.start()
    run_ = Run(total)
    try:
        if server.health_until(lambda body: body["status"] == "ok", 60) is None:
            raise RuntimeError(f"the cluster never became healthy: {server.health()}")
        chaos = Chaos(server, secret.encode(), prompts[0])
        client = Client(server.url, args.model, args.max_tokens, deadline_s, run_)
        pending = list(faults)
        started = time.monotonic()
        with ThreadPoolExecutor(max_workers=args.max_clients) as pool:
            futures = []
            for i in range(args.requests):
                time.sleep(max(0.0, started + i / args.rate - time.monotonic()))
                while pending and pending[0].at_s <= time.monotonic() - started:
                    fault = pending.pop(0)
                    chaos.apply(fault)
                    run_.at[fault.action, "run"] = time.monotonic()
                hang_up = rng.uniform(0, HANG_UP_S) if i in hang_ups else None
                futures.append(pool.submit(client.complete, f"r{i}", prompts[i], hang_up,
                                           lengths[i],
                                           chaos.collide if i in collided_at else None))
            restarted = chaos.restarted.wait(RESTART_TIMEOUT_S)
            after = [f"r{i}" for i in range(args.requests, total)]
            for rid in after:  # sent one by one once the killed decoder is back
                futures.append(pool.submit(client.complete, rid, prompts[int(rid[1:])], None))
                time.sleep(1 / args.rate)
            for future in futures:
                future.result()
        wall_s = time.monotonic() - started
        pages = _pages_settled(server)
        stalled = chaos.stalled.close() if chaos.stalled else None
        colliding = chaos.colliding.close() if chaos.colliding else None
    finally:
        exit_code = server.stop()
    leaked = server.leaked()
    finished_in_time = len(run_.final) == total
    killed = chaos.killed.get("node")
    rows, ok = summarize(run_, expected, finished_in_time, deadline_s,
                         [killed] if killed else [],
                         {"serve cluster": exit_code}, {"serve cluster": server.logs})
    rows.pop("routed_per_decoder")  # the router is inside the server: not seen from HTTP
    rows.pop("checksum_retried_or_failed")  # retries are inside the server too
    rows.pop("retries_by_cause")
    collided = sorted(chaos.collided, key=lambda r: int(r[1:]))
    # What the intruder could have done to them: ended them (an abort the front door did not
    # ask for) or made them fail as a duplicate. A collided request on the decoder that was
    # killed fails for that (engine_error, decoder_died), which is the kill's doing.
    collided_hurt = [r for r in collided if run_.state(r) == "finished_failed"
                     and run_.cause(r) in COLLISION_CAUSES]
    after_outcomes = run_.outcomes(after)
    rows.update({
        "wall_s": round(wall_s, 1), "outcomes": run_.outcomes(list(run_.submitted)),
        "stalled_router": stalled,
        "leaving_router": {"decoder": chaos.decoders[0], "left": chaos.leaving is not None,
                           "its_ids_1s_after": chaos.leaving_probe},
        "colliding_router": colliding, "collided_front_door_requests": {
            "count": len(collided), "outcomes": run_.outcomes(collided),
            "hurt": collided_hurt[:10]},
        "killed_decoder": {k: v for k, v in chaos.killed.items() if k not in ("at", "back_at")},
        # The other decoder (the stalled router's) alone took these: did it keep serving?
        "while_killed_decoder_down": run_.outcomes(run_.submitted_in(
            chaos.killed.get("at", 0.0), chaos.killed.get("back_at", float("inf")))),
        "after_restart": after_outcomes,
        "pages_in_use_at_end": pages, "server_exit_code": exit_code, "leaked_pids": leaked,
    })
    ok = (ok and not collided_hurt and restarted and killed is not None
          and set(after_outcomes) <= set(FINISHED) and len(after) > 0
          and pages and all(v == 0 for v in pages.values()) and not leaked
          and colliding is not None and colliding["rejects"] > 0
          and chaos.leaving is not None
          and chaos.leaving_probe == {"released": len(chaos.leaving.ids)})
    rows["ok"] = bool(ok)
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1) + "\n")
    return rows


def _pages_settled(server: ServeCluster) -> dict[str, float]:
    """Each node's pages in use, once all are 0 or `PAGES_SETTLE_S` has passed."""
    deadline = time.monotonic() + PAGES_SETTLE_S
    while True:
        pages = server.pages_in_use()
        if (pages and all(v == 0 for v in pages.values())) or time.monotonic() > deadline:
            return pages
        time.sleep(0.5)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--decoders", type=int, default=2)
    parser.add_argument("--prefillers", type=int, default=2)
    parser.add_argument("--decode-tp", type=int, default=2,
                        help="decoder TP degree; above 1 a TP rank is killed, not the decoder")
    parser.add_argument("--after-restart", type=int, default=10,
                        help="requests sent once the killed decoder is back")
    parser.add_argument("--max-clients", type=int, default=128,
                        help="client threads (concurrent HTTP requests at most)")
    parser.add_argument("--rate", type=float, default=25.0, help="requests per second")
    parser.add_argument("--max-prompt", type=int, default=48)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--long-tokens", type=int, default=64,
                        help="max_tokens of the requests the colliding router collides with")
    parser.add_argument("--hang-up-fraction", type=float, default=0.1)
    parser.add_argument("--kv-timeout", type=float, default=10.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", help="also write the result here, as JSON")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    result = run(args)
    print_result(result, "load under failure, through HTTP", args.json)
    sys.exit(0 if result["ok"] else 1)


if __name__ == "__main__":
    main()
