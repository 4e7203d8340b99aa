#!/bin/bash
# Makes a certificate authority and the certificates of a local pstrain
# cluster, for mutual TLS (--tls_cert, --tls_key, --tls_ca), and bearer
# tokens for the control API (--auth_tokens_file, psctl --token_file):
#
#   DIR/ca.crt, DIR/ca.key                the CA (kept to add nodes later)
#   DIR/coordinator.{crt,key}             the coordinator
#   DIR/admin.{crt,key}                   a client certificate for psctl
#   DIR/server-N.{crt,key}                N = 0 .. SERVERS-1
#   DIR/worker-N.{crt,key}                N = 0 .. WORKERS-1
#   DIR/auth_tokens                       the coordinator's --auth_tokens_file
#   DIR/operator.token, DIR/viewer.token  the two users' tokens
#
# usage: make-dev-certs.sh DIR [SERVERS [WORKERS]]   (default 2 servers, 2 workers)
#        make-dev-certs.sh DIR --names NAME...        (nodes of these names instead,
#                                                      e.g. pstrain-server-0 for a pod)
# A certificate's common name is the node's id and carries its role (see
# docs/security.md). Files that exist are kept, so running it
# again with more nodes adds only theirs. PSTRAIN_CERT_DAYS sets how long
# new node certificates are valid (default 365; negative: already expired).
# These are development certificates: the CA key lies beside them.
set -euo pipefail

usage() { echo "usage: $0 DIR [SERVERS [WORKERS]] | DIR --names NAME..." >&2; exit 2; }
[ $# -ge 1 ] || usage
dir=$1
shift
names=(coordinator admin)
if [ "${1:-}" = "--names" ]; then
  shift
  [ $# -ge 1 ] || usage
  names+=("$@")
else
  servers=${1:-2}
  workers=${2:-2}
  [[ "$servers" =~ ^[0-9]+$ && "$workers" =~ ^[0-9]+$ ]] || usage
  for ((i = 0; i < servers; i++)); do names+=("server-$i"); done
  for ((i = 0; i < workers; i++)); do names+=("worker-$i"); done
fi
days=${PSTRAIN_CERT_DAYS:-365}

if ! command -v openssl >/dev/null; then
  sudo=""
  [ "$(id -u)" -eq 0 ] || sudo="sudo"
  echo "installing openssl" >&2
  DEBIAN_FRONTEND=noninteractive $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends openssl >/dev/null
fi

mkdir -p "$dir"
umask 077
cd "$dir"
if [ ! -f ca.key ]; then
  openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -sha256 \
    -keyout ca.key -out ca.crt -days 3650 -subj "/CN=pstrain-dev-ca" \
    -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign" \
    2>/dev/null
fi
for name in "${names[@]}"; do
  [ -f "$name.crt" ] && [ -f "$name.key" ] && continue
  openssl req -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -sha256 \
    -keyout "$name.key" -out "$name.csr" -subj "/CN=$name" 2>/dev/null
  printf '%s\n' "basicConstraints=CA:FALSE" "keyUsage=critical,digitalSignature,keyEncipherment" \
    "extendedKeyUsage=serverAuth,clientAuth" \
    "subjectAltName=DNS:$name,DNS:localhost,IP:127.0.0.1" > "$name.ext"
  openssl x509 -req -in "$name.csr" -CA ca.crt -CAkey ca.key -CAcreateserial -sha256 \
    -days "$days" -extfile "$name.ext" -out "$name.crt" 2>/dev/null
  rm -f "$name.csr" "$name.ext"
done
if [ ! -f auth_tokens ]; then
  : > auth_tokens
  for user in operator viewer; do
    openssl rand -hex 32 > "$user.token"
    echo "$user $user $(tr -d '\n' < "$user.token" | sha256sum | cut -d' ' -f1)" >> auth_tokens
  done
fi
# Readable by the processes that mount them (a container's user); the
# directory itself stays private to its owner.
chmod 644 ./*.crt
chmod 600 ./*.key ./*.token auth_tokens
chmod 700 .
echo "certificates in $dir: ${names[*]}"
