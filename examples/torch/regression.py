"""The data-parallelism tutorials' small regression (nn.Sequential(Linear(10,
50), ReLU, Linear(50, 1)), mean squared error, SGD with learning rate 0.01,
batch 32 per process, 1,000 random samples), as a user brings it: through
pstrain.torch, or --ddp through DistributedDataParallel, or --single in
one process on the global batch with a torch thread per CPU, to compare
them.

  pstrain-run --workers 2 --servers 2 --job examples/torch/regression.yaml \\
      -- python3 examples/torch/regression.py
  export OMP_NUM_THREADS=1 MASTER_ADDR=127.0.0.1 MASTER_PORT=29500 WORLD_SIZE=2  # as torchrun
  RANK=0 python3 examples/torch/regression.py --ddp & RANK=1 python3 examples/torch/regression.py --ddp
  python3 examples/torch/regression.py --single --batch 64

All train on the same batches (pstrain.sample_order with the job's seed)
and report the mean squared error on 1,000 held-out samples as their
metric `test_mse` (in the job's result with pstrain). The last line is a
JSON object with it and the training samples/s.
"""
import argparse
import json
import os
import time

import torch
import torch.nn.functional as F

import pstrain


def data(seed, n=1000):
    """Random inputs, targets from a fixed random linear map plus noise."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 10, generator=g)
    w = torch.randn(10, 1, generator=torch.Generator().manual_seed(99))
    return x, x @ w + 0.1 * torch.randn(n, 1, generator=g)


def model():
    torch.manual_seed(0)  # every process starts from the same model
    return torch.nn.Sequential(torch.nn.Linear(10, 50), torch.nn.ReLU(), torch.nn.Linear(50, 1))


def test_mse(net, x, y):
    with torch.no_grad():
        return float(F.mse_loss(net(x), y))


def train_pstrain(net, train, test):
    import pstrain.torch as pst
    opt = pst.DistributedOptimizer(net)
    x, y = train
    start, samples = time.monotonic(), 0
    for idx in pst.ShardSampler(opt.client, len(x)):
        opt.zero_grad()
        loss = F.mse_loss(net(x[idx]), y[idx])
        loss.backward()
        opt.step(loss, len(idx))
        samples += len(idx)
    seconds = time.monotonic() - start
    mse = test_mse(net, *test)
    opt.finish(metrics={"test_mse": mse})
    return opt.client.worker_index, opt.client.num_workers, samples, seconds, mse


def train_torch(net, train, test, epochs, batch, seed, distributed):
    """torch's SGD, under DDP (one process of WORLD_SIZE, gloo) or alone."""
    rank, world, wrapped = 0, 1, net
    if distributed:
        import torch.distributed as dist
        dist.init_process_group("gloo")
        rank, world = dist.get_rank(), dist.get_world_size()
        wrapped = torch.nn.parallel.DistributedDataParallel(net)
    opt = torch.optim.SGD(wrapped.parameters(), lr=0.01)
    x, y = train
    per_epoch = len(x) // (batch * world)
    start, samples = time.monotonic(), 0
    for epoch in range(epochs):
        order = torch.from_numpy(pstrain.sample_order(seed, epoch, len(x)))
        for step in range(per_epoch):
            first = step * batch * world + rank * batch
            idx = order[first:first + batch]
            opt.zero_grad()
            F.mse_loss(wrapped(x[idx]), y[idx]).backward()
            opt.step()
            samples += len(idx)
    seconds = time.monotonic() - start
    mse = test_mse(net, *test)
    if distributed:
        dist.destroy_process_group()
    return rank, world, samples, seconds, mse


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--ddp", action="store_true", help="DistributedDataParallel (gloo) instead")
    parser.add_argument("--single", action="store_true",
                        help="one process on every CPU it may use instead")
    parser.add_argument("--epochs", type=int, default=20,
                        help="--ddp, --single: epochs (pstrain: the job's)")
    parser.add_argument("--batch", type=int, default=32,
                        help="--ddp: batch per process; --single: the batch (the global one)")
    args = parser.parse_args()
    if args.single:
        torch.set_num_threads(len(os.sched_getaffinity(0)))
    net = model()
    train, test = data(1), data(2)
    if args.ddp or args.single:
        rank, world, samples, seconds, mse = train_torch(net, train, test, args.epochs, args.batch,
                                                         1, args.ddp)
    else:
        rank, world, samples, seconds, mse = train_pstrain(net, train, test)
    system = "ddp" if args.ddp else "single" if args.single else "pstrain"
    if rank == 0:
        print(json.dumps({"system": system, "workers": world, "threads": torch.get_num_threads(),
                          "test_mse": round(mse, 5),
                          "samples_per_second": round(samples * world / seconds, 1),
                          "train_seconds": round(seconds, 2)}), flush=True)


if __name__ == "__main__":
    main()
