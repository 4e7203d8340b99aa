#!/bin/bash
# Embedding tables at their memory cap: the built-in click model on
# generated click logs where most keys are new (pstrain-clickgen: ROWS
# lines, 8 fields of a flat Zipf (0.5) over 10^8 ids, 4 integer features),
# 2 workers, 2 servers (pstrain-local), batch 512 a worker, a checkpoint
# every 50 steps, run with no cap and with each CAPS cap (max_memory_bytes
# on every table, per server), in turn, PAIRS times. Prints each run
# (samples/s, test AUC, the servers' peak RSS) and, per cap, the
# median samples/s against the uncapped runs'.
#   [PAIRS=3] [ROWS=1000000] [CAPS="16000000 64000000"] bench/tables_at_cap.sh [BUILD_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build}
pairs=${PAIRS:-3}
rows=${ROWS:-1000000}
caps=${CAPS:-16000000 64000000}
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
data=$out/clicks
"$build/bin/pstrain-clickgen" --out "$data" --train_rows "$rows" --test_rows 100000 \
  --fields 8 --dense 4 --vocabulary 100000000 --zipf 0.5 > /dev/null

# The job with every table capped at CAP bytes (0: none).
job() {
  echo "name: tables-at-cap"
  echo "model: {type: click, click: {bottom: [64], top: [64], interaction: dot, pooling: sum}}"
  echo "data: {clicks: {dense: 4, fields: 8, train_files: [$data/train.txt], test_files: [$data/test.txt]}}"
  echo "optimizer: {type: adagrad, learning_rate: 0.02}"
  echo "mode: sync"
  echo "batch_size: 512"
  echo "steps: $((rows / 1024))"
  echo "num_workers: 2"
  echo "num_servers: 2"
  echo "seed: 1"
  echo "checkpoint: {dir: $out/checkpoints-$1-$2, every_steps: 50}"
  echo "tables:"
  for f in $(seq 8); do
    echo -n "  - {name: c$f, dim: 16, fields: [$f], optimizer: {type: adagrad, learning_rate: 0.05}"
    [ "$1" = 0 ] && echo "}" || echo ", max_memory_bytes: $1}"
  done
}

for pair in $(seq "$pairs"); do
  for cap in 0 $caps; do
    job "$cap" "$pair" > "$out/job.yaml"
    /usr/bin/python3 bench/peak_rss.py "$out/rss" &
    watcher=$!
    "$build/bin/pstrain-local" --job "$out/job.yaml" > "$out/run.out"
    kill "$watcher"
    wait "$watcher" || true
    /usr/bin/python3 - "$cap" "$out/run.out" "$out/rss" >> "$out/results.jsonl" <<'PY'
import json, sys
r = json.loads([l for l in open(sys.argv[2]) if l.startswith("{") and '"test_auc"' in l][-1])
server_mib = int(open(sys.argv[3]).read().split()[1])
print(json.dumps({"cap": int(sys.argv[1]), "samples_per_second": r["samples_per_second"],
                  "test_auc": r["test_auc"], "server_mib": server_mib}))
PY
    rm -rf "$out/checkpoints-$cap-$pair"
  done
done

/usr/bin/python3 - "$out/results.jsonl" <<'PY'
import json, statistics, sys
runs = [json.loads(l) for l in open(sys.argv[1])]
caps = sorted({r["cap"] for r in runs})
print("| cap a table, per server | samples/s | test AUC | servers' peak RSS (MiB) |")
print("|---|---|---|---|")
for r in runs:
    print("| %s | %.0f | %.4f | %d |" % (r["cap"] or "none", r["samples_per_second"], r["test_auc"],
                                       r["server_mib"]))
med = {c: statistics.median(r["samples_per_second"] for r in runs if r["cap"] == c) for c in caps}
for c in caps[1:]:
    print("cap %d bytes a table: median samples/s %.0f, %.3fx uncapped (%.0f)" % (
        c, med[c], med[c] / med[0], med[0]))
PY
