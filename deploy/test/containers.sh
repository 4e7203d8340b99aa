#!/bin/bash
# deploy/test/containers.sh [--full] [--keep] [--phases LIST] [--if-ci]
#
# The container test, for real with podman: builds the pstrain image (CPU)
# and its GPU variant, checks the CPU image's size, then
#   pod      coordinator + 2 servers + 2 workers as containers of one pod
#            (traffic on the pod's loopback): every probe and /metrics
#            answers, the example Fashion-MNIST job succeeds, and succeeds
#            again with the same final loss after one server process is
#            killed with SIGKILL mid-job and restarted by the runtime;
#   compose  deploy/compose/compose.yaml with podman-compose, over mutual TLS
#            with tokens: a job submitted from the host (with the admin
#            certificate and the operator's token) succeeds, and Prometheus
#            scrapes every process;
#   kube     deploy/k8s rendered with kubectl kustomize (Debian's kubectl 1.20
#            and the machine's own), and the cpu overlay played with
#            `podman kube play` after pstrain-kube-for-podman's rewrites
#            (tests/deploy/manifests.h: kube play cannot mount Secrets, so
#            deploy/k8s/tls-secrets.sh's Secrets become ConfigMaps), the
#            example job, submitted over TLS with a token, succeeding.
#
# --full     builds the images with the Dockerfile's full multi-stage build
#            (compiling pstrain inside the build stage, twice: CPU and GPU).
#            Without it (CI) the images take the binaries this tree already
#            built: build/ (CUDA-enabled) for the GPU variant, and a
#            PSTRAIN_CUDA=OFF build in build-cpu/ for the CPU image.
# --keep     keeps the base images (the debootstrapped Debian and the CUDA
#            bases) for the next run; everything else is always removed.
# --phases   a comma-separated subset of pod,compose,kube (default: all).
# --if-ci    skips (77) unless CI=true: how ctest runs it (tests/CMakeLists.txt),
#            so that the README's test command runs it in CI only.
#
# Needs root (podman as root; CI runs as root); installs podman, runc,
# debootstrap and podman-compose if missing. Exits 77 (skipped) with a message
# where containers cannot run, e.g. inside an unprivileged container. podman
# keeps its images, containers and volumes under $PSTRAIN_CONTAINERS_HOME
# (default /var/tmp/pstrain-containers), apart from the machine's own.
# The whole script is one block, read before it runs: editing the file while
# a test runs does not change what that test does.
{
set -euo pipefail
cd "$(dirname "$0")/../.."
repo=$(pwd)
readonly SKIP=77

full=false keep=false phases=pod,compose,kube if_ci=false
while [ $# -gt 0 ]; do
  case "$1" in
    --full) full=true ;;
    --keep) keep=true ;;
    --if-ci) if_ci=true ;;
    --phases) phases=$2; shift ;;
    --phases=*) phases=${1#--phases=} ;;
    -h | --help) sed -n '2,/^[^#]/{/^#/s/^# \{0,1\}//p}' "$0"; exit 0 ;;
    *) echo "containers.sh: unknown argument $1" >&2; exit 2 ;;
  esac
  shift
done
has_phase() { [[ ",$phases," == *",$1,"* ]]; }

started=$(date +%s)
log() { echo "[containers $(($(date +%s) - started))s] $*"; }
die() { echo "containers.sh: FAILED: $*" >&2; exit 1; }
skip() { echo "containers.sh: SKIPPED: $*"; exit $SKIP; }

if $if_ci && [ "${CI:-}" != true ]; then
  skip "runs in CI (CI=true), or as deploy/test/containers.sh"
fi
[ "$(id -u)" -eq 0 ] || skip "needs root for podman (CI runs as root)"

