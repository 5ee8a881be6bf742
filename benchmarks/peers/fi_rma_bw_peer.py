"""libfabric's `fi_rma_bw` on the peer workload's terms, for `transfer_compare.py` (S5).

    python benchmarks/peers/fi_rma_bw_peer.py --transport tcp|shm [--pages N] [--page-size B]
                                              [--iters R] [--window W] [--binary PATH]

Each timed run is one server/client pair (`transfer_core.fi_rma_bw`) writing `--pages` writes
of `--page-size` bytes with remote CQ data, `--window` in flight; the JSON line carries the
median GB/s over `--iters` runs. Unlike the workload's other contenders it writes one buffer
to one remote address (fabtests' design), so its pages never leave the caches; `verified` is
a separate short run with fabtests' data integrity checks (-v) passing. No 4 KiB latency: the
tool measures bandwidth only. The binary comes from `build_fi_rma_bw.sh` (found as
`--binary`, $FI_RMA_BW, on PATH, or in .venv-peers/bin).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent
sys.path.insert(0, str(ROOT))

from transfer_core.errors import ReferenceToolError  # noqa: E402
from transfer_core.fi_rma_bw import find_fi_rma_bw, run_fi_rma_bw  # noqa: E402

ENGINE = "fi_rma_bw"
VERIFY_WRITES = 64  # the integrity run: enough writes to cycle the window, quick with -v


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--transport", choices=("tcp", "shm"), required=True)
    parser.add_argument("--pages", type=int, default=2048)
    parser.add_argument("--page-size", type=int, default=64 * 1024)
    parser.add_argument("--iters", type=int, default=5, help="server/client pairs timed")
    parser.add_argument("--window", type=int, default=64, help="writes in flight (-W)")
    parser.add_argument("--binary", help="fi_rma_bw to run")
    args = parser.parse_args()
    try:
        binary = find_fi_rma_bw(args.binary, also=[ROOT / ".venv-peers" / "bin"])
        if binary is None:
            raise ReferenceToolError("fi_rma_bw not found: run benchmarks/peers/build_fi_rma_bw.sh")
        # A failed integrity check exits non-zero, which raises: reaching the next line is
        # the verification.
        run_fi_rma_bw(binary, args.transport, args.page_size, min(VERIFY_WRITES, args.pages),
                      window=args.window, verify=True)
        runs = [run_fi_rma_bw(binary, args.transport, args.page_size, args.pages,
                              window=args.window) for _ in range(args.iters)]
    except ReferenceToolError as exc:
        print(json.dumps({"engine": ENGINE, "transport": args.transport, "error": str(exc),
                          "verified": False}))
        return 2
    version = binary.with_name("fi_rma_bw.version")
    gbps = statistics.median(r.gbps for r in runs)
    print(json.dumps({
        "engine": ENGINE, "transport": args.transport, "gbps": gbps,
        "us_per_page": statistics.median(r.us_per_xfer for r in runs),
        "latency_us_p50": None, "latency_us_p99": None, "verified": True,
        "pages": args.pages, "page_bytes": args.page_size,
        "batch_gbps_all": [r.gbps for r in runs],
        "config": {"binary": str(binary), "window": str(args.window),
                   "version": version.read_text().strip() if version.exists() else "unknown",
                   "working_set": f"one {args.page_size} B buffer, one remote address"},
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
