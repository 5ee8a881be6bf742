"""Mooncake TransferEngine (TCP transport) on the peer workload: a measurement harness only.

Runs both sides: this process is the initiator, a spawned process owns the target region.
Both engines start with metadata server "P2PHANDSHAKE" (peers exchange segment metadata over
their own RPC port, so no etcd is needed) and protocol "tcp", bound to 127.0.0.1. Mooncake has
no same-host transport on CPU memory, so only `--transport tcp` exists. Prints ONE JSON object
on stdout (keys of `workload.PeerResult`), or one with `error` and exit status 2.
Compared against our S5 transfer core by benchmarks/transfer_compare.py.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import sys
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
    page_offsets,
    region_digest,
    summarise,
    timed,
)

ENGINE = "mooncake"
HOST = "127.0.0.1"
MC_ENV = {"MC_TCP_BIND_ADDRESS": HOST}
DEADLINE_S = 60.0


class MooncakeError(RuntimeError):
    """A Mooncake call returned a non-zero status."""


def _check(what: str, status: int) -> None:
    if status != 0:
        raise MooncakeError(f"{what} returned {status}")


def _engine() -> Any:
    # Imported late: MC_* variables must be set before the engine reads them.
    from mooncake.engine import TransferEngine

    engine = TransferEngine()
    _check("initialize", engine.initialize(HOST, "P2PHANDSHAKE", "tcp", ""))
    return engine


def _target(conn: Connection, cfg: WorkloadConfig) -> None:
    """Own the destination region; Mooncake's own server threads land the writes."""
    engine = _engine()
    dst = np.zeros(cfg.region_bytes, dtype=np.uint8)
    _check("register_memory", engine.register_memory(dst.ctypes.data, dst.nbytes))
    conn.send((f"{HOST}:{engine.get_rpc_port()}", dst.ctypes.data))
    while True:
        msg = conn.recv()
        if msg == "digest":
            conn.send(region_digest(dst))
        elif msg == "exit":
            return


Addrs = list[int]


def _write_async(engine: Any, session: str, src: Addrs, dst: Addrs, nbytes: list[int]) -> None:
    """Submit the whole batch, then wait on its status (that call blocks until it is done)."""
    batch_id = engine.batch_transfer_async_write(session, src, dst, nbytes)
    if batch_id == 0:  # the binding's "submit failed"; valid ids are opaque non-zero handles
        raise MooncakeError("batch_transfer_async_write failed to submit")
    _check("get_batch_transfer_status", engine.get_batch_transfer_status([batch_id]))


def _write_sync(engine: Any, session: str, src: Addrs, dst: Addrs, nbytes: list[int]) -> None:
    _check("batch_transfer_sync_write", engine.batch_transfer_sync_write(session, src, dst, nbytes))


def run(cfg: WorkloadConfig, mode: str) -> int:
    for key, value in MC_ENV.items():
        os.environ.setdefault(key, value)
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_target, args=(child, cfg), daemon=True)
    proc.start()
    stage = "setup"
    try:
        src = make_source(cfg)
        perm = make_permutation(cfg)
        want = expected_digest(src, perm)
        engine = _engine()
        base = src.ctypes.data
        _check("register_memory", engine.register_memory(base, src.nbytes))
        if not parent.poll(DEADLINE_S):
            raise TimeoutError("target did not publish its session")
        session, dst_base = parent.recv()
        src_off, dst_off = page_offsets(cfg, perm)
        srcs = [base + int(o) for o in src_off]
        dsts = [dst_base + int(o) for o in dst_off]
        lens = [cfg.page_bytes] * cfg.pages
        lat_src, lat_dst = latency_offsets(cfg, perm)
        write = _write_async if mode == "async" else _write_sync

        stage = "transfer"
        one = ([base + lat_src], [dst_base + lat_dst], [LATENCY_BYTES])

        def batch() -> None:
            write(engine, session, srcs, dsts, lens)

        def single() -> None:
            write(engine, session, *one)

        for _ in range(cfg.warmup):
            batch()
            single()
        batch_s = [timed(batch) for _ in range(cfg.iters)]
        latency_s = [timed(single) for _ in range(cfg.latency_iters)]

        stage = "verify"
        parent.send("digest")
        if not parent.poll(DEADLINE_S):
            raise TimeoutError("target did not answer with its digest")
        verified = parent.recv() == want
        parent.send("exit")
    except Exception as exc:  # the harness reports any failure as its JSON line
        return fail(ENGINE, "tcp", stage, exc)
    finally:
        proc.join(timeout=10)
        if proc.is_alive():
            proc.terminate()
    config = {k: v for k, v in sorted(os.environ.items()) if k.startswith("MC_")}
    config.update(metadata="P2PHANDSHAKE", protocol="tcp", api=f"batch_transfer_{mode}_write")
    result = summarise(ENGINE, "tcp", cfg, batch_s, latency_s, verified, config)
    emit(result.to_json())
    return 0 if verified else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--transport", choices=["tcp"], default="tcp")
    parser.add_argument(
        "--mode", choices=["sync", "async"], default="sync",
        help="batch_transfer_sync_write, or batch_transfer_async_write + get_batch_transfer_status",
    )
    add_workload_args(parser)
    args = parser.parse_args()
    claim_stdout()
    cfg = config_from_args(args)
    try:
        import mooncake.engine  # noqa: F401
    except ImportError as exc:
        return fail(ENGINE, args.transport, "import mooncake.engine (run setup_peers.sh)", exc)
    log(f"mooncake: tcp {cfg.pages} x {cfg.page_bytes} B, {args.mode}")
    return run(cfg, args.mode)


if __name__ == "__main__":
    sys.exit(main())
