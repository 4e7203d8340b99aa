#!/bin/bash
# The Secrets that deploy/k8s mounts, one per role, as YAML on stdout:
#   pstrain-tls-coordinator  ca.crt, coordinator.{crt,key}, auth_tokens
#   pstrain-tls-server       ca.crt, pstrain-server-N.{crt,key} for every server pod
#   pstrain-tls-worker       ca.crt, pstrain-worker-N.{crt,key} for every worker pod
#   pstrain-tls-admin        ca.crt, admin.{crt,key}, operator.token (psctl, the submit Job)
# from the certificates and tokens of deploy/tls/make-dev-certs.sh in DIR
# (made there if missing, named after the StatefulSets' pods):
#
#   deploy/k8s/tls-secrets.sh DIR [SERVERS [WORKERS]] | kubectl apply -n pstrain -f -
#
# Keep DIR (it holds the CA's key and the tokens) to add pods or users.
set -euo pipefail
[ $# -ge 1 ] || { echo "usage: $0 DIR [SERVERS [WORKERS]]" >&2; exit 2; }
dir=$1 servers=${2:-2} workers=${3:-2}
[[ "$servers" =~ ^[0-9]+$ && "$workers" =~ ^[0-9]+$ ]] || { echo "usage: $0 DIR [SERVERS [WORKERS]]" >&2; exit 2; }
servers_names=() workers_names=()
for ((i = 0; i < servers; i++)); do servers_names+=("pstrain-server-$i"); done
for ((i = 0; i < workers; i++)); do workers_names+=("pstrain-worker-$i"); done
"$(dirname "$0")/../tls/make-dev-certs.sh" "$dir" --names "${servers_names[@]}" "${workers_names[@]}" >&2

# secret NAME FILE...: a Secret holding the files, keyed by their names.
secret() {
  local name=$1 file
  shift
  printf -- '---\napiVersion: v1\nkind: Secret\nmetadata:\n  name: %s\n  labels:\n    app.kubernetes.io/part-of: pstrain\ntype: Opaque\ndata:\n' "$name"
  for file in "$@"; do
    printf '  %s: %s\n' "$file" "$(base64 -w0 < "$dir/$file")"
  done
}
pairs() { local n; for n in "$@"; do echo "$n.crt $n.key"; done; }
secret pstrain-tls-coordinator ca.crt coordinator.crt coordinator.key auth_tokens
# shellcheck disable=SC2046
secret pstrain-tls-server ca.crt $(pairs "${servers_names[@]}")
# shellcheck disable=SC2046
secret pstrain-tls-worker ca.crt $(pairs "${workers_names[@]}")
secret pstrain-tls-admin ca.crt admin.crt admin.key operator.token
