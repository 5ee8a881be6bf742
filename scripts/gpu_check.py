"""Exercise every GPU path of `disagg` and `transfer_core` here and print a summary (S3b, S5).

1. A mapped pinned counter bumped by a captured CUDA graph after each layer, watched by the
   `CounterPoller`: every bump reported, and a copy-engine read of the layer's KV issued from
   the callback already sees that forward's data; replay time with and without the bump, and
   `graph.replay()` to callback (`gpu_check_counter.py`).
2. The engine's decode steps as captured graphs: logits equal eager, step time eager vs graph
   vs graph with the counter, bumps observed / expected through the poller (`gpu_check_model.py`).
3. cuMem KV memory allocated in a spawned "rank" process, passed by fd over a Unix socket,
   imported here, checked both ways, with timings (`gpu_check_cumem.py`).
4. KV pages from GPU memory through the fabric on the path chosen automatically (FI_HMEM or
   host staging), byte-exact, GB/s; counter bump to write posted (`gpu_check_fabric.py`).
5. TP 2 as rank processes: NCCL all-reduces, a rank's cuMem KV imported by the leader, the
   TP 1 tokens (`gpu_check_tp.py`; skipped with one GPU).
Runs in well under five minutes. Without a GPU it says so and exits 0; `--dry-run` then runs
parts 2, 4 and 5 on CPU at toy sizes (what CI can check of this script). `--json PATH` also
writes the rows. Usage: `python scripts/gpu_check.py [--dry-run] [--json PATH]`.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from gpu_check_common import Row  # noqa: E402 - scripts/ is on the path when run as a script
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true",
                        help="without a GPU: run the model and fabric parts on CPU, toy sizes")
    parser.add_argument("--json", type=Path, help="also write the rows here")
    args = parser.parse_args(argv)
    console = Console()
    _ensure_built(console)
    if args.dry_run:
        rows = _run(_dry_run_checks(), console)
    elif not torch.cuda.is_available():
        console.print("gpu_check: no CUDA GPU on this machine (torch sees none); nothing to check.")
        return 0
    else:
        from transfer_core.cuda.driver import cuda_available

        if not cuda_available():
            console.print("gpu_check: torch sees a GPU but cuda-python cannot reach it; skipping.")
            return 0
        rows = [*_environment(), *_run(_checks(), console)]
    table = Table(title="GPU check" + (" (CPU dry run)" if args.dry_run else ""))
    for column in ("check", "ok", "value", "detail"):
        table.add_column(column)
    for name, ok, value, detail in rows:
        table.add_row(name, "[green]yes" if ok else "[red]NO", value, detail)
    console.print(table)
    if args.json:
        keys = ("check", "ok", "value", "detail")
        args.json.write_text(json.dumps([dict(zip(keys, row, strict=True)) for row in rows],
                                        indent=1))
    return 0 if all(ok for _, ok, _, _ in rows) else 1


def _run(checks: list[Callable[[], list[Row]]], console: Console) -> list[Row]:
    rows: list[Row] = []
    for check in checks:
        name = getattr(check, "__name__", None) or check.func.__name__  # a partial
        started = time.perf_counter()
        try:
            rows.extend(check())
        except Exception as exc:  # reported in the table and in the exit code
            rows.append((name, False, "error", f"{type(exc).__name__}: {exc}"))
        console.log(f"{name} took {time.perf_counter() - started:.1f} s")
    return rows


def _checks() -> list[Callable[[], list[Row]]]:
    from gpu_check_counter import graph_counter_check, latency_check
    from gpu_check_cumem import cumem_check
    from gpu_check_fabric import posting_latency_check, transfer_check
    from gpu_check_model import model_graph_check
    from gpu_check_tp import tp_check

    return [graph_counter_check, latency_check, model_graph_check, cumem_check,
            transfer_check, posting_latency_check, tp_check]


def _dry_run_checks() -> list[Callable[[], list[Row]]]:
    from functools import partial

    from gpu_check_fabric import posting_latency_check, transfer_check
    from gpu_check_model import model_graph_check
    from gpu_check_tp import tp_check

    from disagg.config import ModelConfig

    small = ModelConfig.from_name("small")
    return [partial(model_graph_check, "cpu", small, steps=3),
            partial(transfer_check, "cpu", num_pages=16),
            partial(posting_latency_check, "cpu", samples=20), partial(tp_check, "cpu")]


def _ensure_built(console: Console) -> None:
    """Build the two cffi modules in place if this checkout was not installed (a bare GPU
    machine); a fabric that cannot build shows up as failed rows, not as a crash."""
    from transfer_core._poller_build import ffibuilder as poller
    from transfer_core.pyfabric._build import ffibuilder as fabric

    for module, builder in (("transfer_core._poller", poller), ("transfer_core.pyfabric._pyfabric",
                                                                fabric)):
        try:
            __import__(module)
        except ImportError:
            try:
                builder.compile(tmpdir=str(ROOT))
            except Exception as exc:  # noqa: BLE001 - reported, the other parts still run
                console.print(f"gpu_check: could not build {module}: {exc}")


def _environment() -> list[Row]:
    from transfer_core.cuda.driver import check_cu, device_attribute, load_driver
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
