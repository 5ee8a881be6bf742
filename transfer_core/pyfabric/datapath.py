"""The data path of one endpoint: batched RMA writes and a progress loop, both in C (S5, S4c).

`WriteOp` describes n writes (one call for thousands of pages, from int64 index arrays);
`Worker.submit` hands it to the C worker from any thread; `Worker.progress` (called only
by the endpoint's progress thread) posts under an in-flight cap (and one per destination),
handles -FI_EAGAIN by reaping the CQ and posting to other destinations meanwhile (X5c),
enforces deadlines, and returns finished ops and immediate counts per value; `fail_dest`
gives up on what is queued for one peer.
The GIL is released for the whole C call. A thread waiting for its own op runs the same loop
in `fabp_run_prepared`, a whole prepared run in one call (shim_wait.c.in's NOTEs; called by
`waited.PreparedWrite` on `Worker.handle`). Retired ops may be dropped; until then the C side
and the provider still point at them, so `Worker` keeps them alive.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from ._pyfabric import ffi, lib
from .objects import CompletionQueue, Endpoint

MAX_EVENTS = 256
MAX_IMMS = 64


class OpTimes(NamedTuple):
    """When an op was submitted, had its first write handed to the provider and its last one
    posted, and was first reported (done or failed): CLOCK_MONOTONIC ns, as
    `time.monotonic_ns`, read in C; 0: not reached."""

    submit_ns: int
    first_post_ns: int
    last_post_ns: int
    done_ns: int


class Event(NamedTuple):
    """An op finished (`err == 0`) or failed (`err` is a negative fi errno); `retired`: the
    provider holds none of its contexts any more. `times` only from a timed worker."""

    op_id: int
    err: int
    retired: bool
    times: OpTimes | None = None


class ImmArrival(NamedTuple):
    """`count` arrivals of immediate `imm` handed back by one progress call, the first and the
    last of them reaped at `first_ns` and `last_ns` (CLOCK_MONOTONIC, read in C)."""

    imm: int
    count: int
    first_ns: int
    last_ns: int


class WriteOp:
    """n writes of `length` bytes: page i from `src_addr + src_idx[i] * src_stride` to remote
    address `dst_addr + dst_idx[i] * dst_stride`. `None` index arrays mean `range(n)`. Each
    write carries `imm`, or with `imms` (a C-contiguous uint32 array of n) write i `imms[i]`.

    Index arrays must expose a C-contiguous int64 buffer (numpy int64 arrays do); they are
    kept alive with the op. `length == 0` with `imm` set is a pure immediate; `length == 0`
    without one (only with `empty=True`) moves nothing and tells the target nothing: it opens
    the connection of a connection-based provider (rxm) ahead of the first real write.
    """

    def __init__(
        self,
        *,
        dest: int,
        n: int,
        length: int,
        src_addr: int,
        src_stride: int,
        desc: Any,
        dst_addr: int,
        dst_stride: int,
        key: int,
        imm: int | None = None,
        src_idx: Any = None,
        dst_idx: Any = None,
        imms: Any = None,
        deadline_ns: int = 0,
        empty: bool = False,
    ) -> None:
        if imms is not None and imm is not None:
            raise ValueError("an op carries one imm for all writes or imms, one per write")
        if n < 1 or length < 0 or (length == 0 and imm is None and imms is None and not empty):
            raise ValueError(f"an op needs n >= 1 writes of data or an imm (n={n}, len={length})")
        c = ffi.new("struct fabp_op *")
        c.dest = dest
        c.n = n
        c.len = length
        c.src_addr = src_addr
        c.src_stride = src_stride
        c.desc = desc if desc is not None else ffi.NULL
        c.dst_addr = dst_addr
        c.dst_stride = dst_stride
        c.key = key
        c.deadline_ns = deadline_ns
        if imm is not None:
            c.imm = imm
        self._keep: list[Any] = []
        c.src_idx = self._index_pointer(src_idx, n)
        c.dst_idx = self._index_pointer(dst_idx, n)
        c.imms = self._index_pointer(imms, n, "uint32_t[]")
        if imm is not None or imms is not None:
            c.flags = lib.FABP_OP_IMM
        self.c = c

    @property
    def op_id(self) -> int:
        """The id events report; the submitter sets it before `Worker.submit`."""
        return int(self.c.id)

    @op_id.setter
    def op_id(self, value: int) -> None:
        self.c.id = value

    def keep(self, obj: Any) -> None:
        """Keep `obj` (e.g. the source buffer's owner) alive as long as the op is live."""
        self._keep.append(obj)

    def _index_pointer(self, indices: Any, n: int, ctype: str = "int64_t[]") -> Any:
        if indices is None:
            return ffi.NULL
        pointer = ffi.from_buffer(ctype, indices)
        if len(pointer) != n:
            raise ValueError(f"{ctype[:-2]} array has {len(pointer)} entries, op has {n} writes")
        self._keep.append(pointer)
        return pointer


class Stats(NamedTuple):
    writes_posted: int
    writes_completed: int
    eagain: int
    imms_received: int
    foreign_errors: int
    last_foreign_err: int
    inflight: int
    bytes_written: int = 0  # payload of the writes completed without error
    sleeps: int = 0  # times the progress thread went to sleep (a nap, or on the CQ's fd)
    posted_on_submit: int = 0  # writes the submitting thread posted itself (`submit`)


class Worker:
    """The C worker of one endpoint. `progress` must be called from a single thread.

    `max_inflight` writes may be in flight in all, at most `dest_cap` (None: all of them) to
    one destination: a peer that stops reading (frozen) then holds only its share of the slots,
    and the worker posts to the others meanwhile (X5c)."""

    def __init__(
        self, endpoint: Endpoint, cq: CompletionQueue, max_inflight: int,
        dest_cap: int | None = None, *, timed: bool = False,
    ) -> None:
        handle = lib.fabp_worker_new(endpoint.handle, cq.handle, max_inflight, dest_cap or 0)
        if handle == ffi.NULL:
            raise MemoryError("fabp_worker_new")
        self._handle = handle
        self._freeable = False
        # An idle worker sleeps on the CQ's fd where it has one, else naps (shim.c.in).
        self.sleeps_on_fd = cq.waitable and lib.fabp_worker_wait_fd(
            handle, cq.domain.fabric.handle) == 0
        self._live: dict[int, WriteOp] = {}
        self._events = ffi.new("struct fabp_event[]", MAX_EVENTS)
        self._imms = ffi.new("struct fabp_imm[]", MAX_IMMS)
        self._n_ev = ffi.new("int *")
        self._n_imm = ffi.new("int *")
        self.max_inflight = max_inflight
        self.dest_cap = min(dest_cap or max_inflight, max_inflight)
        self.timed = timed  # events carry OpTimes, immediates come as ImmArrival
        lib.fabp_set_stamps(handle, int(timed))

    def set_fd_sleep(self, ns: int) -> None:
        """The longest the idle worker sleeps on its CQ's fd with no op queued (100 ms):
        arrivals and submits wake it sooner. No effect on a worker that naps."""
        lib.fabp_set_fd_sleep(self._handle, ns)

    def set_eager(self, level: int) -> None:
        """How soon writes are due: 0 not at all; `lib.FABP_DUE_SOON`, an idle worker that naps
        (no CQ fd) naps its shortest; `lib.FABP_DUE_NOW`, that, and a worker that sleeps on its
        CQ's fd polls it for 2 ms after its last activity."""
        lib.fabp_set_eager(self._handle, int(level))

    def idle_nap_ns(self, idle_ns: int) -> int:
        """How long this worker would nap after `idle_ns` without activity (no CQ fd): its
        longest nap at once when nothing is due to it (no writes in flight, no recent
        arrivals)."""
        return int(lib.fabp_idle_nap_ns(self._handle, idle_ns))

    def idle_polls(self, idle_ns: int) -> bool:
        """Whether this worker, `idle_ns` after its last activity, polls its CQ rather than
        sleep on its fd (writes due at once, `set_eager(lib.FABP_DUE_NOW)`)."""
        return bool(lib.fabp_idle_polls(self._handle, idle_ns))

    def submit(self, op: WriteOp) -> None:
        self._live[op.op_id] = op
        if self.timed:
            op.c.flags |= lib.FABP_OP_TIMED
        lib.fabp_submit(self._handle, op.c)

    def fail_dest(self, dest: int, err: int = -lib.FABP_EABANDONED) -> None:
        """Give up on every op accepted for `dest` (an fi_addr) so far: each posts nothing more
        and is reported failed with `err` by the next `progress` (or waiter) step; its writes
        already in flight still return before it retires, so it stays alive until then."""
        lib.fabp_fail_dest(self._handle, dest, err)

    def track(self, op: WriteOp) -> None:
        """Keep `op` alive until an event retires it or `untrack`: for an op posted by
        `fabp_run_prepared`, tracked once when it is made, so runs touch no dict."""
        self._live[op.op_id] = op
        if self.timed:
            op.c.flags |= lib.FABP_OP_TIMED

    def untrack(self, op_id: int) -> None:
        """Drop an op that is not in flight (it never ran, or its last run retired it)."""
        self._live.pop(op_id, None)

    @property
    def handle(self) -> Any:
        """The C worker, for `fabp_run_prepared` calls made without a Python frame here."""
        return self._handle

    def waiters(self) -> int:
        """Threads inside `fabp_run_waited` (prepared runs included) right now."""
        return int(lib.fabp_waiters(self._handle))

    def close_waits(self) -> None:
        """Make every waiting run (`fabp_run_prepared`) return FABP_WAIT_CLOSED, now and on."""
        lib.fabp_close_waits(self._handle)

    def interrupt(self) -> None:
        """Make the running (or next) `progress` call return soon."""
        lib.fabp_interrupt(self._handle)

    def progress(self, budget_ns: int
                 ) -> tuple[list[Event], list[tuple[int, int]] | list[ImmArrival], int]:
        """Run the C loop for up to `budget_ns`: (events, [(imm, count)], rc); a timed
        worker's events carry their `OpTimes` and its immediates are `ImmArrival`s.

        rc < 0 is a fatal CQ error (negative fi errno): the endpoint is unusable."""
        rc = lib.fabp_progress(
            self._handle,
            budget_ns,
            self._events,
            MAX_EVENTS,
            self._n_ev,
            self._imms,
            MAX_IMMS,
            self._n_imm,
        )
        events = []
        for e in self._events[0 : self._n_ev[0]]:
            times = None
            if self.timed:
                times = OpTimes(e.t_submit_ns, e.t_first_post_ns, e.t_last_post_ns, e.t_done_ns)
            events.append(Event(int(e.id), int(e.err), bool(e.retired), times))
            if e.retired:
                self._live.pop(int(e.id), None)
        arrived = self._imms[0 : self._n_imm[0]]
        if self.timed:
            imms: list[tuple[int, int]] | list[ImmArrival] = [
                ImmArrival(i.imm, i.count, i.first_ns, i.last_ns) for i in arrived]
        else:
            imms = [(int(i.imm), int(i.count)) for i in arrived]
        return events, imms, rc

    def live_ops(self) -> list[int]:
        """Ids of ops the C side or the provider may still touch."""
        return list(self._live)

    def stats(self) -> Stats:
        out = ffi.new("struct fabp_stats *")
        lib.fabp_get_stats(self._handle, out)
        return Stats(
            int(out.writes_posted),
            int(out.writes_completed),
            int(out.eagain),
            int(out.imms_received),
            int(out.foreign_errors),
            int(out.last_foreign_err),
            int(lib.fabp_inflight(self._handle)),
            int(out.bytes_written),
            int(out.sleeps),
            int(out.posted_on_submit),
        )

    def free(self) -> None:
        """Let the C worker go once nothing refers to it; only after its endpoint is closed.

        The memory itself is freed when this object is collected: a prepared write that
        outlives its engine still holds it, and its run must find `closing` set in live
        memory rather than read freed memory (see fabp_run_prepared)."""
        if self._handle is not None and not self._freeable:
            self._freeable = True
            self._live.clear()

    def __del__(self) -> None:
        if getattr(self, "_freeable", False):
            lib.fabp_worker_free(self._handle)
