"""Mixed versus disaggregated serving through the OpenAI HTTP API: one seeded request stream,
replayed against `disagg serve cluster` two ways (S1, end to end).

The stream: Poisson arrivals at `--rate` req/s, 80% short prompts (8-32 tokens) and 20% long
ones (256-512), random token ids, `--max-tokens` each, greedy, streamed with the `openai`
client. (a) "disagg": `serve cluster --prefillers 1 --decoders 1`; (b) "mixed":
`serve cluster --mixed 2`. Either way the two node processes are pinned one per core (found
through `GET /health`); the front door process and this client are not pinned: they share
those cores, and the result says how much CPU each used. Each token's time is the arrival of
the stream chunk that carried it (a chunk's `token_ids` extension lists its tokens).
`--stream steady` replays instead the schedule of the in-process benchmark (benchmarks/disagg.py),
whose goal is read in its steady window (a decode batch of about constant size). Mode
"disagg-json" is "disagg" with every request under a JSON schema (`guided_json`, an array of
integers that can run to `max_tokens`): the decoder masks every token (S8), so its tokens/s
beside "disagg" is the cost of the mask.
Each cluster also runs with `--trace`, so that the result holds the decoding nodes' own engine
step times (`step_times.py`: the decoder's, or both mixed nodes'), from the stream's start on:
per batch size the pure-decode steps' count and p50 / p90 ms, and apart from them the steps that
carried a prefill chunk. Beside the client's gaps by batch, they show how much of an inter-token
gap is the engine's step. Tracing costs a span per step (about 20 µs here) and a few per request.
Run: `python benchmarks/serving.py [--model tiny] [--out serving.json]` (defaults: ~3.5 min).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import select
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# The repository root goes first: `import disagg` must find the package, not benchmarks/disagg.py.
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import openai  # noqa: E402
from pinned_cluster import CpuMeter, pin_process, process_cores, wait_for_quiet  # noqa: E402
from result_output import emit  # noqa: E402
from serving_report import print_table, summarize  # noqa: E402
from step_times import read_events, step_summary  # noqa: E402

# Same allocator settings as benchmarks/disagg.py (see MALLOC_TUNING there), for comparability.
MALLOC_TUNING = {"MALLOC_MMAP_THRESHOLD_": str(32 << 20), "MALLOC_TRIM_THRESHOLD_": str(1 << 30)}
MODE_FLAGS = {"disagg": ["--prefillers", "1", "--decoders", "1"], "mixed": ["--mixed", "2"],
              "disagg-json": ["--prefillers", "1", "--decoders", "1"]}
# What each mode's requests add to their body (structured output: the decoder's mask).
JSON_NUMBERS = {"type": "object", "properties": {"values": {"type": "array",
                                                            "items": {"type": "integer"}}},
                "required": ["values"], "additionalProperties": False}
MODE_BODY: dict[str, dict[str, Any]] = {"disagg-json": {"guided_json": JSON_NUMBERS}}


@dataclass(frozen=True, slots=True)
class Arrival:
    """One request of the stream: when it is sent (s after the start) and what it asks."""

    at_s: float
    kind: str  # "short" or "long"
    prompt: list[int]
    max_tokens: int


@dataclass
class Observed:
    """What the client saw of one request (s after the stream's start)."""

    arrival: Arrival
    sent: float = 0.0
    token_times: list[float] = field(default_factory=list)
    chunks: int = 0  # chunks carrying at least one token
    end: float = 0.0
    finish_reason: str | None = None
    usage_tokens: int | None = None  # completion_tokens of the final usage chunk
    error: str | None = None


# `--stream steady`: the in-process benchmark's schedule (benchmarks/disagg.py defaults): short
# prompts with long outputs start together, then long prompts arrive at a fixed interval while
# they decode, so the decode batch stays about the same size in the window the goal is read in.
STEADY = {"num_short": 4, "short_len": 16, "short_max_tokens": 320, "num_long": 14,
          "long_len": 512, "long_max_tokens": 32, "first_long_s": 2.0, "interval_s": 2.5}


def make_stream(args: argparse.Namespace, vocab_size: int) -> list[Arrival]:
    """The seeded stream: exponential gaps at `rate`, short or long prompts (or `STEADY`)."""
    rng = random.Random(args.seed)

    def prompt(length: int) -> list[int]:
        # Skip the lowest ids: special tokens (BOS, EOS) live there in most vocabularies.
        return [rng.randrange(min(16, vocab_size - 1), vocab_size) for _ in range(length)]

    if args.stream == "steady":
        s = STEADY
        return ([Arrival(0.0, "short", prompt(s["short_len"]), s["short_max_tokens"])
                 for _ in range(s["num_short"])]
                + [Arrival(s["first_long_s"] + i * s["interval_s"], "long",
                           prompt(s["long_len"]), s["long_max_tokens"])
                   for i in range(s["num_long"])])
    at, stream = 0.0, []
    for _ in range(args.num_requests):
        kind = "long" if rng.random() < args.long_fraction else "short"
        low, high = args.long_len if kind == "long" else args.short_len
        stream.append(Arrival(at, kind, prompt(rng.randint(low, high)), args.max_tokens))
        at += rng.expovariate(args.rate)
    return stream


class Server:
    """`disagg serve cluster` with `flags` (see `MODE_FLAGS`), its nodes pinned one per core
    (`args.cores`, which must list one core per node); given `trace_dir`, every process traces
    there (`<node name>.json` each, written as it exits)."""

    def __init__(self, args: argparse.Namespace, flags: list[str], log: Path,
                 trace_dir: Path | None = None) -> None:
        tracing: list[str] = []
        if trace_dir is not None:
            # `--trace` takes a path that is not an existing directory as one file for every
            # process: the directory must be there first.
            trace_dir.mkdir(parents=True, exist_ok=True)
            tracing = ["--trace", str(trace_dir)]
        command = [sys.executable, "-m", "disagg.apps.cli", "serve", "cluster",
                   "--model", args.model, "--port", "0", "--served-model-name", "bench",
                   "--page-size", str(args.page_size), "--num-pages", str(args.num_pages),
                   "--chunk-size", str(args.chunk_size), *tracing, *flags]
        env = dict(os.environ, **({} if args.malloc_defaults else MALLOC_TUNING))
        self.log = log
        self.trace_dir = trace_dir
        with log.open("w") as stderr:
            self.process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=stderr,
                                            text=True, env=env, cwd=ROOT)
        try:
            self.url = self._wait_ready(180.0)
            listed = self.health()["nodes"]
            self.nodes = [(n["name"], n["pid"]) for n in listed]
            self.decoding = [n["name"] for n in listed if n["role"] != "prefill"]
            for (_, pid), core in zip(self.nodes, args.cores, strict=True):
                pin_process(pid, core)
        except BaseException:
            self.stop()
            raise

    def _wait_ready(self, timeout_s: float) -> str:
        assert self.process.stdout is not None
        ready, _, _ = select.select([self.process.stdout], [], [], timeout_s)
        line = self.process.stdout.readline() if ready else ""
        if not line.startswith("READY "):  # the caller stops the process
            raise RuntimeError(f"serve cluster did not start: {line!r} "
                               f"{self.log.read_text()[-2000:]}")
        return line.split()[1]

    def health(self) -> dict[str, Any]:
        with urllib.request.urlopen(self.url + "/health", timeout=30) as reply:
            return json.loads(reply.read())

    def affinity(self) -> dict[str, list[int]]:
        return {name: process_cores(pid) for name, pid in self.nodes}

    def step_times(self, since_s: float) -> dict[str, Any]:
        """The decoding nodes' engine steps from `since_s` (epoch s) on (`step_summary`), and
        which of their trace files are missing. Read after `stop`: nodes write them at exit."""
        if self.trace_dir is None:
            raise ValueError("this server was started without a trace directory")
        events, missing = read_events(self.trace_dir / f"{name}.json" for name in self.decoding)
        return step_summary(events, since_us=since_s * 1e6) | {"step_traces_missing": missing}

    def stop(self) -> int:
        """SIGINT, as a user's Ctrl-C; the exit code (0: every node stopped clean)."""
        self.process.send_signal(signal.SIGINT)
        try:
            return self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.process.kill()
            return self.process.wait()


