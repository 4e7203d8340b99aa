#!/bin/bash
# The installed client library as a user's project finds it: installs the
# build into a temporary prefix, configures and builds examples/client
# there on its own with find_package(pstrain), and runs the program (without
# arguments it prints its usage and exits 2: it loaded the library).
#   client_package_test.sh BUILD_DIR SOURCE_DIR
set -euo pipefail
build=$1
source=$2
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
cmake --install "$build" --prefix "$tmp/prefix" >/dev/null
test -f "$tmp/prefix/include/pstrain/client.h"
cmake -S "$source/examples/client" -B "$tmp/build" -G Ninja -DCMAKE_PREFIX_PATH="$tmp/prefix" \
  -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build "$tmp/build" >/dev/null
# Exported: the public API alone.
if nm -D --defined-only "$tmp/prefix"/lib*/libpstrain_client.so | grep -q ' T .*pstrain6worker'; then
  echo "libpstrain_client.so exports pstrain's internals" >&2
  exit 1
fi
status=0
"$tmp/build/softmax_client" 2>"$tmp/err" || status=$?
if [ "$status" -ne 2 ] || ! grep -q usage "$tmp/err"; then
  echo "softmax_client: exit $status, expected 2 with its usage:" >&2
  cat "$tmp/err" >&2
  exit 1
fi
echo "find_package(pstrain) builds and runs examples/client"
