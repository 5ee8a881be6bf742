#!/usr/bin/env bash
# Create the peers' venv (.venv-peers) for benchmarks/transfer_compare.py.
# It is separate from the project's .venv on purpose: the peer engines bring their own
# UCX / asio / etcd libraries and must never leak into the project's environment.
# NIXL is installed without its declared torch dependency (its Python API imports torch
# only when handed tensors; the harness hands it numpy arrays), which keeps a ~3 GB CUDA
# torch off a CPU-only machine.
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
VENV="${PEERS_VENV:-$ROOT/.venv-peers}"
PYTHON="${PYTHON:-python3}"

NIXL_PKG="nixl-cu12==1.5.1"
MOONCAKE_PKG="mooncake-transfer-engine-non-cuda==0.3.13.post1"

test -x "$VENV/bin/python" || "$PYTHON" -m venv "$VENV"
"$VENV/bin/pip" install -q --upgrade pip
"$VENV/bin/pip" install -q "numpy>=1.26" "$MOONCAKE_PKG"
"$VENV/bin/pip" install -q --no-deps "$NIXL_PKG"

# Smoke check: both engines import, and say so.
"$VENV/bin/python" - <<'PY'
import importlib
for name in ("nixl_cu12._api", "mooncake.engine"):
    try:
        importlib.import_module(name)
        print(f"ok: {name}")
    except Exception as exc:  # report every failure, keep going to the next engine
        print(f"FAILED: {name}: {type(exc).__name__}: {exc}")
PY
echo "peers venv ready: $VENV"
