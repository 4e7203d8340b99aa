#!/bin/bash
# Installs pstrain's Debian 12 build dependencies if any is missing, then
# configures and builds into ./build. Arguments are CMake targets to build
# (default: everything, tests included). Safe to run again.
set -euo pipefail
cd "$(dirname "$0")/.."

packages=(
  g++ cmake ninja-build pkg-config ccache
  libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler
  libabsl-dev libgoogle-glog-dev libyaml-cpp-dev libopenblas-dev zlib1g-dev
  prometheus-cpp-dev libgtest-dev dataset-fashion-mnist prometheus iproute2 libssl-dev openssl
  python3-dev pybind11-dev python3-numpy
)
# Building everything builds the tests, whose Python part trains with
# PyTorch (several hundred MB): only then. The quick start's first command
# names its target and skips them.
if [ $# -eq 0 ]; then
  packages+=(python3-torch python3-pytest python3-venv)
fi
missing=()
for p in "${packages[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done
sudo=""
[ "$(id -u)" -eq 0 ] || sudo="sudo"
if [ ${#missing[@]} -gt 0 ]; then
  echo "installing: ${missing[*]}"
  if [ -n "$sudo" ] && ! command -v sudo >/dev/null; then
    echo "need root or sudo to install packages" >&2
    exit 1
  fi
  export DEBIAN_FRONTEND=noninteractive
  $sudo apt-get update -qq
  $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

# Debian's kubectl 1.20, whose kustomize v2 is what the manifests must
# render with (tests/deploy): unpacked into build/tools, not installed, as
# it would replace a newer kubectl.
if [ ! -x build/tools/kubectl-1.20 ]; then
  fetch=$(mktemp -d)
  if (cd "$fetch" && { apt-get download kubernetes-client >/dev/null 2>&1 ||
       { $sudo apt-get update -qq && apt-get download kubernetes-client >/dev/null; }; }) &&
     dpkg-deb -x "$fetch"/kubernetes-client_*.deb "$fetch/x"; then
    mkdir -p build/tools && cp "$fetch/x/usr/bin/kubectl" build/tools/kubectl-1.20
  else
    echo "warning: cannot fetch Debian's kubernetes-client; the manifest tests use the kubectl on PATH" >&2
  fi
  rm -rf "$fetch"
fi

# ccache hits across build directories (deploy/test/containers.sh builds a
# second one, without CUDA).
export CCACHE_BASEDIR=$PWD CCACHE_NOHASHDIR=1
if [ ! -f build/CMakeCache.txt ]; then
  cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo
fi
jobs=$(nproc)
if [ $# -gt 0 ]; then
  cmake --build build -j"$jobs" --target "$@"
else
  cmake --build build -j"$jobs"
fi