async def send(client: openai.AsyncOpenAI, arrival: Arrival, start: float,
               extra_body: dict[str, Any] | None = None) -> Observed:
    """Wait for the request's time, stream it, note when each token came."""
    seen = Observed(arrival)
    await asyncio.sleep(max(0.0, start + arrival.at_s - time.perf_counter()))
    seen.sent = time.perf_counter() - start
    try:
        stream = await client.completions.create(
            model="bench", prompt=arrival.prompt, max_tokens=arrival.max_tokens,
            temperature=0, stream=True, stream_options={"include_usage": True},
            extra_body=extra_body)
        async for chunk in stream:
            now = time.perf_counter() - start
            if chunk.usage is not None:
                seen.usage_tokens = chunk.usage.completion_tokens
            for choice in chunk.choices:
                ids = (choice.model_extra or {}).get("token_ids") or []
                seen.token_times += [now] * len(ids)
                seen.chunks += bool(ids)
                seen.finish_reason = choice.finish_reason or seen.finish_reason
    except openai.OpenAIError as error:
        seen.error = f"{type(error).__name__}: {error}"
    seen.end = time.perf_counter() - start
    return seen


async def replay(url: str, stream: list[Arrival], warmup: int, timeout_s: float,
                 extra_body: dict[str, Any] | None = None
                 ) -> tuple[list[Observed], float, float]:
    """A few warm-up requests at once (not counted), then the stream; (requests, wall s, the
    stream's start in epoch s: where the nodes' traces begin to count)."""
    async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0,
                                  timeout=timeout_s) as client:
        short = next((a for a in stream if a.kind == "short"), stream[0])
        await asyncio.gather(*[send(client, Arrival(0.0, "warmup", short.prompt, 4),
                                    time.perf_counter(), extra_body) for _ in range(warmup)])
        start, started_at = time.perf_counter(), time.time()
        seen = await asyncio.wait_for(
            asyncio.gather(*[send(client, a, start, extra_body) for a in stream]), timeout_s)
        return list(seen), time.perf_counter() - start, started_at


