#!/usr/bin/env bash
# There (the GPU machine, repository root, .gpu_bundle carried): unpack libfabric and cffi
# without touching /, build the two cffi modules against them, run the GPU-only tests and
# `scripts/gpu_check.py`. Results go to $OUT (gpu_tests.log, gpu_check.json, gpu_check.log).
#   bash scripts/gpu_run.sh
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-/tmp/gpu_out}
mkdir -p "$out"
prefix=/tmp/fabric
for deb in .gpu_bundle/deb/*.deb; do dpkg -x "$deb" "$prefix"; done
libdir=$prefix/usr/lib/x86_64-linux-gnu
export LD_LIBRARY_PATH=$libdir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export FI_PROVIDER_PATH=$libdir/libfabric  # DSO providers, if this build has any
python=${PYTHON:-python3}
if ! "$python" -c "import cffi" 2>/dev/null; then
    "$python" -m pip install -q --no-index --no-deps --no-compile --target /tmp/site \
        .gpu_bundle/whl/*.whl
    export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD
export CFLAGS="-I$prefix/usr/include" LDFLAGS="-L$libdir"
"$python" transfer_core/pyfabric/_build.py && "$python" transfer_core/_poller_build.py \
    || { echo "gpu_run: building the cffi modules failed"; exit 1; }
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$out/gpu.txt" || true
export PYTHONUNBUFFERED=1
"$python" -m pytest -q -p no:cacheprovider -m gpu_only tests/ 2>&1 | tee "$out/gpu_tests.log"
tests=${PIPESTATUS[0]}
"$python" scripts/gpu_check.py --json "$out/gpu_check.json" 2>&1 | tee "$out/gpu_check.log"
check=${PIPESTATUS[0]}
echo "gpu_run: gpu_only tests exit $tests, gpu_check exit $check"
exit $(( tests || check ))
