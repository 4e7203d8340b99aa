#!/bin/bash
# The click model against PyTorch DistributedDataParallel: one epoch of
# generated click logs (pstrain-clickgen: 1,000,000 lines, 26 fields of
# 1,000,000 Zipf ids each, 13 integer features) in batches of 512 per
# worker, 2 workers, Adagrad on dense tensors and tables:
#   builtin: pstrain's built-in click model (pstrain-local: 2 workers, 2 servers)
#   torch:   examples/torch/dlrm.py under pstrain-run (2 workers, 2 servers,
#            the tables pst.EmbeddingBags)
#   ddp:     the same script with --ddp (2 processes, gloo, each holding every
#            table as nn.EmbeddingBag(sparse=True) of 1,000,001 rows),
#            OMP_NUM_THREADS=1 as torchrun sets it (and OPENBLAS_NUM_THREADS=1)
#   single:  the same script with --single: one process, batch 1024, a torch
#            thread per CPU (what a user of one machine runs instead)
# The same model (bottom [64], dim 16, dot interaction, top [64]), samples
# and learning rates; pstrain's started as the docs say (no thread
# variable: pstrain-local and pstrain-run size the threads). The four run
# in turn, PAIRS times; the table has each run (samples/s over the training
# loop, test AUC, the largest worker peak RSS, the servers' largest) and
# the medians.
#   [PAIRS=3] [ROWS=1000000] [VOCABULARY=1000000] bench/dlrm_vs_ddp.sh [BUILD_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build}
pairs=${PAIRS:-3}
rows=${ROWS:-1000000}
vocabulary=${VOCABULARY:-1000000}
export PYTHONPATH="$PWD/$build/python${PYTHONPATH:+:$PYTHONPATH}"
unset OMP_NUM_THREADS OPENBLAS_NUM_THREADS MKL_NUM_THREADS
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
data=$out/clicks
"$build/bin/pstrain-clickgen" --out "$data" --train_rows "$rows" --test_rows 100000 \
  --vocabulary "$vocabulary" > /dev/null
{
  echo "name: dlrm-builtin"
  echo "model: {type: click, click: {bottom: [64], top: [64], interaction: dot, pooling: sum}}"
  echo "data: {clicks: {dense: 13, fields: 26, train_files: [$data/train.txt], test_files: [$data/test.txt]}}"
  echo "optimizer: {type: adagrad, learning_rate: 0.02}"
  echo "mode: sync"
  echo "batch_size: 512"
  echo "steps: $((rows / 1024))"  # one epoch (files: no epochs)
  echo "num_workers: 2"
  echo "num_servers: 2"
  echo "seed: 1"
  echo "tables:"
  for f in $(seq 26); do
    echo "  - {name: c$f, dim: 16, fields: [$f], optimizer: {type: adagrad, learning_rate: 0.05}}"
  done
} > "$out/builtin.yaml"

# Peak RSS of the workers (dlrm.py's processes too) and servers.
watch_start() { /usr/bin/python3 bench/peak_rss.py "$out/rss" dlrm.py & watcher=$!; }
# Stops the watcher and records SYSTEM's run: the last JSON line of FILE
# that has a test AUC, with the peaks.
watch_stop() {
  kill "$watcher"
  wait "$watcher" || true
  /usr/bin/python3 - "$1" "$2" "$out/rss" >> "$out/results.jsonl" <<'PY'
import json, sys
r = json.loads([l for l in open(sys.argv[2]) if l.startswith("{") and '"test_auc"' in l][-1])
worker_mib, server_mib = map(int, open(sys.argv[3]).read().split())
print(json.dumps({"system": sys.argv[1], "samples_per_second": r["samples_per_second"],
                  "test_auc": r["test_auc"], "worker_mib": worker_mib, "server_mib": server_mib}))
PY
}

for pair in $(seq "$pairs"); do
  watch_start
  "$build/bin/pstrain-local" --job "$out/builtin.yaml" > "$out/builtin.out"
  watch_stop builtin "$out/builtin.out"

  # Like DDP and the built-in run, no checkpoint but the last step's
  # (pstrain-run's default is one every 100 steps).
  { sed "s/train_samples: 1000000/train_samples: $rows/" examples/torch/dlrm.yaml
    echo "checkpoint: {dir: $out/run-$pair/checkpoints, every_steps: 1000000000}"
  } > "$out/torch.yaml"
  watch_start
  "$build/bin/pstrain-run" --workers 2 --servers 2 --job "$out/torch.yaml" --run_dir "$out/run-$pair" \
    -- /usr/bin/python3 examples/torch/dlrm.py --data "$data" > /dev/null
  watch_stop torch "$out/run-$pair/worker-0.log"

  # Debian's torch.distributed.run fails on Python 3.11: the processes by
  # hand, with torch's env:// rendezvous.
  port=$(/usr/bin/python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
  watch_start
  ranks=()
  for rank in 0 1; do
    OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 MASTER_ADDR=127.0.0.1 MASTER_PORT=$port RANK=$rank \
      WORLD_SIZE=2 /usr/bin/python3 examples/torch/dlrm.py --data "$data" --ddp --batch 512 \
      --seed 1 > "$out/ddp-$rank.out" 2>&1 &
    ranks+=($!)
  done
  wait "${ranks[@]}"
  watch_stop ddp "$out/ddp-0.out"

  watch_start
  /usr/bin/python3 examples/torch/dlrm.py --data "$data" --single --batch 1024 --seed 1 \
    > "$out/single.out" 2>&1
  watch_stop single "$out/single.out"
done

/usr/bin/python3 - "$out/results.jsonl" "$rows" "$vocabulary" <<'PY'
import json, statistics, sys
runs = [json.loads(l) for l in open(sys.argv[1])]
systems = ("builtin", "torch", "ddp", "single")
print("| run | system | samples/s | test AUC | worker peak RSS (MiB) | server peak RSS (MiB) |")
print("|---|---|---|---|---|---|")
for i, r in enumerate(runs):
    print("| %d | %s | %.0f | %.4f | %d | %s |" % (i // 4 + 1, r["system"], r["samples_per_second"],
          r["test_auc"], r["worker_mib"], r["server_mib"] or "-"))
med = {s: {k: statistics.median(r[k] for r in runs if r["system"] == s)
           for k in ("samples_per_second", "test_auc", "worker_mib", "server_mib")}
       for s in systems}
for s in systems:
    m = med[s]
    print("| median | %s | %.0f | %.4f | %d | %s |" % (s, m["samples_per_second"], m["test_auc"],
          m["worker_mib"], int(m["server_mib"]) or "-"))
print()
for s in ("builtin", "torch"):
    for other, name in (("ddp", "DDP"), ("single", "one process")):
        print("%s rows, %s ids per field: %s / %s samples/s %.2f, AUC difference %+.4f" % (
            sys.argv[2], sys.argv[3], s, name,
            med[s]["samples_per_second"] / med[other]["samples_per_second"],
            med[s]["test_auc"] - med[other]["test_auc"]))
PY
