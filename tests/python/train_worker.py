"""One worker of the tests' jobs (started by pstrain-run): a small MLP on
synthetic data through pstrain.torch. Writes what it trained to OUT_DIR:
worker-W.npz (worker-W-L.npz for each of a node's processes) with the
final parameters and buffers (the state dict) and each step's sample
indices.

  train_worker.py OUT_DIR [--steps N] [--optimizer sgd|adam] [--mode sync|async|ssp]
                  [--drop-worker 1] [--die-at STEP] [--die-rank R] [--overlap-values]
                  [--accumulate K] [--batch B]
                  [--model mlp|frozen|bn] [--seed-rng] [--weight-decay D]
                  [--loader-workers N] [--fp16] [--autocast-bf16]
                  [--inf-at STEP]
"""
import argparse
import os
import signal

import numpy as np
import torch

import pstrain.torch as pst

SAMPLES, INPUTS, HIDDEN, CLASSES = 512, 20, 16, 4
# What pstrain-run tells each process about its place (saved as `launch`).
LAUNCH_ENV = ("PSTRAIN_NODE_RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "RANK", "WORLD_SIZE")


def data():
    rng = np.random.RandomState(0)
    x = rng.randn(SAMPLES, INPUTS).astype(np.float32)
    y = (x[:, :CLASSES].argmax(axis=1) + (x[:, 4] > 1)).astype(np.int64) % CLASSES
    return torch.from_numpy(x), torch.from_numpy(y)


def model(kind="mlp"):
    """mlp: Linear, ReLU, Linear; frozen: the same, its first Linear not
    trained; bn: with BatchNorm (whose running statistics are buffers) and
    dropout (which draws from torch's RNG)."""
    torch.manual_seed(7)
    if kind == "frozen":  # the first layer not trained
        net = torch.nn.Sequential(torch.nn.Linear(INPUTS, HIDDEN), torch.nn.ReLU(),
                                  torch.nn.Linear(HIDDEN, CLASSES))
        net[0].requires_grad_(False)
        return net
    if kind == "bn":
        return torch.nn.Sequential(torch.nn.Linear(INPUTS, HIDDEN), torch.nn.BatchNorm1d(HIDDEN),
                                   torch.nn.ReLU(), torch.nn.Dropout(0.2),
                                   torch.nn.Linear(HIDDEN, CLASSES))
    return torch.nn.Sequential(torch.nn.Linear(INPUTS, HIDDEN), torch.nn.ReLU(),
                               torch.nn.Linear(HIDDEN, CLASSES))


def accuracy(net, x, y):
    """In eval mode: BatchNorm's running statistics, no dropout."""
    training = net.training
    net.eval()
    with torch.no_grad():
        correct = float((net(x).argmax(dim=1) == y).float().mean())
    net.train(training)
    return correct


def job_yaml(args):
    optimizer = ("{type: sgd, learning_rate: 0.05, weight_decay: %g}" if args.optimizer == "sgd"
                 else "{type: adam, learning_rate: 0.001, weight_decay: %g}") % args.weight_decay
    text = ("name: pytest\noptimizer: %s\nbatch_size: %d\naccumulate_steps: %d\nsteps: %d\n"
            "seed: 3\nmode: %s\n" % (optimizer, args.batch // args.accumulate, args.accumulate,
                                       args.steps, args.mode))
    if args.fp16:
        text += "precision: fp16\nloss_scale: {initial: 1024, growth_steps: 1000}\n"
    if args.mode == "ssp":
        text += "staleness: 1\n"
    return text + "checkpoint: {dir: %s/checkpoints, every_steps: 10}\n" % os.environ["PSTRAIN_RUN_DIR"]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("out_dir")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--optimizer", default="sgd")
    parser.add_argument("--mode", default="sync")
    parser.add_argument("--drop-worker", type=int, default=-1)
    parser.add_argument("--die-at", type=int, default=-1)
    parser.add_argument("--die-rank", default="1")  # the RANK of the process that dies
    parser.add_argument("--overlap-values", action="store_true")
    parser.add_argument("--accumulate", type=int, default=1)
    parser.add_argument("--batch", type=int, default=32)  # a worker's (node's) samples per step
    parser.add_argument("--model", default="mlp")
    parser.add_argument("--seed-rng", action="store_true")
    parser.add_argument("--loader-workers", type=int, default=0)
    parser.add_argument("--fp16", action="store_true")
    parser.add_argument("--autocast-bf16", action="store_true")  # the forward pass in bf16
    parser.add_argument("--weight-decay", type=float, default=0.0)
    parser.add_argument("--inf-at", type=int, default=-1)
    args = parser.parse_args()
    x, y = data()
    net = model(args.model)
    opt = pst.DistributedOptimizer(net, job_yaml=job_yaml(args), overlap_values=args.overlap_values,
                                   seed_rng=args.seed_rng)
    me = opt.client.worker_index
    rank = os.environ.get("RANK")
    marker = os.path.join(args.out_dir, "died-%s" % rank)
    indices, losses, scales, snapshots = {}, {}, {}, {}
    if args.loader_workers > 0:  # DataLoader worker processes that prefetch
        dataset = torch.utils.data.TensorDataset(torch.arange(SAMPLES), x, y)
        loader = pst.ShardedLoader(dataset, opt.client, num_workers=args.loader_workers)
        batches = ((i.tolist(), xb, yb) for i, xb, yb in loader)  # the indices it read
    else:
        batches = ((idx, x[idx], y[idx]) for idx in pst.ShardSampler(opt.client, SAMPLES))
    for idx, xb, yb in batches:
        step = opt.client.step
        if step == args.die_at and rank == args.die_rank and not os.path.exists(marker):
            open(marker, "w").close()
            os.kill(os.getpid(), signal.SIGKILL)  # as a crash would
        indices[step] = idx
        opt.zero_grad()
        k = opt.client.accumulate_steps
        for micro in range(k):  # each micro-batch's backward adds to the gradients
            lo, hi = micro * len(idx) // k, (micro + 1) * len(idx) // k
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.autocast_bf16):
                loss = torch.nn.functional.cross_entropy(net(xb[lo:hi]), yb[lo:hi])
            factor = 0.0 if me == args.drop_worker else opt.loss_scale
            if step == args.inf_at and me == 1:
                factor = float("inf")  # an overflow, as fp16 compute would give
            (loss * factor).backward()
        losses[step] = float(loss)
        scales[step] = opt.loss_scale
        opt.step(loss, len(idx), metrics={"batch_accuracy": accuracy(net, xb, yb)})
        if args.fp16:  # the values after each step
            snapshots[step] = torch.cat([p.detach().reshape(-1) for p in net.parameters()]).numpy()
    opt.finish(metrics={"train_accuracy": accuracy(net, x, y)})
    steps = sorted(indices)
    name = "worker-%d" % me
    if os.environ.get("LOCAL_WORLD_SIZE", "1") != "1":
        name += "-" + os.environ["LOCAL_RANK"]
    np.savez(os.path.join(args.out_dir, name + ".npz"),
             steps=np.array(steps), indices=np.array([indices[s] for s in steps]),
             losses=np.array([losses[s] for s in steps]),
             scales=np.array([scales[s] for s in steps]),
             launch=np.array([os.environ.get(name, "") for name in LAUNCH_ENV]),
             snapshots=np.array([snapshots[s] for s in sorted(snapshots)]),
             **{name: t.detach().numpy() for name, t in net.state_dict().items()})


if __name__ == "__main__":
    main()
