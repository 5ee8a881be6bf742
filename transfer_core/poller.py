"""`CounterPoller`: a dedicated thread that watches 64-bit counter words and reports each move.

The model bumps a counter after each layer's attention output projection; this thread sees
the bump and calls `on_change(index, old, new)`, so a messenger can start that layer's
transfers without any Python inside the forward pass or the captured CUDA graph (S3b). Under
tensor parallelism only the leader rank's counter is watched (S3c). The wait is C
(`transfer_core._poller`, GIL released); this module is the thread, the callbacks and errors.
It does not interpret values: layers and forward indices are the consumer's business.
Read the NOTE below (the reporting contract) and `counter_word.py`'s (memory ordering: why the
data is readable once the counter shows it) before using it.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from transfer_core._poller import ffi, lib
from transfer_core.counter_word import counter_address
from transfer_core.doorbell import Doorbell
from transfer_core.errors import TransferTimeoutError
from transfer_core.placement import check_cpus
from transfer_core.thread_name import name_current_thread
from transfer_core.topology import pin_current_thread

# NOTE (the reporting contract). Each counter is read as a snapshot; the poller never invents
# values it did not read. If the counter moved several times between two reads, ONE call
# reports the whole jump: `on_change(i, old=3, new=6)` means the steps 4, 5 and 6 all happened,
# and the consumer must act on each of them. Reports of one counter chain exactly: every `old`
# is the previous report's `new` (the first `old` is the value read at `start()`), so the union
# of the half-open ranges `(old, new]` is every step, each once, in order. For the model's
# monotonic counter, `layer = (value - 1) % num_layers`. Callbacks run on the poller thread, one
# at a time, in index order within a snapshot; a slow callback delays later reports but loses
# none. Callbacks need the GIL: a Python-busy thread elsewhere can delay one by up to
# `sys.getswitchinterval()` (the C wait itself never holds the GIL). An exception from a
# callback stops the thread and is re-raised by `check()` or `stop()`.

logger = logging.getLogger(__name__)

if TYPE_CHECKING:
    from transfer_core.counter_word import CounterLike

OnChange = Callable[[int, int, int], None]
# The C wait returns to Python this often when nothing moves; it only bounds a C call.
_WAIT_SLICE_S = 0.25
_NEVER_HELD = -(2**63)  # a wake_at every value reaches


@dataclass(frozen=True, slots=True)
class PollerConfig:
    """How the poller waits: spin first (lowest latency), then sleep with doubling naps.

    `spin_us` is how long one wait busy-polls before it starts sleeping; the naps start at
    `sleep_min_us` and double up to `sleep_max_us`, which also bounds how late `stop()` is
    noticed. `cpu_affinity` pins the poller thread (see `topology.GpuGroup.cpus`).
    """

    spin_us: float = 50.0
    sleep_min_us: float = 2.0
    sleep_max_us: float = 200.0
    cpu_affinity: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.spin_us < 0 or self.sleep_min_us < 0 or self.sleep_max_us < self.sleep_min_us:
            raise ValueError(f"need spin_us >= 0 and 0 <= sleep_min_us <= sleep_max_us: {self}")
        if self.cpu_affinity is not None and not self.cpu_affinity:
            raise ValueError("cpu_affinity must name at least one CPU, or be None")


class CounterPoller:
    """Watch `counters` on a dedicated thread and call `on_change(index, old, new)` per move.

    `index` is the counter's position in `counters`. See the module NOTE for the contract:
    jumps are reported whole, reports chain, nothing is lost or repeated. `cpus` pins the
    thread (e.g. to the NUMA node of the leader's device, S5b), as `config.cpu_affinity`
    does; pass one or the other. The poller keeps
    references to the counter objects so their memory outlives the thread.

    >>> import torch
    >>> seen = []
    >>> counter = torch.zeros(1, dtype=torch.int64)
    >>> poller = CounterPoller([counter], lambda i, old, new: seen.append((old, new)))
    >>> poller.start()
    >>> _ = counter.add_(1)
    >>> poller.wait_for(0, 1)
    >>> poller.stop()
    >>> seen
    [(0, 1)]
    """

    def __init__(
        self,
        counters: Sequence[CounterLike],
        on_change: OnChange,
        config: PollerConfig | None = None,
        name: str = "counter-poller",
        *,
        cpus: Sequence[int] | None = None,
        doorbell: Doorbell | None = None,
    ) -> None:
        if not counters:
            raise ValueError("CounterPoller needs at least one counter")
        self._counters = list(counters)
        self._on_change = on_change
        self._config = config or PollerConfig()
        self._doorbell = doorbell  # set: sleep until it rings, the config's spin and naps unused
        if cpus is not None:
            if self._config.cpu_affinity is not None:
                raise ValueError("pass cpus or config.cpu_affinity, not both")
            chosen = check_cpus(cpus, "CounterPoller cpus")
            self._config = dataclasses.replace(self._config, cpu_affinity=chosen)
        self._name = name
        n = len(self._counters)
        # C-side state: the word pointers, the last reported values and the snapshot buffer.
        addresses = [counter_address(c) for c in self._counters]
        self._words = ffi.new("int64_t *[]", [ffi.cast("int64_t *", a) for a in addresses])
        self._last = ffi.new("int64_t[]", n)
        self._seen = ffi.new("int64_t[]", n)
        self._wake_at = ffi.new("int64_t[]", [_NEVER_HELD] * n)  # see report_from
        self._stop = ffi.new("int *", 0)
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._lock = threading.Lock()
        self._progress = threading.Condition(self._lock)
        self._prepared = threading.Event()

    def __enter__(self) -> CounterPoller:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    @property
    def running(self) -> bool:
        """Whether the poller thread is alive."""
        return self._thread is not None and self._thread.is_alive()

    def last_reported(self, index: int) -> int:
        """The `new` of the latest report for counter `index` (its start value before any)."""
        with self._lock:
            return int(self._last[index])

    def report_from(self, index: int, value: int) -> None:
        """Hold the reports of counter `index` until it reads at least `value`; then one report
        covers the whole jump since the last (the contract above: nothing is lost). For a
        counter that only grows, whose owner has nothing to do below `value`: the thread then
        stays in C, without the GIL, through the moves below it. Any thread may call it; a
        held counter is released by a `value` at or below its current one."""
        if not 0 <= index < len(self._counters):
            raise IndexError(f"no counter {index}: the poller watches {len(self._counters)}")
        lib.tc_store_release(ffi.addressof(self._wake_at, index), value)
        if self._doorbell is not None:
            self._doorbell.ring()  # a waiter asleep on the bell re-reads the threshold

    def start(self) -> None:
        """Read every counter's current value as the baseline and start the thread."""
        if self._thread is not None or self._stop[0]:
            raise RuntimeError("a CounterPoller starts once and cannot restart after stop()")
        for i in range(len(self._counters)):
            self._last[i] = lib.tc_load_acquire(self._words[i])
        self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
        self._thread.start()
        self._prepared.wait(5.0)  # pinned before start() returns: callers may read it

    def check(self) -> None:
        """Re-raise, once, an exception raised by `on_change` on the poller thread."""
        with self._lock:
            error, self._error = self._error, None
        if error is not None:
            raise error

    def wait_for(self, index: int, value: int, timeout: float = 5.0) -> None:
        """Block until a report for counter `index` has reached `value` (for tests and tools).

        Raises the callback's stored exception if the thread died, or `TransferTimeoutError`.
        """
        with self._progress:
            done = self._progress.wait_for(
                lambda: self._last[index] >= value or self._error is not None or not self.running,
                timeout,
            )
        self.check()
        if not done or self._last[index] < value:
            raise TransferTimeoutError(
                f"counter {index} reported {self._last[index]}, not {value}, within {timeout} s"
            )

    def stop(self, timeout: float = 5.0) -> None:
        """Stop and join the thread, then re-raise any stored callback exception.

        Stopping is noticed within one nap (`sleep_max_us`) unless a callback is running;
        it is idempotent. Reports already read are delivered before the thread exits.
        """
        lib.tc_store_flag(self._stop, 1)
        if self._doorbell is not None:
            self._doorbell.ring()  # the stop flag is read before the wait
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)
            if thread.is_alive():
                raise TransferTimeoutError(f"{self._name} did not stop within {timeout} s")
        self.check()

    def _run(self) -> None:
        try:
            try:
                self._prepare_thread()
            finally:
                self._prepared.set()
            self._loop()
        except BaseException as exc:  # stored for the owner, never dropped (see check()).
            logger.debug("%s stopped by a callback exception", self._name, exc_info=True)
            with self._progress:
                self._error = exc
                self._progress.notify_all()
        finally:
            with self._progress:
                self._progress.notify_all()

    def _prepare_thread(self) -> None:
        name_current_thread(self._name)
        if self._config.cpu_affinity is not None:
            pin_current_thread(self._config.cpu_affinity)
        if lib.tc_set_timer_slack_ns(1000) != 0:
            logger.debug("could not lower the timer slack of %s", self._name)

    def _loop(self) -> None:
        config = self._config
        n = len(self._counters)
        spin_ns = int(config.spin_us * 1e3)
        sleep_min_ns = int(config.sleep_min_us * 1e3)
        sleep_max_ns = int(config.sleep_max_us * 1e3)
        slice_ns = int(_WAIT_SLICE_S * 1e9)
        while True:
            if self._doorbell is not None:
                changed = lib.tc_bell_wait(self._words, self._last, self._wake_at, self._seen, n,
                                           self._stop, self._doorbell.word, slice_ns)
            else:
                wait = (spin_ns, sleep_min_ns, sleep_max_ns, slice_ns)
                changed = lib.tc_poll_wait(self._words, self._last, self._wake_at, self._seen, n,
                                           self._stop, *wait)
            if changed < 0:
                return
            for i in range(n):
                new, old = self._seen[i], self._last[i]
                if new == old:
                    continue
                self._on_change(i, old, new)
                with self._progress:
                    self._last[i] = new
                    self._progress.notify_all()
