#!/usr/bin/env bash
# Here (a machine with apt and pip): gather what a bare GPU machine lacks into .gpu_bundle/,
# for `scripts/gpu_run.sh` there. The GPU image has Python 3.12 with torch, cuda-python, rich,
# typer, numpy, tokenizers, pytest and hypothesis, but no libfabric and no cffi.
#   bash scripts/gpu_bundle.sh        then carry .gpu_bundle to the GPU machine (git-ignored)
set -euo pipefail
cd "$(dirname "$0")/.."
bundle=.gpu_bundle
rm -rf "$bundle"
mkdir -p "$bundle/deb" "$bundle/whl"
# libfabric and the libraries its providers link against (apt-cache depends libfabric1).
(cd "$bundle/deb" && apt-get download libfabric1 libfabric-dev libibverbs1 librdmacm1 \
    libpsm2-2 libpsm-infinipath1 libnl-3-200 libnl-route-3-200 ibverbs-providers libnuma1)
python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d "$bundle/whl" "cffi==2.1.1" "pycparser==3.12"
du -sh "$bundle"
