#!/usr/bin/env bash
# Build libfabric's own RMA bandwidth test, fi_rma_bw, for benchmarks/transfer_compare.py and
# `disagg bench transfer`: the provider's limit that our transfer core is measured against.
#
# fi_rma_bw is part of fabtests, which lives in the libfabric repository. It is built from the
# tag that matches the libfabric this machine links against (Debian's libfabric-dev 1.17.0 ->
# v1.17.0), against that installed library, so both sides of the comparison run the same
# provider code. Only fabtests is configured and only fi_rma_bw is compiled (about 10 s).
#
#   benchmarks/peers/build_fi_rma_bw.sh          # -> .venv-peers/bin/fi_rma_bw
#
# Settings (environment):
#   LIBFABRIC_GIT  where to clone from (default https://github.com/ofiwg/libfabric.git; a local
#                  clone or bare mirror works the same, for machines without GitHub access)
#   LIBFABRIC_TAG  the tag to build (default v<pkg-config --modversion libfabric>)
#   PEERS_BIN      where the binary goes (default .venv-peers/bin in the repository root)
# It needs autoconf, automake and libtool; when they are missing and this runs as root on
# Debian, it installs them with apt-get.
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
SRC_GIT="${LIBFABRIC_GIT:-https://github.com/ofiwg/libfabric.git}"
OUT="${PEERS_BIN:-$ROOT/.venv-peers/bin}"

missing=()
for tool in autoconf automake libtoolize make gcc git pkg-config; do
    command -v "$tool" >/dev/null || missing+=("$tool")
done
if ((${#missing[@]})); then
    if [[ $(id -u) == 0 ]] && command -v apt-get >/dev/null; then
        echo "installing build tools (missing: ${missing[*]})"
        apt-get update -q >/dev/null
        apt-get install -y -q --no-install-recommends autoconf automake libtool make gcc git \
            pkg-config >/dev/null
    else
        echo "missing build tools: ${missing[*]} (install autoconf automake libtool)" >&2
        exit 2
    fi
fi

pkg-config --exists libfabric || { echo "no libfabric for pkg-config (libfabric-dev)" >&2; exit 2; }
PREFIX="$(pkg-config --variable=prefix libfabric)"
TAG="${LIBFABRIC_TAG:-v$(pkg-config --modversion libfabric)}"

WORK="$(mktemp -d "${TMPDIR:-/tmp}/fabtests.XXXXXX")"
trap 'rm -rf "$WORK"' EXIT
echo "fabtests $TAG from $SRC_GIT, against libfabric in $PREFIX"
git -c advice.detachedHead=false clone -q --depth 1 --branch "$TAG" "$SRC_GIT" "$WORK/libfabric" \
    2>&1 | grep -v "depth is ignored" || true
test -d "$WORK/libfabric/fabtests" || { echo "no fabtests at $TAG in $SRC_GIT" >&2; exit 2; }
COMMIT="$(git -C "$WORK/libfabric" rev-parse HEAD)"

cd "$WORK/libfabric/fabtests"
./autogen.sh >"$WORK/autogen.log" 2>&1 || { tail -20 "$WORK/autogen.log" >&2; exit 1; }
./configure -q --with-libfabric="$PREFIX" >"$WORK/configure.log" 2>&1 \
    || { tail -20 "$WORK/configure.log" >&2; exit 1; }
make -j"$(nproc)" benchmarks/fi_rma_bw >"$WORK/make.log" 2>&1 \
    || { tail -20 "$WORK/make.log" >&2; exit 1; }

mkdir -p "$OUT"
install -m 755 benchmarks/fi_rma_bw "$OUT/fi_rma_bw"
printf '%s %s\n' "$TAG" "$COMMIT" >"$OUT/fi_rma_bw.version"
# Smoke check: the binary loads the installed libfabric and prints its usage (-h exits 1).
usage="$("$OUT/fi_rma_bw" -h 2>&1 || true)"
grep -q "Bandwidth test using RMA" <<<"$usage" || { echo "$OUT/fi_rma_bw does not run" >&2; exit 1; }
echo "fi_rma_bw ready: $OUT/fi_rma_bw ($TAG, $COMMIT)"
