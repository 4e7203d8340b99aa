"""The two-convolution CNN of examples/fashion_cnn.yaml (3x3 convolutions of
32 and 64 filters, each with ReLU and 2x2 max-pooling, a dense layer of 128,
10 logits) in PyTorch, trained on Fashion-MNIST from the Debian package's
files (no download). Two ways, to compare them:

  pstrain-run --workers 2 --servers 2 --job examples/torch/fashion_cnn.yaml \\
      -- python3 examples/torch/fashion_cnn.py
  export OMP_NUM_THREADS=1 MASTER_ADDR=127.0.0.1 MASTER_PORT=29500 WORLD_SIZE=2  # as torchrun
  RANK=0 python3 examples/torch/fashion_cnn.py --ddp & RANK=1 python3 examples/torch/fashion_cnn.py --ddp
  python3 examples/torch/fashion_cnn.py --single --batch 64

--model mlp50 trains a multilayer perceptron of 50.7 MB of parameters
(784-4096-2304-10, 12.68 million floats) instead, where moving the
gradients and values costs more than computing them; --train-samples N
trains on the first N images (the job file's data.train_samples must say
the same).

With pstrain the servers run Adam (the job file's) and the workers push
gradients; with --ddp each process runs torch's Adam after
DistributedDataParallel's all-reduce (gloo); with --single one process
trains on the global batch with as many torch threads as it has CPUs
(what a user of one machine would run instead). All three: the same
epochs, the same samples in the same order (pstrain.sample_order with the
job's seed), the threads each launch gives (pstrain-run sizes them,
torchrun sets OMP_NUM_THREADS=1). The last line is a JSON object with the
test accuracy and the training samples/s.
"""
import argparse
import gzip
import json
import os
import time

import numpy as np
import torch
import torch.nn.functional as F

DATA = os.environ.get("PSTRAIN_DATA_DIR", "/usr/share/datasets/fashion-mnist")


def load(prefix):
    with gzip.open(os.path.join(DATA, prefix + "-images-idx3-ubyte.gz")) as f:
        images = np.frombuffer(f.read(), np.uint8, offset=16)
    with gzip.open(os.path.join(DATA, prefix + "-labels-idx1-ubyte.gz")) as f:
        labels = np.frombuffer(f.read(), np.uint8, offset=8)
    x = torch.from_numpy(images.reshape(-1, 1, 28, 28).astype(np.float32) / 255.0)
    return x, torch.from_numpy(labels.astype(np.int64))


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv0 = torch.nn.Conv2d(1, 32, 3, padding=1)
        self.conv1 = torch.nn.Conv2d(32, 64, 3, padding=1)
        self.layer0 = torch.nn.Linear(64 * 7 * 7, 128)
        self.layer1 = torch.nn.Linear(128, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv0(x)), 2)
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        return self.layer1(F.relu(self.layer0(x.flatten(1))))


def mlp50():
    """784-4096-2304-10: 12,677,898 parameters, 50.7 MB."""
    return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(784, 4096), torch.nn.ReLU(),
                               torch.nn.Linear(4096, 2304), torch.nn.ReLU(),
                               torch.nn.Linear(2304, 10))


def evaluate(net, x, y):
    net.eval()
    with torch.no_grad():
        correct, loss = 0, 0.0
        for i in range(0, len(x), 1000):
            out = net(x[i:i + 1000])
            loss += float(F.cross_entropy(out, y[i:i + 1000], reduction="sum"))
            correct += int((out.argmax(1) == y[i:i + 1000]).sum())
    net.train()
    return correct / len(x), loss / len(x)


def train_pstrain(net, train, test):
    import pstrain.torch as pst
    opt = pst.DistributedOptimizer(net, overlap_values=True)  # the forward awaits each layer
    x, y = train
    start, samples = time.monotonic(), 0
    for idx in pst.ShardSampler(opt.client, len(x)):
        opt.zero_grad()
        loss = F.cross_entropy(net(x[idx]), y[idx])
        loss.backward()
        opt.step(loss, len(idx))
        samples += len(idx)
    seconds = time.monotonic() - start
    accuracy, test_loss = evaluate(net, *test)  # the final model: every worker has it
    opt.finish(test_accuracy=accuracy, test_loss=test_loss)
    return opt.client.worker_index, opt.client.num_workers, samples, seconds, accuracy


def train_torch(net, train, test, epochs, batch, seed, distributed):
    """torch's Adam, under DDP (one process of WORLD_SIZE, gloo) or alone."""
    rank, world, model = 0, 1, net
    if distributed:
        import torch.distributed as dist
        dist.init_process_group("gloo")
        rank, world = dist.get_rank(), dist.get_world_size()
        model = torch.nn.parallel.DistributedDataParallel(net)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x, y = train
    per_epoch = len(x) // (batch * world)
    start, samples = time.monotonic(), 0
    for epoch in range(epochs):
        # The batches pstrain's sharding gives (the job's seed): every way
        # trains on the same samples in the same order.
        import pstrain
        order = torch.from_numpy(pstrain.sample_order(seed, epoch, len(x)))
        for step in range(per_epoch):
            first = step * batch * world + rank * batch
            idx = order[first:first + batch]
            opt.zero_grad()
            F.cross_entropy(model(x[idx]), y[idx]).backward()
            opt.step()
            samples += len(idx)
    seconds = time.monotonic() - start
    accuracy, _ = evaluate(net, *test)
    if distributed:
        dist.destroy_process_group()
    return rank, world, samples, seconds, accuracy


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--ddp", action="store_true", help="DistributedDataParallel (gloo) instead")
    parser.add_argument("--single", action="store_true",
                        help="one process on every CPU it may use instead")
    parser.add_argument("--epochs", type=int, default=3,
                        help="--ddp, --single: epochs (pstrain: the job's)")
    parser.add_argument("--batch", type=int, default=32,
                        help="--ddp: batch per process; --single: the batch (the global one)")
    parser.add_argument("--model", choices=("cnn", "mlp50"), default="cnn")
    parser.add_argument("--train-samples", type=int, default=60000,
                        help="the first N training images (pstrain: as the job's train_samples)")
    args = parser.parse_args()
    if args.single:
        torch.set_num_threads(len(os.sched_getaffinity(0)))
    torch.manual_seed(0)  # every worker starts from the same model (pstrain: worker 0's)
    net = Net() if args.model == "cnn" else mlp50()
    train, test = load("train"), load("t10k")
    train = (train[0][:args.train_samples], train[1][:args.train_samples])
    if args.ddp or args.single:
        rank, world, samples, seconds, accuracy = train_torch(net, train, test, args.epochs,
                                                              args.batch, 1, args.ddp)
    else:
        rank, world, samples, seconds, accuracy = train_pstrain(net, train, test)
    system = "ddp" if args.ddp else "single" if args.single else "pstrain"
    if rank == 0:
        print(json.dumps({"system": system, "workers": world, "threads": torch.get_num_threads(),
                          "test_accuracy": round(accuracy, 4),
                          "samples_per_second": round(samples * world / seconds, 1),
                          "train_seconds": round(seconds, 2)}), flush=True)


if __name__ == "__main__":
    main()
