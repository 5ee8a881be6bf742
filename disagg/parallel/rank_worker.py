"""A TP rank process: `python -m disagg.parallel.rank_worker`, started by its node's leader (S3c, S5a).

It reads its shard of the model, only its slices of each split weight (`load_rank_model`,
`model/tensor_parallel.py`), allocates its KV shard as shareable memory and sends the leader
the fd (`shared_memory.py`), joins the node's group, then
runs every step the leader sends down the same socket over its own heads (and every page copy
of a fork, in its own shard), until told to stop. It never opens libfabric and never samples:
the leader registers this rank's KV and posts its page writes.
It exits when the leader's end of its stdin closes, so a leader killed with SIGKILL leaves no
rank behind.
"""

from __future__ import annotations

import logging
import os
import pickle
import socket
import sys
import threading
import traceback

import torch

from disagg.model.huge_pages import into_huge_pages
from disagg.model.kv_cache import PagedKVCache
from disagg.model.loading.registry import load_model
from disagg.model.precision import cast_model
from disagg.model.sharded_kv_cache import shard_config
from disagg.model.tensor_parallel import TPShard
from disagg.model.transformer import Transformer
from disagg.parallel import group
from disagg.parallel.rank_spec import RankHello, RankSpec, rank_device
from disagg.parallel.shared_memory import create_region, send_message
from disagg.parallel.step import PageCopy, receive_step, step_to

logger = logging.getLogger(__name__)


def _exit_when_orphaned() -> None:
    """Read stdin to its end: the leader closed it, or died. Either way this rank is done."""
    sys.stdin.buffer.read()
    os._exit(0)


def share_kv(spec: RankSpec, device: str, sock: socket.socket, shape: tuple[int, ...]
             ) -> torch.Tensor:
    """This rank's KV shard in memory the leader maps, handed over in one message.

    The hello and the fd go in one sendmsg (SCM_RIGHTS): the leader's socket is a stream, so
    a hello and an fd sent one after the other may reach it as one read.
    """
    dtype = spec.cache.dtype
    nbytes = dtype.itemsize * int(torch.Size(shape).numel())
    if torch.device(device).type == "cuda":
        from transfer_core.cuda import cumem  # cuda-python, only on CUDA ranks

        allocation = cumem.allocate(nbytes, torch.device(device).index or 0)
        buffer = allocation.as_tensor(dtype, shape).zero_()
        fd, bus_id = cumem.export_allocation(allocation)
        # The rounded-up size: the leader maps the whole allocation.
        hello = RankHello(spec.rank, os.getpid(), "cumem", allocation.size, shape, str(dtype),
                          bus_id)
    else:
        region = create_region(nbytes, f"disagg-kv-{spec.node_id}-rank{spec.rank}")
        buffer = region.tensor(dtype, shape)
        fd = region.fd
        hello = RankHello(spec.rank, os.getpid(), "memfd", nbytes, shape, str(dtype))
    try:
        send_message(sock, hello.to_header(), [fd])
    finally:
        os.close(fd)  # the mapping stays; the leader holds its own fd now
    return buffer


def load_rank_model(model_spec: str, shard: TPShard, device: str,
                    dtype: torch.dtype = torch.float32) -> Transformer:
    """Rank `shard.rank`'s part of the model on `device`, in `dtype`. A checkpoint is read
    slice by slice: the rank never holds a full split weight (`load_model(..., shard=)`)."""
    loaded = load_model(model_spec, shard=shard)
    model = Transformer.holding(loaded.config, loaded.state_dict, shard=shard)
    model = cast_model(model, dtype).to(device).eval()
    into_huge_pages(model)  # its CPU weights: a decode streams them (X8f)
    return model


def serve_rank(spec: RankSpec) -> None:
    """Load, share the KV memory, join, then run the leader's steps until `None`."""
    device = rank_device(spec.device, spec.rank)
    # A rank's share of the cores unless told: N processes each spinning a full OpenMP pool
    # on the same cores made a TP 2 decode step 15x slower here.
    torch.set_num_threads(spec.threads or max(1, (os.cpu_count() or 1) // spec.sharding.tp))
    if torch.device(device).type == "cuda":
        torch.cuda.set_device(device)
    model = load_rank_model(spec.model, TPShard(spec.rank, spec.sharding, group.all_reduce),
                            device, spec.dtype)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.connect(spec.socket_path)
        shard_model = shard_config(model.config, spec.sharding)
        shape = PagedKVCache.buffer_shape(shard_model, spec.cache)
        cache = PagedKVCache(shard_model, spec.cache, device,
                             buffer=share_kv(spec, device, sock, shape))
        group.join(spec.group, spec.rank)
        try:
            with torch.inference_mode():
                while (step := receive_step(sock)) is not None:
                    if isinstance(step, PageCopy):
                        cache.copy_page(step.src, step.dst)
                        continue
                    input_ids, positions, meta = step_to(step, device)
                    model(input_ids, positions, cache, meta)
        finally:
            group.leave()


def main() -> None:
    spec: RankSpec = pickle.load(sys.stdin.buffer)
    # Warnings and errors only: the leader already said what the node loads and serves.
    logging.basicConfig(level=logging.WARNING,
                        format=f"{spec.node_id}/rank{spec.rank} %(levelname)s %(message)s")
    threading.Thread(target=_exit_when_orphaned, name="orphan-watch", daemon=True).start()
    code = 0
    try:
        serve_rank(spec)
    except BaseException:  # noqa: BLE001 - reported here, then the exit code says it
        traceback.print_exc()
        code = 1
    # Not a normal interpreter exit: the orphan watch blocks in a read of stdin, which makes
    # the interpreter abort at shutdown (SIGABRT) instead of exiting with our code.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
