"""NIXL (UCX backend) on the peer transfer workload: a measurement harness, not project code.

Runs both sides: this process is the initiator, a spawned process owns the target region.
`--transport tcp` forces UCX onto TCP over loopback (UCX_TLS=tcp, UCX_NET_DEVICES=lo);
`--transport shm` lets UCX pick its same-host paths (UCX_TLS=sm,self: shared memory + CMA).
Prints ONE JSON object on stdout (keys of `workload.PeerResult`), or one with `error` and
exit status 2 when NIXL cannot run. Needs `.venv-peers` (benchmarks/peers/setup_peers.sh).
Compared against our S5 transfer core by benchmarks/transfer_compare.py.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import sys
import time
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
from workload import (
    LATENCY_BYTES,
    WorkloadConfig,
    add_workload_args,
    claim_stdout,
    config_from_args,
    emit,
    expected_digest,
    fail,
    latency_offsets,
    log,
    make_permutation,
    make_source,
    region_digest,
    summarise,
    timed,
)

ENGINE = "nixl-ucx"
# UCX_MODULES=^ib: the wheel's InfiniBand module drags in a bundled libnl-route whose library
# destructor segfaults at process exit (NIXL 1.5.1, exit status -11 after a good run); there
# is no IB device here anyway.
UCX_ENV = {
    "tcp": {"UCX_TLS": "tcp", "UCX_NET_DEVICES": "lo", "UCX_MODULES": "^ib"},
    "shm": {"UCX_TLS": "sm,self", "UCX_MODULES": "^ib"},
}
# UCX's shared-memory transports cannot detect a dead peer, and NIXL asks for that by default
# ("peer" mode): without "none" UCX finds no usable same-host lane at all.
BACKEND_PARAMS = {
    "tcp": {},
    "shm": {"ucx_error_handling_mode": "none"},
}
DEADLINE_S = 60.0


def _agent(name: str, transport: str, progress_thread: bool) -> Any:
    # Imported late: the UCX_* variables must be in the environment before UCX loads.
    from nixl_cu12._api import nixl_agent, nixl_agent_config

    conf = nixl_agent_config(enable_prog_thread=progress_thread, backends=[])
    agent = nixl_agent(name, conf)
    agent.create_backend("UCX", dict(BACKEND_PARAMS[transport]))
    return agent


def _descs(base: int, offsets: np.ndarray, nbytes: int) -> np.ndarray:
    """Nx3 (address, length, device id) rows, the descriptor form NIXL takes from numpy."""
    rows = np.zeros((len(offsets), 3), dtype=np.uint64)
    rows[:, 0] = base + offsets.astype(np.uint64)
    rows[:, 1] = nbytes
    return rows


def _target(conn: Connection, cfg: WorkloadConfig, transport: str, progress_thread: bool) -> None:
    """Own the destination region; hash it when asked; NIXL's threads serve the writes."""
    agent = _agent("target", transport, progress_thread)
    dst = np.zeros(cfg.region_bytes, dtype=np.uint8)
    reg = agent.register_memory(_descs(dst.ctypes.data, np.zeros(1), dst.nbytes), "DRAM")
    conn.send((agent.get_agent_metadata(), dst.ctypes.data))
    while True:
        # Without a progress thread the target must drive UCX itself while it waits.
        if not progress_thread:
            while not conn.poll(0):
                agent.get_new_notifs()
        msg = conn.recv()
        if msg == "digest":
            conn.send(region_digest(dst))
        elif msg == "exit":
            agent.deregister_memory(reg)
            return


def _wait(agent: Any, handle: Any) -> None:
    state = agent.transfer(handle)
    deadline = time.monotonic() + DEADLINE_S
    while state == "PROC":
        state = agent.check_xfer_state(handle)
        if time.monotonic() > deadline:
            raise TimeoutError(f"NIXL transfer still in progress after {DEADLINE_S} s")
    if state != "DONE":
        raise RuntimeError(f"NIXL transfer state {state!r}")