export DEBIAN_FRONTEND=noninteractive
need=()
# iptables: netavark sets up the bridge network through the iptables command
# (it is not a dependency of Debian's netavark, and a machine installed
# without recommends lacks it: every `podman run` then fails with
# "netavark: No such file or directory").
for package in podman runc catatonit netavark aardvark-dns iptables debootstrap podman-compose; do
  dpkg-query -W -f='${Status}' "$package" 2>/dev/null | grep -q "install ok installed" ||
    need+=("$package")
done
if [ ${#need[@]} -gt 0 ]; then
  log "installing ${need[*]}"
  apt-get update -qq && apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi

# podman's own world: storage, configuration and networks of this test only.
W=${PSTRAIN_CONTAINERS_HOME:-/var/tmp/pstrain-containers}
mkdir -p "$W"
cat > "$W/storage.conf" <<EOC
[storage]
driver = "overlay"
runroot = "$W/run"
graphroot = "$W/graph"
EOC
cat > "$W/containers.conf" <<EOC
[containers]
default_ulimits = ["nofile=20000:20000", "nproc=32768:32768"]
[engine]
runtime = "runc"
cgroup_manager = "cgroupfs"
events_logger = "file"
events_logfile_path = "$W/events.log"
tmp_dir = "$W/libpod-tmp"
[network]
network_config_dir = "$W/networks"
EOC
export CONTAINERS_STORAGE_CONF=$W/storage.conf CONTAINERS_CONF=$W/containers.conf

readonly BASE=localhost/pstrain-base:bookworm
readonly CUDA_RUNTIME_BASE=localhost/pstrain-cuda-runtime:bookworm
readonly CUDA_DEVEL_BASE=localhost/pstrain-cuda-devel:bookworm
readonly IMAGE=localhost/pstrain:latest
readonly GPU_IMAGE=localhost/pstrain-gpu:latest
readonly PROMETHEUS_IMAGE=localhost/pstrain-prometheus:latest
readonly POD=pstrain-smoke
readonly CUDA=/usr/local/cuda

cleanup() {
  local rc=$?
  set +e
  log "cleaning up"
  if has_phase compose && [ -f deploy/compose/compose.yaml ]; then
    podman-compose -p pstrain-ci -f deploy/compose/compose.yaml down -v >/dev/null 2>&1
  fi
  podman pod rm -f -a >/dev/null 2>&1
  podman rm -f -a >/dev/null 2>&1
  podman volume rm -f -a >/dev/null 2>&1
  podman network prune -f >/dev/null 2>&1
  local images
  images=$(podman images -a --format '{{.Repository}}:{{.Tag}} {{.ID}}' 2>/dev/null)
  while read -r name id; do
    [ -n "$id" ] || continue
    if $keep && [[ "$name" == localhost/pstrain-base:* || "$name" == localhost/pstrain-cuda-* ]]; then
      continue
    fi
    podman rmi -f "$id" >/dev/null 2>&1
  done <<< "$images"
  if ! $keep; then
    podman system reset -f >/dev/null 2>&1
    rm -rf "$W"
  fi
  rm -rf "$repo/build-image" "$tmp"
  log "done (exit $rc)"
}
tmp=$(mktemp -d /tmp/pstrain-containers.XXXXXX)
trap cleanup EXIT

# ---- Base images ---------------------------------------------------------

# Debian 12 from the machine's own apt sources (no registry is reachable):
# debootstrap minbase, slimmed as debian:bookworm-slim is (no manuals,
# documentation or translations, now or from packages installed later),
# the apt sources copied in, imported.
make_base() {
  podman image exists "$BASE" && return 0
  log "making $BASE with debootstrap"
  local mirror rootfs=$tmp/rootfs
  mirror=$(awk '/^URIs:/{print $2; exit}' /etc/apt/sources.list.d/debian.sources 2>/dev/null || true)
  debootstrap --variant=minbase bookworm "$rootfs" ${mirror:+"$mirror"} > "$tmp/debootstrap.log" 2>&1 ||
    skip "debootstrap cannot make a root file system here: $(tail -1 "$tmp/debootstrap.log")"
  if cp /etc/apt/sources.list.d/*.sources "$rootfs/etc/apt/sources.list.d/" 2>/dev/null; then
    rm -f "$rootfs/etc/apt/sources.list"
  else
    cp /etc/apt/sources.list "$rootfs/etc/apt/sources.list" 2>/dev/null || true
  fi
  cp /etc/apt/apt.conf.d/99* "$rootfs/etc/apt/apt.conf.d/" 2>/dev/null || true
  cat > "$rootfs/etc/dpkg/dpkg.cfg.d/slim" <<'EOS'
path-exclude /usr/share/doc/*
path-include /usr/share/doc/*/copyright
path-exclude /usr/share/man/*
path-exclude /usr/share/info/*
path-exclude /usr/share/locale/*
path-include /usr/share/locale/locale.alias
path-exclude /usr/share/lintian/*
EOS
  find "$rootfs/usr/share/doc" -mindepth 2 ! -name copyright -delete 2>/dev/null || true
  rm -rf "$rootfs/usr/share/man/"* "$rootfs/usr/share/info/"* "$rootfs/usr/share/lintian/"*
  find "$rootfs/usr/share/locale" -mindepth 1 -maxdepth 1 ! -name locale.alias \
    -exec rm -rf {} + 2>/dev/null || true
  rm -rf "$rootfs/var/cache/apt/archives/"*.deb "$rootfs/var/lib/apt/lists/"* \
    "$rootfs/var/cache/apt/"*.bin "$rootfs/var/log/"*.log "$rootfs/var/log/apt"
  tar -C "$rootfs" -c . | podman import -q - "$BASE" > /dev/null
  rm -rf "$rootfs"
  podman run --rm --network=host "$BASE" true 2> "$tmp/run.err" ||
    skip "podman cannot run a container here: $(tail -1 "$tmp/run.err")"
}

# The CUDA bases, made from this machine's toolkit (docs/deploy.md, "The
# image", names the upstream images that stand for them elsewhere): the
# runtime one has the libraries the worker loads, the development one what
# nvcc and the link need.
make_cuda_base() {  # IMAGE devel|runtime
  podman image exists "$1" && return 0
  local cuda=$CUDA ctx=$tmp/cuda-$2
  log "making $1 from $cuda"
  mkdir -p "$ctx/cuda/lib"
  local libs="libcudart.so* libcublas.so* libcublasLt.so* libnccl.so*"
  if [ "$2" = devel ]; then
    cp -a $cuda/bin $cuda/nvvm $cuda/include $cuda/targets "$ctx/cuda/"
    libs+=" libcudadevrt.a libcudart_static.a libculibos.a libnvvm.so* cmake stubs"
  fi
  # shellcheck disable=SC2086 # the patterns expand in the library directory
  (cd $cuda/lib && cp -a $libs "$ctx/cuda/lib/")
  ln -s lib "$ctx/cuda/lib64"
  printf 'FROM %s\nCOPY cuda/ /usr/local/cuda/\n' "$BASE" > "$ctx/Containerfile"
  podman build -q --network=host -t "$1" "$ctx" > /dev/null
  rm -rf "$ctx"
}

# ---- The pstrain images --------------------------------------------------

# Stripped binaries for the runtime-prebuilt target.
stage_binaries() {  # BUILD_DIR
  rm -rf build-image && mkdir -p build-image/bin
  for b in pstrain-coordinator pstrain-server pstrain-worker pstrain-local psctl; do
    strip -o "build-image/bin/$b" "$1/bin/$b"
  done
}

build_image() {  # TAG BUILD_BASE RUNTIME_BASE TARGET [BUILD_ARGS...]
  local tag=$1 build_base=$2 runtime_base=$3 target=$4
  shift 4
  podman build --format docker --network=host -f deploy/docker/Dockerfile \
    --build-arg BUILD_BASE="$build_base" --build-arg RUNTIME_BASE="$runtime_base" "$@" \
    --target "$target" -t "$tag" . > "$tmp/build-$target.log" 2>&1 ||
    { tail -30 "$tmp/build-$target.log"; die "podman build of $tag ($target)"; }
}

image_size() { podman image inspect --format '{{.Size}}' "$1"; }

make_images() {
  make_base
  if $full; then
    log "building $IMAGE: the full multi-stage build"
    build_image "$IMAGE" "$BASE" "$BASE" runtime
  else
    log "building the PSTRAIN_CUDA=OFF binaries in build-cpu/"
    export CCACHE_BASEDIR=$repo CCACHE_NOHASHDIR=1
    [ -f build-cpu/CMakeCache.txt ] ||
      cmake -S . -B build-cpu -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DPSTRAIN_CUDA=OFF \
        -DPSTRAIN_BUILD_TESTS=OFF > "$tmp/cmake-cpu.log"
    cmake --build build-cpu -j"$(nproc)" --target pstrain-coordinator pstrain-server \
      pstrain-worker pstrain-local psctl > "$tmp/build-cpu.log" || 
      { tail -30 "$tmp/build-cpu.log"; die "the PSTRAIN_CUDA=OFF build"; }
    stage_binaries build-cpu
    log "building $IMAGE from build-cpu/"
    build_image "$IMAGE" "$BASE" "$BASE" runtime-prebuilt
  fi
  local size
  size=$(image_size "$IMAGE")
  log "CPU image: $((size / 1000000)) MB"
  [ "$size" -lt 200000000 ] || die "the CPU image is $size bytes, not under 200 MB"
  local libraries
  libraries=$(podman run --rm --no-healthcheck --entrypoint ldd "$IMAGE" \
    /usr/local/bin/pstrain-worker) || die "podman could not run the CPU image"
  ! grep -q -e libcuda -e libnccl <<< "$libraries" ||
    die "the CPU image's worker links CUDA libraries"
  [ "$(podman image inspect --format '{{.Config.User}}' "$IMAGE")" != "" ] ||
    die "the image runs as root"
  podman image inspect --format '{{.Config.Healthcheck.Test}}' "$IMAGE" | grep -q health ||
    die "the image has no HEALTHCHECK (build with --format docker)"

  if [ ! -x $CUDA/bin/nvcc ]; then
    log "no CUDA toolkit in $CUDA: the GPU variant is not built"
    return 0
  fi
  make_cuda_base "$CUDA_RUNTIME_BASE" runtime
  if $full; then
    make_cuda_base "$CUDA_DEVEL_BASE" devel
    log "building $GPU_IMAGE: the full multi-stage build with CUDA"
    build_image "$GPU_IMAGE" "$CUDA_DEVEL_BASE" "$CUDA_RUNTIME_BASE" runtime \
      --build-arg PSTRAIN_CUDA=ON
  else
    ldd build/bin/pstrain-worker | grep -q libcudart ||
      { log "build/ was built without CUDA: the GPU variant is not built"; return 0; }
    stage_binaries build
    log "building $GPU_IMAGE from build/"
    build_image "$GPU_IMAGE" "$BASE" "$CUDA_RUNTIME_BASE" runtime-prebuilt
  fi
  log "GPU image: $(($(image_size "$GPU_IMAGE") / 1000000)) MB"
  # No GPU here: its worker must say so and exit 2, not crash.
  local out rc=0
  out=$(podman run --rm --no-healthcheck "$GPU_IMAGE" worker --coordinator=127.0.0.1:1 --devices=cuda:0 2>&1) ||
    rc=$?
  [ "$rc" -eq 2 ] && grep -q "no usable GPU" <<< "$out" ||
    die "the GPU image's worker without a GPU: exit $rc, $out"
  log "GPU image's worker without a GPU: exit 2, '$(grep "no usable GPU" <<< "$out")'"
}

# ---- Waiting, from outside the containers --------------------------------

# Runs "$@" until it succeeds; dies with WHAT after SECONDS.
wait_for() {  # SECONDS WHAT COMMAND...
  local deadline=$(($(date +%s) + $1)) what=$2
  shift 2
  until "$@" > /dev/null 2>&1; do
    [ "$(date +%s)" -lt $deadline ] || die "waited too long for $what"
    sleep 0.5
  done
}


# The first number called FIELD in a job's JSON (`psctl -o json get ID`):
# final_loss, recoveries, step (the progress's: it comes first).
job_field() {  # JSON FIELD
  grep -o "\"$2\":\"\{0,1\}[-0-9.e]*" <<< "$1" | head -1 | sed 's/.*://; s/"//g'
}

job_step() { job_field "$(pod_psctl -o json get "$1")" step; }

# ---- pod ----------------------------------------------------------------

# podman run -d, its complaints (e.g. no systemd for healthcheck timers) in
# a log rather than the output.
start_container() {
  podman run -d "$@" > /dev/null 2>> "$tmp/podman.log" ||
    { tail -5 "$tmp/podman.log"; die "podman run $*"; }
}

pod_psctl() { podman exec "$POD-coordinator" pstrain psctl --coordinator=127.0.0.1:50050 "$@"; }

pod_phase() {
  log "pod: starting coordinator, 2 servers and 2 workers in pod $POD"
  podman pod create --name "$POD" > /dev/null
  podman volume create "$POD-state" > /dev/null
  podman volume create "$POD-checkpoints" > /dev/null
  local t0 ready_ms
  t0=$(date +%s%N)
  start_container --pod "$POD" --name "$POD-coordinator" -e PSTRAIN_METRICS_PORT=9100 \
    -v "$POD-state:/var/lib/pstrain/state" -v "$POD-checkpoints:/var/lib/pstrain/checkpoints" \
    "$IMAGE" coordinator --listen=127.0.0.1:50050 --state_dir=/var/lib/pstrain/state \
    --default_checkpoint_dir=/var/lib/pstrain/checkpoints
  local i
  for i in 0 1; do
    start_container --pod "$POD" --name "$POD-server-$i" --restart=on-failure \
      -e PSTRAIN_NODE_ID=server-$i -e PSTRAIN_METRICS_PORT=$((9101 + i)) \
      -v "$POD-checkpoints:/var/lib/pstrain/checkpoints" \
      "$IMAGE" server --coordinator=127.0.0.1:50050 --listen=127.0.0.1:$((50051 + i))
    start_container --pod "$POD" --name "$POD-worker-$i" --restart=on-failure \
      -e PSTRAIN_NODE_ID=worker-$i -e PSTRAIN_METRICS_PORT=$((9103 + i)) \
      "$IMAGE" worker --coordinator=127.0.0.1:50050
  done
  local containers=("$POD-coordinator" "$POD-server-0" "$POD-server-1" "$POD-worker-0"
                    "$POD-worker-1")
  for c in "${containers[@]}"; do wait_for 120 "$c to be ready" podman exec "$c" pstrain ready; done
  ready_ms=$((($(date +%s%N) - t0) / 1000000))
  log "pod: all 5 containers ready ${ready_ms} ms after the first one started"
  echo "pod: 5 containers from the first start to all ready: $ready_ms ms" >> "$tmp/figures"

  # Every probe and /metrics answers.
  for c in "${containers[@]}"; do
    podman exec "$c" pstrain health > /dev/null || die "$c: pstrain health"
    podman healthcheck run "$c" > /dev/null 2>> "$tmp/podman.log" ||
      die "$c: the image's HEALTHCHECK"
  done
  local port
  for port in 9100 9101 9102 9103 9104; do
    local metrics
    metrics=$(podman exec "$POD-coordinator" psctl health "http://127.0.0.1:$port/metrics") ||
      die "/metrics on port $port"
    grep -q '^pstrain_' <<< "$metrics" || die "/metrics on port $port has no pstrain_ series"
  done
  for port in 50050 50051 50052; do
    [ "$(podman exec "$POD-coordinator" psctl health 127.0.0.1:$port)" = SERVING ] ||
      die "gRPC health on port $port"
  done
  log "pod: every /healthz, /readyz, /metrics, HEALTHCHECK and gRPC health answers"

  local job=/usr/share/pstrain/examples/fashion_mlp.yaml id clean_loss
  id=$(pod_psctl submit "$job")
  timeout 600 podman exec "$POD-coordinator" psctl watch "$id" > "$tmp/watch-clean.log" ||
    { tail "$tmp/watch-clean.log"; die "the undisturbed job $id did not succeed"; }
  clean_loss=$(job_field "$(pod_psctl -o json get "$id")" final_loss)
  log "pod: undisturbed job $id succeeded, final loss $clean_loss"

  id=$(pod_psctl submit "$job")
  local deadline=$(($(date +%s) + 300))
  until [ "$(job_step "$id")" -ge 300 ] 2> /dev/null; do
    [ "$(date +%s)" -lt $deadline ] || die "job $id never reached step 300"
    sleep 0.2
  done
  local pid restarts
  pid=$(podman inspect --format '{{.State.Pid}}' "$POD-server-1")
  restarts=$(podman inspect --format '{{.RestartCount}}' "$POD-server-1")
  kill -9 "$pid"
  log "pod: killed server-1 (host pid $pid) with SIGKILL during job $id"
  wait_for 120 "the runtime to restart server-1" sh -c \
    "[ \$(podman inspect --format '{{.RestartCount}}' $POD-server-1) -gt $restarts ]"
  wait_for 120 "server-1 to be ready again" podman exec "$POD-server-1" pstrain ready
  timeout 600 podman exec "$POD-coordinator" psctl watch "$id" > "$tmp/watch-kill.log" ||
    { tail "$tmp/watch-kill.log"; die "job $id did not succeed after the kill"; }
  local got recoveries
  got=$(pod_psctl -o json get "$id")
  recoveries=$(job_field "$got" recoveries)
  [ "$(job_field "$got" final_loss)" = "$clean_loss" ] ||
    die "job $id ended with final loss $(job_field "$got" final_loss), not $clean_loss"
  [ "${recoveries:-0}" -ge 1 ] || die "job $id reports no recovery"
  log "pod: after the kill, job $id succeeded with the same final loss ($clean_loss), recoveries $recoveries"
  # The quick-start job in one container: pstrain-local's cluster inside it.
  local result
  result=$(podman run --rm --no-healthcheck "$IMAGE" local --job "$job" 2> "$tmp/local.err" |
           tail -1) || { tail -5 "$tmp/local.err"; die "pstrain local in a container"; }
  [ "$(job_field "$result" final_loss)" = "$(printf '%.6f' "$clean_loss")" ] ||
    die "pstrain local in a container: $result, not final loss $clean_loss"
  log "pod: pstrain local in one container: the same final loss ($result)"
  podman pod rm -f "$POD" > /dev/null 2>> "$tmp/podman.log"
  podman volume rm -f "$POD-state" "$POD-checkpoints" > /dev/null
}

# ---- compose --------------------------------------------------------------

# A TCP port on 127.0.0.1 that nothing listens on now.
free_port() {
  local port
  while true; do
    port=$((20000 + RANDOM % 20000))
    (exec 3<> "/dev/tcp/127.0.0.1/$port") 2> /dev/null || { echo "$port"; return; }
  done
}

# Certificates that the containers' user (uid 10001) can read: fine for a
# test's throwaway CA, not for real keys.
readable_by_containers() {
  chmod 755 "$1"
  chmod 644 "$1"/*
}

compose_phase() {
  local tls=$tmp/compose-tls
  deploy/tls/make-dev-certs.sh "$tls" 2 2 > /dev/null
  readable_by_containers "$tls"
  export PSTRAIN_TLS_DIR=$tls
  log "compose: building $PROMETHEUS_IMAGE"
  podman build --format docker --network=host -f deploy/compose/prometheus.Dockerfile \
    --build-arg BASE="$BASE" -t "$PROMETHEUS_IMAGE" . > "$tmp/build-prometheus.log" 2>&1 ||
    { tail -20 "$tmp/build-prometheus.log"; die "podman build of $PROMETHEUS_IMAGE"; }
  export PSTRAIN_IMAGE=$IMAGE PSTRAIN_PROMETHEUS_IMAGE=$PROMETHEUS_IMAGE
  PSTRAIN_COORDINATOR_PORT=$(free_port)
  PSTRAIN_PROMETHEUS_PORT=$(free_port)
  export PSTRAIN_COORDINATOR_PORT PSTRAIN_PROMETHEUS_PORT
  local compose=(podman-compose -p pstrain-ci -f deploy/compose/compose.yaml)
  log "compose: up (coordinator on 127.0.0.1:$PSTRAIN_COORDINATOR_PORT, Prometheus on 127.0.0.1:$PSTRAIN_PROMETHEUS_PORT)"
  "${compose[@]}" up -d > "$tmp/compose-up.log" 2>&1 ||
    { tail -20 "$tmp/compose-up.log"; die "podman-compose up"; }
  local psctl=("$repo/build/bin/psctl" "--coordinator=127.0.0.1:$PSTRAIN_COORDINATOR_PORT"
               "--tls_cert=$tls/admin.crt" "--tls_key=$tls/admin.key" "--tls_ca=$tls/ca.crt"
               "--token_file=$tls/operator.token")
  # Plaintext, or TLS without a token, gets nowhere.
  ! "$repo/build/bin/psctl" "--coordinator=127.0.0.1:$PSTRAIN_COORDINATOR_PORT" --timeout=3 \
    list > /dev/null 2>&1 || die "the compose coordinator answers plaintext"
  wait_for 180 "2 servers and 2 workers to register through compose" sh -c \
    "[ \$(${psctl[*]} nodes | grep -c ' alive ') -ge 4 ]"
  local id
  id=$("${psctl[@]}" submit examples/fashion_mlp.yaml) || die "psctl submit from the host"
  timeout 600 "${psctl[@]}" watch "$id" > "$tmp/watch-compose.log" ||
    { tail "$tmp/watch-compose.log"; "${compose[@]}" logs > "$tmp/compose.log" 2>&1;
      tail -40 "$tmp/compose.log"; die "job $id through compose did not succeed"; }
  log "compose: job $id submitted from the host over TLS succeeded: $(tail -1 "$tmp/watch-compose.log")"
  local code=0
  "${psctl[@]:0:5}" list > /dev/null 2> "$tmp/psctl-no-token.err" || code=$?
  [ "$code" -eq 4 ] || die "psctl without a token: exit $code, not 4: $(cat "$tmp/psctl-no-token.err")"
  # Prometheus scrapes the coordinator, both servers and both workers.
  local query='count(up{job="pstrain"} == 1)' answer=""
  local deadline=$(($(date +%s) + 180))
  until grep -q '=> 5 @' <<< "$answer"; do
    [ "$(date +%s)" -lt $deadline ] ||
      die "Prometheus does not scrape all 5 processes: '$answer'"
    sleep 2
    answer=$(promtool query instant "http://127.0.0.1:$PSTRAIN_PROMETHEUS_PORT" "$query" 2>&1) ||
      true
  done
  answer=$(promtool query instant "http://127.0.0.1:$PSTRAIN_PROMETHEUS_PORT" \
    'count by (role) (up{job="pstrain"})' 2>&1 || true)
  log "compose: Prometheus scrapes all 5 processes ($(tr '\n' ' ' <<< "$answer"))"
  "${compose[@]}" down -v > /dev/null 2>&1 || die "podman-compose down"
}

# ---- kube -----------------------------------------------------------------

# The kubectls to render with: Debian's 1.20 (deploy/build.sh puts it in
# build/tools) and the machine's own, if any.
kubectls() {
  [ -x build/tools/kubectl-1.20 ] && echo build/tools/kubectl-1.20
  command -v kubectl || true
}

kube_phase() {
  local kubectl rendered=$tmp/k8s-cpu.yaml play=$tmp/k8s-play.yaml
  for kubectl in $(kubectls); do
    for overlay in cpu gpu; do
      "$kubectl" kustomize "deploy/k8s/overlays/$overlay" > "$tmp/k8s-$overlay.yaml" \
        2> "$tmp/kustomize.err" ||
        { cat "$tmp/kustomize.err"; die "$kubectl kustomize deploy/k8s/overlays/$overlay"; }
    done
    log "kube: both overlays render with $kubectl ($("$kubectl" version --client 2>&1 | head -1 | cut -c1-60))"
  done
  [ -s "$rendered" ] || die "no kubectl to render deploy/k8s with (run deploy/build.sh)"
  local tls=$tmp/kube-tls
  deploy/k8s/tls-secrets.sh "$tls" 2 2 > "$tmp/k8s-secrets.yaml" 2> /dev/null
  readable_by_containers "$tls"
  cat "$tmp/k8s-secrets.yaml" "$rendered" | build/bin/pstrain-kube-for-podman > "$play" ||
    die "pstrain-kube-for-podman (build it: cmake --build build --target pstrain-kube-for-podman)"
  podman network create pstrain-kube > /dev/null
  log "kube: podman kube play of the cpu overlay (StatefulSets as Pods, Services as pod names)"
  podman kube play --network pstrain-kube "$play" > "$tmp/kube-play.log" 2>&1 ||
    { tail -20 "$tmp/kube-play.log"; die "podman kube play"; }
  # An admin's container beside the pods, for psctl over TLS with a token.
  local admin=pstrain-kube-admin jobs=""
  podman run -d --name "$admin" --network pstrain-kube -v "$tls:/etc/pstrain/tls:ro" \
    --entrypoint sleep "$IMAGE" 900 > /dev/null
  local psctl=(podman exec "$admin" psctl --coordinator=pstrain-coordinator-pod-0:50050
               --tls_cert=/etc/pstrain/tls/admin.crt --tls_key=/etc/pstrain/tls/admin.key
               --tls_ca=/etc/pstrain/tls/ca.crt --token_file=/etc/pstrain/tls/operator.token)
  local coordinator=pstrain-coordinator-pod-0-coordinator
  local deadline=$(($(date +%s) + 600))
  until grep -q JOB_STATE_SUCCEEDED <<< "$jobs"; do
    if grep -q -e JOB_STATE_FAILED -e JOB_STATE_CANCELLED <<< "$jobs" ||
       [ "$(date +%s)" -ge $deadline ]; then
      podman logs pstrain-submit-example-submit 2>&1 | tail -5
      podman logs "$coordinator" 2>&1 | tail -20
      die "the example job submitted by the kube Job did not succeed: $jobs"
    fi
    sleep 2
    jobs=$("${psctl[@]}" -o json list 2> /dev/null || true)
  done
  log "kube: the example job submitted over TLS by pstrain-submit-example succeeded: $("${psctl[@]}" list 2> /dev/null | sed -n 2p)"
  podman rm -f "$admin" > /dev/null
  podman kube down "$play" > /dev/null 2>> "$tmp/podman.log" || die "podman kube down"
  # kube down leaves the claims' volumes.
  podman volume rm -f pstrain-checkpoints pstrain-coordinator-state > /dev/null
  podman network rm -f pstrain-kube > /dev/null
}

# (Phases run as plain statements: `set -e` does not stop a function that
# runs as the condition of an if or before && or ||.)
make_images
if has_phase pod; then pod_phase; fi
if has_phase compose; then compose_phase; fi
if has_phase kube; then kube_phase; fi
[ -f "$tmp/figures" ] && sed 's/^/  /' "$tmp/figures"
log "passed"
exit 0
}
