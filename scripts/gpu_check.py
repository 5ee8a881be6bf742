"""Exercise every GPU path of `transfer_core` on this machine and print a summary (S3b, S5a).

1. A mapped pinned counter bumped by a captured CUDA graph after each layer, watched by the
   `CounterPoller`: every layer's bump must be reported, and a copy-engine read of the
   layer's KV issued from the callback must already see that forward's data.
2. Graph replay time per forward with and without the counter bump, and the time from
   `graph.replay()` to the poller's callback for a one-bump graph.
3. cuMem KV memory allocated in a spawned "rank" process, passed by fd over a Unix socket,
   imported here, checked both ways, with import and copy timings.
Runs in well under five minutes. Without a GPU it says so and exits 0. Usage:
`python scripts/gpu_check.py`.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from gpu_check_common import Row  # noqa: E402 - scripts/ is on the path when run as a script
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402


def main() -> int:
    console = Console()
    if not torch.cuda.is_available():
        console.print("gpu_check: no CUDA GPU on this machine (torch sees none); nothing to check.")
        return 0
    _ensure_poller_built()
    from transfer_core.cuda_host import cuda_available

    if not cuda_available():
        console.print("gpu_check: torch sees a GPU but cuda-python cannot reach it; skipping.")
        return 0
    rows: list[Row] = [*_environment()]
    for check in _checks():
        started = time.perf_counter()
        try:
            rows.extend(check())
        except Exception as exc:  # reported in the table and in the exit code
            rows.append((check.__name__.strip("_"), False, "error", f"{type(exc).__name__}: {exc}"))
        console.log(f"{check.__name__} took {time.perf_counter() - started:.1f} s")
    table = Table(title="transfer_core GPU check")
    for column in ("check", "ok", "value", "detail"):
        table.add_column(column)
    for name, ok, value, detail in rows:
        table.add_row(name, "[green]yes" if ok else "[red]NO", value, detail)
    console.print(table)
    return 0 if all(ok for _, ok, _, _ in rows) else 1


def _checks() -> list:
    from gpu_check_counter import graph_counter_check, latency_check
    from gpu_check_cumem import cumem_check

    return [graph_counter_check, latency_check, cumem_check]


def _ensure_poller_built() -> None:
    try:
        import transfer_core._poller  # noqa: F401
    except ImportError:
        from transfer_core._poller_build import ffibuilder

        ffibuilder.compile(tmpdir=str(ROOT))


def _environment() -> list[Row]:
    from transfer_core.cuda_host import check_cu, device_attribute, load_driver
    from transfer_core.topology import detect_topology

    version = check_cu("cuDriverGetVersion", load_driver().cuDriverGetVersion())
    maps = device_attribute(0, "CAN_MAP_HOST_MEMORY")
    vmm_rdma = device_attribute(0, "GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED")
    topology = detect_topology()
    group = topology.groups[0] if topology.groups else None
    near = f"NICs {[n.name for n in group.nics]}, {len(group.cpus)} CPUs" if group else "no GPU"
    return [
        ("device", True, torch.cuda.get_device_name(0), f"torch {torch.__version__}"),
        ("driver", True, f"{version // 1000}.{version % 1000 // 10}", "cuDriverGetVersion"),
        ("can map host memory", maps == 1, str(maps), "needed by MappedCounter"),
        ("GPUDirect RDMA with VMM", True, str(vmm_rdma), "cuMem rdma flag used if 1"),
        ("topology of GPU 0", group is not None, f"NUMA {group.numa_node if group else '-'}", near),
    ]


if __name__ == "__main__":
    sys.exit(main())