def run_mode(args: argparse.Namespace, mode: str, stream: list[Arrival]) -> dict[str, Any]:
    """Start the server, wait for a quiet machine, replay the stream, stop it, read its
    decoding nodes' step times."""
    with tempfile.TemporaryDirectory(prefix=f"serving-{mode}-") as scratch:
        server = Server(args, MODE_FLAGS[mode], Path(scratch) / "server.log",
                        Path(scratch) / "trace")
        try:
            pids = {**dict(server.nodes), "front door": server.process.pid, "client": os.getpid()}
            quiet = wait_for_quiet(list(pids.values()), args.quiet_wait_s)
            meters = {name: CpuMeter([pid]) for name, pid in pids.items()}
            machine = CpuMeter(list(pids.values()))
            observed, wall, started_at = asyncio.run(replay(
                server.url, stream, args.warmup, args.timeout_s, MODE_BODY.get(mode)))
            ncpu = os.cpu_count() or 1
            cpu = {name: meter.read()["ours"] * ncpu for name, meter in meters.items()}
            cpu["others"] = machine.read()["others"] * ncpu
            affinity = server.affinity()
        finally:
            code = server.stop()
        log_tail = server.log.read_text()[-2000:] if code else ""
        steps = server.step_times(started_at)
    return {"mode": mode, "observed": observed, "wall_s": wall, "quiet": quiet,
            "cpu_cores": cpu, "affinity": affinity, "server_exit_code": code,
            "server_log_tail": log_tail, "engine_steps": steps}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options (defaults: the few-minute SmolLM2 run)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add = parser.add_argument
    add("--model", default="smollm2-135m", help="smollm2-135m, tiny, small or a checkpoint dir")
    add("--stream", choices=["poisson", "steady"], default="poisson",
        help="poisson: the seeded stream below; steady: the in-process benchmark's schedule")
    add("--modes", nargs="+", choices=list(MODE_FLAGS), default=["disagg", "mixed"],
        help="disagg-json: disagg under a JSON schema (the structured-output mask's cost)")
    add("--rate", type=float, default=0.5, help="mean arrivals per second (Poisson)")
    add("--num-requests", type=int, default=40)
    add("--seed", type=int, default=0)
    add("--long-fraction", type=float, default=0.2, help="share of long prompts")
    add("--short-len", type=int, nargs=2, default=[8, 32], metavar=("MIN", "MAX"))
    add("--long-len", type=int, nargs=2, default=[256, 512], metavar=("MIN", "MAX"))
    add("--max-tokens", type=int, default=32, help="output tokens asked of every request")
    add("--page-size", type=int, default=16)
    add("--num-pages", type=int, default=512, help="KV pages per node")
    add("--chunk-size", type=int, default=256, help="prefill chunk (and step token budget)")
    add("--cores", default="0,1", help="the two cores the two nodes are pinned to")
    add("--warmup", type=int, default=2, help="short requests sent first, not counted")
    add("--quiet-wait-s", type=float, default=20.0, help="longest wait for an idle machine")
    add("--timeout-s", type=float, default=600.0, help="longest a stream may take")
    add("--malloc-defaults", action="store_true", help="leave glibc's malloc thresholds alone")
    add("--out", type=Path, help="write the JSON result here")
    add("--json", action="store_true", help="print the JSON instead of the table")
    args = parser.parse_args(argv)
    args.cores = two_cores(parser, args.cores)
    if args.rate <= 0 or args.num_requests < 1:
        parser.error("--rate must be > 0 and --num-requests >= 1")
    return args


def two_cores(parser: argparse.ArgumentParser, cores: str) -> list[int]:
    """`--cores` as two core ids this process may use (the parser's error otherwise)."""
    ids = [int(c) for c in cores.split(",")]
    if len(ids) != 2 or not set(ids) <= os.sched_getaffinity(0):
        parser.error(f"--cores: need two cores among {sorted(os.sched_getaffinity(0))}")
    return ids


def main(argv: list[str] | None = None) -> None:
    """Replay the stream against every mode; print the table, write the JSON."""
    args = parse_args(argv)
    from disagg.model.loading.registry import load_model

    config = load_model(args.model).config
    stream = make_stream(args, config.vocab_size)
    longest = max(len(a.prompt) + a.max_tokens for a in stream)
    if longest > args.page_size * args.num_pages:
        sys.exit(f"a request of {longest} tokens does not fit {args.num_pages} pages")
    runs = {mode: run_mode(args, mode, stream) for mode in args.modes}
    emit(args, summarize(args, runs), print_table)
    if any(run["server_exit_code"] for run in runs.values()):
        sys.exit("a server did not stop cleanly: see server_exit_code in the JSON")


if __name__ == "__main__":
    main()