def _measure(
    agent: Any, conn: Connection, cfg: WorkloadConfig, src: np.ndarray, perm: np.ndarray
) -> tuple[list[float], list[float]]:
    """Prepare both transfers once, warm up, then time the batch and the single write."""
    base = src.ctypes.data
    if not conn.poll(DEADLINE_S):
        raise TimeoutError("target did not publish its metadata")
    meta, dst_base = conn.recv()
    remote = agent.add_remote_agent(meta)
    pages = np.arange(cfg.pages, dtype=np.int64) * cfg.page_bytes
    lat_src, lat_dst = latency_offsets(cfg, perm)
    dlists = [
        agent.prep_xfer_dlist("NIXL_INIT_AGENT", _descs(base, pages, cfg.page_bytes), "DRAM"),
        agent.prep_xfer_dlist(remote, _descs(dst_base, pages, cfg.page_bytes), "DRAM"),
        agent.prep_xfer_dlist(
            "NIXL_INIT_AGENT", _descs(base, np.array([lat_src]), LATENCY_BYTES), "DRAM"
        ),
        agent.prep_xfer_dlist(remote, _descs(dst_base, np.array([lat_dst]), LATENCY_BYTES), "DRAM"),
    ]
    # The permutation lives in the remote index list: local page i goes to remote slot perm[i].
    batch = agent.make_prepped_xfer(
        "WRITE", dlists[0], np.arange(cfg.pages, dtype=np.int32), dlists[1], perm.astype(np.int32)
    )
    single = agent.make_prepped_xfer("WRITE", dlists[2], [0], dlists[3], [0])
    try:
        agent.make_connection(remote)
        for _ in range(cfg.warmup):
            _wait(agent, batch)
            _wait(agent, single)
        batch_s = [timed(lambda: _wait(agent, batch)) for _ in range(cfg.iters)]
        latency_s = [timed(lambda: _wait(agent, single)) for _ in range(cfg.latency_iters)]
    finally:
        # Release in dependency order rather than leave it to the garbage collector.
        for handle in (single, batch, *dlists):
            handle.release()
        agent.remove_remote_agent(remote)
    return batch_s, latency_s


def run(cfg: WorkloadConfig, transport: str, progress_thread: bool) -> int:
    for key, value in UCX_ENV[transport].items():
        os.environ.setdefault(key, value)  # a caller's own UCX_* setting wins (for sweeps)
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_target, args=(child, cfg, transport, progress_thread), daemon=True)
    proc.start()
    stage = "setup"
    try:
        src = make_source(cfg)
        perm = make_permutation(cfg)
        want = expected_digest(src, perm)
        agent = _agent("initiator", transport, progress_thread)
        reg = agent.register_memory(_descs(src.ctypes.data, np.zeros(1), src.nbytes), "DRAM")
        stage = "transfer"
        batch_s, latency_s = _measure(agent, parent, cfg, src, perm)
        agent.deregister_memory(reg)
        del agent
        stage = "verify"
        parent.send("digest")
        if not parent.poll(DEADLINE_S):
            raise TimeoutError("target did not answer with its digest")
        verified = parent.recv() == want
        parent.send("exit")
        proc.join(timeout=DEADLINE_S)
        if proc.exitcode != 0:
            raise RuntimeError(f"target process exit code {proc.exitcode}")
    except Exception as exc:  # the harness reports any failure as its JSON line
        return fail(ENGINE, transport, stage, exc)
    finally:
        if proc.is_alive():
            proc.terminate()
    config = {k: v for k, v in sorted(os.environ.items()) if k.startswith("UCX_")}
    config["progress_thread"] = str(progress_thread)
    config.update(BACKEND_PARAMS[transport])
    result = summarise(ENGINE, transport, cfg, batch_s, latency_s, verified, config)
    emit(result.to_json())
    return 0 if verified else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--transport", choices=sorted(UCX_ENV), default="tcp")
    parser.add_argument(
        "--progress-thread", action="store_true",
        help="use NIXL's own progress thread (its default; on 2 cores three spinning threads "
        "starve each other, so the harness drives UCX from the caller's threads instead)",
    )
    add_workload_args(parser)
    args = parser.parse_args()
    claim_stdout()
    cfg = config_from_args(args)
    try:
        import nixl_cu12  # noqa: F401
    except ImportError as exc:
        return fail(ENGINE, args.transport, "import nixl_cu12 (run setup_peers.sh)", exc)
    log(f"nixl: {args.transport} {cfg.pages} x {cfg.page_bytes} B")
    return run(cfg, args.transport, progress_thread=args.progress_thread)


if __name__ == "__main__":
    sys.exit(main())
