#!/bin/bash
# pstrain vs PyTorch DistributedDataParallel and vs one process on a torch
# script, the same epochs and samples in the same order:
#   pstrain: pstrain-run, 2 workers x batch 32, 2 servers, started as the
#            docs say (no thread variable: pstrain-run sizes the threads)
#   ddp:     2 processes x batch 32 over gloo (torch's env:// rendezvous),
#            OMP_NUM_THREADS=1 as torchrun sets it (and OPENBLAS_NUM_THREADS=1)
#   single:  one process, batch 64, a torch thread per CPU (--single)
# The three run in turn, PAIRS times; the table has each run and the
# medians, and pstrain-run's step-time line of each pstrain run (the
# script's wait).
#   [MODEL=cnn|mlp50|regression] [EPOCHS=N] [PAIRS=3] bench/torch_vs_ddp.sh [BUILD_DIR]
# cnn: examples/torch/fashion_cnn.py, Adam, 3 epochs of Fashion-MNIST;
# mlp50: the same script's 50.7 MB perceptron, Adam, 1 epoch of SAMPLES
# (6400) images; regression: examples/torch/regression.py, the tutorials'
# small model, SGD, 20 epochs of 1,000 samples.
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build}
model=${MODEL:-cnn}
pairs=${PAIRS:-3}
export PYTHONPATH="$PWD/$build/python${PYTHONPATH:+:$PYTHONPATH}"
unset OMP_NUM_THREADS OPENBLAS_NUM_THREADS MKL_NUM_THREADS
out=$(mktemp -d)
case "$model" in
  cnn) epochs=${EPOCHS:-3}; job=examples/torch/fashion_cnn.yaml
       script=(examples/torch/fashion_cnn.py) ;;
  mlp50) epochs=${EPOCHS:-1}; samples=${SAMPLES:-6400}; job=examples/torch/fashion_cnn.yaml
         script=(examples/torch/fashion_cnn.py --model mlp50 --train-samples "$samples") ;;
  regression) epochs=${EPOCHS:-20}; job=examples/torch/regression.yaml
              script=(examples/torch/regression.py) ;;
  *) echo "MODEL must be cnn, mlp50 or regression" >&2; exit 2 ;;
esac
sed "s/^epochs: .*/epochs: $epochs/" "$job" > "$out/job.yaml"
if [ -n "${samples:-}" ]; then
  sed -i "s/train_samples: [0-9]*/train_samples: $samples/" "$out/job.yaml"
fi
for pair in $(seq "$pairs"); do
  # The script's own line is in its log (worker 0's).
  "$build/bin/pstrain-run" --workers 2 --servers 2 --job "$out/job.yaml" --run_dir "$out/run-$pair" \
    -- /usr/bin/python3 "${script[@]}" > "$out/run-$pair.out"
  cat "$out/run-$pair"/worker-*.log | grep '"system"' >> "$out/results.jsonl"
  grep '^step time' "$out/run-$pair.out" >> "$out/step-times.txt" || true
  # Debian's torch.distributed.run fails on Python 3.11: the processes by
  # hand, with torch's env:// rendezvous.
  port=$(/usr/bin/python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
  for rank in 0 1; do
    OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 MASTER_ADDR=127.0.0.1 MASTER_PORT=$port RANK=$rank \
      WORLD_SIZE=2 /usr/bin/python3 "${script[@]}" --ddp --epochs "$epochs" \
      > "$out/ddp-$pair-$rank.out" 2>&1 &
  done
  wait
  cat "$out/ddp-$pair"-*.out | grep '"system"' >> "$out/results.jsonl"
  /usr/bin/python3 "${script[@]}" --single --batch 64 --epochs "$epochs" > "$out/single-$pair.out" 2>&1
  grep '"system"' "$out/single-$pair.out" >> "$out/results.jsonl"
done
/usr/bin/python3 - "$out/results.jsonl" "$epochs" "$model" <<'PY'
import json, statistics, sys
runs = [json.loads(l) for l in open(sys.argv[1])]
quality = "test_mse" if "test_mse" in runs[0] else "test_accuracy"
print("| run | system | %s | samples/s |" % quality.replace("_", " "))
print("|---|---|---|---|")
for i, r in enumerate(runs):
    print("| %d | %s | %.4f | %.1f |" % (i // 3 + 1, r["system"], r[quality], r["samples_per_second"]))
med = {s: (statistics.median(r[quality] for r in runs if r["system"] == s),
           statistics.median(r["samples_per_second"] for r in runs if r["system"] == s))
       for s in ("pstrain", "ddp", "single")}
for s, (a, v) in med.items():
    print("| median | %s | %.4f | %.1f |" % (s, a, v))
print()
for other, name in (("ddp", "DDP"), ("single", "one process")):
    print("%s, %s epochs: pstrain / %s samples/s %.3f, %s difference %+.4f" % (
        sys.argv[3], sys.argv[2], name, med["pstrain"][1] / med[other][1],
        quality.replace("_", " "), med["pstrain"][0] - med[other][0]))
PY
sed 's/^/pstrain-run: /' "$out/step-times.txt"
rm -rf "$out"
