#!/bin/bash
# pstrain vs PyTorch DistributedDataParallel on examples/torch/fashion_cnn.py:
# 2 worker processes, batch 32 each, Adam, one torch and one BLAS thread per
# process, the same epochs; pstrain with 2 servers (pstrain-run), DDP over
# gloo (two processes with torch's env:// rendezvous). The two run alternately, PAIRS times; the
# table has each run and the medians.
#   bench/torch_vs_ddp.sh [BUILD_DIR]     (EPOCHS=3 PAIRS=3 by default)
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build}
epochs=${EPOCHS:-3}
pairs=${PAIRS:-3}
export PYTHONPATH="$PWD/$build/python${PYTHONPATH:+:$PYTHONPATH}"
export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1
out=$(mktemp -d)
sed "s/^epochs: .*/epochs: $epochs/" examples/torch/fashion_cnn.yaml > "$out/job.yaml"
for pair in $(seq "$pairs"); do
  # The script's own line is in its log (worker 0's).
  "$build/bin/pstrain-run" --workers 2 --servers 2 --job "$out/job.yaml" --run_dir "$out/run-$pair" \
    -- /usr/bin/python3 examples/torch/fashion_cnn.py > "$out/run-$pair.out"
  cat "$out/run-$pair"/worker-*.log | grep '"system"' >> "$out/results.jsonl"
  # Debian's torch.distributed.run fails on Python 3.11: the processes by
  # hand, with torch's env:// rendezvous.
  port=$(/usr/bin/python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
  for rank in 0 1; do
    MASTER_ADDR=127.0.0.1 MASTER_PORT=$port RANK=$rank WORLD_SIZE=2 \
      /usr/bin/python3 examples/torch/fashion_cnn.py --ddp --epochs "$epochs" > "$out/ddp-$pair-$rank.out" 2>&1 &
  done
  wait
  cat "$out/ddp-$pair"-*.out | grep '"system"' >> "$out/results.jsonl"
done
/usr/bin/python3 - "$out/results.jsonl" "$epochs" <<'PY'
import json, statistics, sys
runs = [json.loads(l) for l in open(sys.argv[1])]
print("| run | system | test accuracy | samples/s |")
print("|---|---|---|---|")
for i, r in enumerate(runs):
    print("| %d | %s | %.4f | %.1f |" % (i // 2 + 1, r["system"], r["test_accuracy"], r["samples_per_second"]))
med = {s: (statistics.median(r["test_accuracy"] for r in runs if r["system"] == s),
           statistics.median(r["samples_per_second"] for r in runs if r["system"] == s))
       for s in ("pstrain", "ddp")}
for s, (a, v) in med.items():
    print("| median | %s | %.4f | %.1f |" % (s, a, v))
print()
print("%s epochs: pstrain / DDP samples/s %.3f, accuracy difference %+.4f" % (
    sys.argv[2], med["pstrain"][1] / med["ddp"][1], med["pstrain"][0] - med["ddp"][0]))
PY
rm -rf "$out"
