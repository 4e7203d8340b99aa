#!/bin/bash
# Compact rows against fp32 element-wise Adagrad on the built-in click
# model of bench/dlrm_vs_ddp.sh (one epoch of 1,000,000 generated lines,
# 26 fields of 1,000,000 Zipf ids, 13 integer features; 2 workers, 2
# servers, batch 512; the same model, samples and learning rates), the
# tables' optimizer and value type varied:
#   adagrad:      fp32 values, an accumulator a value (208 bytes a dim-16 row)
#   rowwise:      fp32 values, rowwise_adagrad (148 bytes)
#   rowwise-bf16: bf16 values, rowwise_adagrad (116 bytes)
#   adagrad-bf16: bf16 values, an accumulator a value (176 bytes)
# Each runs in turn, ROUNDS times, started as the docs say (pstrain-local);
# the table has each run's samples/s, test AUC and the servers' peak RSS,
# and each variant's AUC against adagrad's in the same round.
#   [ROUNDS=2] [ROWS=1000000] [VOCABULARY=1000000] bench/compact_rows.sh [BUILD_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build}
rounds=${ROUNDS:-2}
rows=${ROWS:-1000000}
vocabulary=${VOCABULARY:-1000000}
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
data=$out/clicks
"$build/bin/pstrain-clickgen" --out "$data" --train_rows "$rows" --test_rows 100000 \
  --vocabulary "$vocabulary" > /dev/null
variants=(adagrad rowwise rowwise-bf16 adagrad-bf16)
for variant in "${variants[@]}"; do
  case $variant in
    adagrad) table="optimizer: {type: adagrad, learning_rate: 0.05}" ;;
    rowwise) table="optimizer: {type: rowwise_adagrad, learning_rate: 0.05}" ;;
    rowwise-bf16) table="optimizer: {type: rowwise_adagrad, learning_rate: 0.05}, value_dtype: bf16" ;;
    adagrad-bf16) table="optimizer: {type: adagrad, learning_rate: 0.05}, value_dtype: bf16" ;;
  esac
  {
    echo "name: compact-$variant"
    echo "model: {type: click, click: {bottom: [64], top: [64], interaction: dot, pooling: sum}}"
    echo "data: {clicks: {dense: 13, fields: 26, train_files: [$data/train.txt], test_files: [$data/test.txt]}}"
    echo "optimizer: {type: adagrad, learning_rate: 0.02}"
    echo "mode: sync"
    echo "batch_size: 512"
    echo "steps: $((rows / 1024))"
    echo "num_workers: 2"
    echo "num_servers: 2"
    echo "seed: 1"
    echo "tables:"
    for f in $(seq 26); do echo "  - {name: c$f, dim: 16, fields: [$f], $table}"; done
  } > "$out/$variant.yaml"
done

for round in $(seq "$rounds"); do
  for variant in "${variants[@]}"; do
    /usr/bin/python3 bench/peak_rss.py "$out/rss" & watcher=$!
    "$build/bin/pstrain-local" --job "$out/$variant.yaml" > "$out/$variant.out"
    kill "$watcher"
    wait "$watcher" || true
    /usr/bin/python3 - "$round" "$variant" "$out/$variant.out" "$out/rss" >> "$out/results.jsonl" <<'PY'
import json, sys
r = json.loads([l for l in open(sys.argv[3]) if l.startswith("{") and '"test_auc"' in l][-1])
print(json.dumps({"round": int(sys.argv[1]), "variant": sys.argv[2],
                  "samples_per_second": r["samples_per_second"], "test_auc": r["test_auc"],
                  "server_mib": int(open(sys.argv[4]).read().split()[1])}))
PY
  done
done

/usr/bin/python3 - "$out/results.jsonl" <<'PY'
import json, statistics, sys
runs = [json.loads(l) for l in open(sys.argv[1])]
base = {r["round"]: r for r in runs if r["variant"] == "adagrad"}
print("| round | variant | samples/s | test AUC | AUC − adagrad's | servers' peak RSS (MiB) |")
print("|---|---|---|---|---|---|")
for r in runs:
    b = base[r["round"]]
    print("| %d | %s | %.0f | %.4f | %+.4f | %d |" % (r["round"], r["variant"],
          r["samples_per_second"], r["test_auc"], r["test_auc"] - b["test_auc"], r["server_mib"]))
for v in dict.fromkeys(r["variant"] for r in runs):
    mine = [r for r in runs if r["variant"] == v]
    print("%s: samples/s %.2f x adagrad's, AUC %+.4f (medians of %d rounds)" % (
        v, statistics.median(r["samples_per_second"] / base[r["round"]]["samples_per_second"]
                             for r in mine),
        statistics.median(r["test_auc"] - base[r["round"]]["test_auc"] for r in mine), len(mine)))
PY
