"""A DLRM-style click model in PyTorch (the built-in click model's layout:
docs/sparse-tables.md) on click logs written by pstrain-clickgen, its
embedding tables on pstrain's servers or, to compare, in every process
under DistributedDataParallel:

  pstrain-clickgen --out /tmp/clicks --train_rows 1000000 --test_rows 100000
  pstrain-run --workers 2 --servers 2 --job examples/torch/dlrm.yaml \\
      -- python3 examples/torch/dlrm.py --data /tmp/clicks
  export OMP_NUM_THREADS=1 MASTER_ADDR=127.0.0.1 MASTER_PORT=29500 WORLD_SIZE=2  # as torchrun
  for r in 0 1; do RANK=$r python3 examples/torch/dlrm.py --data /tmp/clicks --ddp \\
      --batch 512 --seed 1 & done; wait
  python3 examples/torch/dlrm.py --data /tmp/clicks --single --batch 1024 --seed 1

The model: the integer features through a bottom MLP ending in `dim`
(ReLU after every layer), each categorical field through its own table
(sum pooling), the dot products of every pair of (bottom output, fields)
beside the bottom output, a top MLP to one logit, the logistic loss.

With pstrain the tables are the job's (pst.EmbeddingBags: rows by 64-bit
key, no vocabulary, pulled by the forward pass, pushed by backward) and the
servers run Adagrad on rows and dense tensors alike (the job file's). With
--ddp each process holds every table as nn.EmbeddingBag(sparse=True) of
`vocabulary` rows (the data's, from clicks.json) and runs torch's Adagrad
after DDP's all-reduce (gloo): the same model, batches, initial row
distribution and optimizers (--lr, --table-lr, the table's initial
accumulator 0.1 and epsilon 1e-8). With --single one process does what
DDP's do, on the global batch, with as many torch threads as it has CPUs
(what a user of one machine would run instead). All read the same samples
in the same order (pstrain.ClickReader with the job's seed): each process
loads its part of every step's batch before training (not timed). Worker
0 / rank 0 scores the test file. Each process's last line is a JSON object with the
training samples/s (of all processes, from its own time) and its peak RSS,
worker 0's with the test AUC and log loss too.
"""
import argparse
import json
import os
import resource
import time

import numpy as np
import torch
import torch.nn.functional as F

import pstrain


def mlp(widths, relu_last):
    layers = []
    for i in range(len(widths) - 1):
        layers.append(torch.nn.Linear(widths[i], widths[i + 1]))
        if i + 2 < len(widths) or relu_last:
            layers.append(torch.nn.ReLU())
    return torch.nn.Sequential(*layers)


class DLRM(torch.nn.Module):
    """`tables` maps the batch's keys to the pooled fields: a list of
    (keys, offsets), one a field, to a list of [batch, dim]
    (pst.EmbeddingBags or LocalTables), or (pst.EmbeddingBags) keys
    [batch, fields], one a field, to [batch, fields, dim]."""

    def __init__(self, dense, fields, dim, bottom, top, tables):
        super().__init__()
        self.bottom = mlp([dense] + bottom + [dim], relu_last=True)
        self.tables = tables
        n = fields + 1
        i, j = torch.tril_indices(n, n, offset=-1)  # (1,0), (2,0), (2,1), ...
        self.register_buffer("pair_i", i, persistent=False)
        self.register_buffer("pair_j", j, persistent=False)
        self.top = mlp([dim + n * (n - 1) // 2] + top + [1], relu_last=False)

    def forward(self, dense, bags):
        z = self.bottom(dense)
        e = self.tables(bags)
        if isinstance(e, list):
            e = torch.stack(e, dim=1)
        t = torch.cat([z.unsqueeze(1), e], dim=1)  # [batch, fields + 1, dim]
        dots = torch.bmm(t, t.transpose(1, 2))[:, self.pair_i, self.pair_j]
        return self.top(torch.cat([z, dots], dim=1)).squeeze(1)


class LocalTables(torch.nn.Module):
    """Every field's table in this process (DDP's): nn.EmbeddingBag of
    vocabulary + 1 rows (row 0: keys the training data never had)."""

    def __init__(self, fields, rows, dim):
        super().__init__()
        self.bags = torch.nn.ModuleList(
            torch.nn.EmbeddingBag(rows, dim, mode="sum", sparse=True) for _ in range(fields))
        for bag in self.bags:
            torch.nn.init.uniform_(bag.weight, -0.01, 0.01)  # the job's tables' initializer

    def forward(self, bags):
        return [bag(keys, offsets) for bag, (keys, offsets) in zip(self.bags, bags)]


class Vocabulary:
    """DDP's row of each key: 1 + its rank among the training file's
    distinct keys of its field, 0 for a key it never had."""

    def __init__(self, data, layout):
        distinct = [[] for _ in range(layout["fields"])]
        for _, _, starts, keys in read_all(os.path.join(data, "train.txt"), layout):
            for f, (field, _) in enumerate(field_keys(starts, keys, layout["fields"])):
                distinct[f].append(np.unique(field))
        self.keys = [np.unique(np.concatenate(d)) for d in distinct]

    def rows(self, field, keys):
        known = self.keys[field]
        at = np.searchsorted(known, keys)
        found = (at < len(known)) & (known[np.minimum(at, len(known) - 1)] == keys)
        return np.where(found, at + 1, 0).astype(np.int64)


def read_all(path, layout, block=65536):
    """The file's samples in the file's order, a block at a time."""
    reader = pstrain.ClickReader([path], dense=layout["dense"], fields=layout["fields"],
                                 shuffle_window=1)
    start = 0
    while True:
        n = reader.available(start + block) - start
        if n <= 0:
            return
        yield reader.read(start, n)
        start += n


def field_keys(starts, keys, fields):
    """(keys, offsets) of each field's bags, samples in order."""
    sizes = np.diff(starts).reshape(-1, fields)
    field_of_key = np.repeat(np.tile(np.arange(fields), sizes.shape[0]), sizes.reshape(-1))
    out = []
    for f in range(fields):
        offsets = np.concatenate([[0], np.cumsum(sizes[:, f])[:-1]]).astype(np.int64)
        out.append((keys[field_of_key == f], offsets))
    return out


def bags_of(starts, keys, fields, vocabulary):
    """The model's categorical input: [(keys, offsets) a field], DDP's
    rows for its keys with a vocabulary; without (pstrain's keys), where
    every bag holds one key, keys [batch, fields]."""
    if vocabulary is None and np.all(np.diff(starts) == 1):
        return torch.from_numpy(keys.view(np.int64).reshape(-1, fields))
    bags = []
    for f, (k, offsets) in enumerate(field_keys(starts, keys, fields)):
        k = vocabulary.rows(f, k) if vocabulary else k.view(np.int64)
        bags.append((torch.from_numpy(k), torch.from_numpy(offsets)))
    return bags


def load_batches(data, layout, seed, first, count, batch, offset, global_batch, vocabulary):
    """This process's samples of steps [first, first + count) (one epoch),
    as tensors: (labels, dense, bags_of's input)."""
    reader = pstrain.ClickReader([os.path.join(data, "train.txt")], dense=layout["dense"],
                                 fields=layout["fields"], seed=seed)
    batches = []
    for step in range(first, first + count):
        labels, dense, starts, keys = reader.read(step * global_batch + offset, batch)
        batches.append((torch.from_numpy(labels), torch.from_numpy(dense),
                        bags_of(starts, keys, layout["fields"], vocabulary)))
    return batches


def evaluate(model, data, layout, vocabulary):
    """Test AUC and mean log loss over the whole test file."""
    scores, labels = [], []
    with torch.no_grad():
        for y, dense, starts, keys in read_all(os.path.join(data, "test.txt"), layout, 8192):
            bags = bags_of(starts, keys, layout["fields"], vocabulary)
            scores.append(model(torch.from_numpy(dense), bags).numpy())
            labels.append(y)
    s, y = np.concatenate(scores).astype(np.float64), np.concatenate(labels)
    log_loss = float(np.mean(np.logaddexp(0, s) - y * s))
    _, group, counts = np.unique(s, return_inverse=True, return_counts=True)
    ranks = (np.cumsum(counts) - (counts - 1) / 2)[group]  # ties share their mean rank
    positives = y.sum()
    auc = (ranks[y == 1].sum() - positives * (positives + 1) / 2) / (positives * (len(y) - positives))
    return float(auc), log_loss


def train_pstrain(args, layout):
    import pstrain.torch as pst
    torch.manual_seed(args.seed)  # worker 0's initial dense values are the job's
    tables = pst.EmbeddingBags(["c%d" % (f + 1) for f in range(layout["fields"])], mode="sum")
    model = DLRM(layout["dense"], layout["fields"], args.dim, args.bottom, args.top, tables)
    opt = pst.DistributedOptimizer(model)
    client = opt.client
    if client.steps_per_epoch * client.global_batch > layout["train_rows"]:
        raise SystemExit("the job's data.train_samples exceed the %d rows of %s" %
                         (layout["train_rows"], args.data))
    first = client.step
    batches = load_batches(args.data, layout, client.seed, first, client.total_steps - first,
                           client.batch_size, client.batch_offset, client.global_batch, None)
    start = time.monotonic()
    while client.step < client.total_steps:
        y, dense, bags = batches[client.step - first]
        opt.zero_grad()
        loss = F.binary_cross_entropy_with_logits(model(dense, bags), y)
        loss.backward()
        opt.step(loss)
    seconds = time.monotonic() - start
    samples = (client.total_steps - first) * client.batch_size
    auc = log_loss = None
    if client.worker_index == 0:
        auc, log_loss = evaluate(model, args.data, layout, None)
        opt.finish(metrics={"test_auc": auc, "test_log_loss": log_loss})
    else:
        opt.finish()
    return client.worker_index, client.num_workers, samples, seconds, auc, log_loss


def train_torch(args, layout, distributed):
    """The tables in this process: under DDP (one process of WORLD_SIZE,
    gloo) or alone."""
    rank, world = 0, 1
    if distributed:
        import torch.distributed as dist
        dist.init_process_group("gloo")
        rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(args.seed)
    vocabulary = Vocabulary(args.data, layout)
    tables = LocalTables(layout["fields"], layout["vocabulary"] + 1, args.dim)
    model = DLRM(layout["dense"], layout["fields"], args.dim, args.bottom, args.top, tables)
    wrapped = torch.nn.parallel.DistributedDataParallel(model) if distributed else model
    dense_opt = torch.optim.Adagrad([p for n, p in model.named_parameters()
                                     if not n.startswith("tables.")], lr=args.lr, eps=1e-8)
    table_opt = torch.optim.Adagrad(tables.parameters(), lr=args.table_lr, eps=1e-8,
                                    initial_accumulator_value=0.1)
    global_batch = args.batch * world
    steps = min(args.train_samples or layout["train_rows"], layout["train_rows"]) // global_batch
    batches = load_batches(args.data, layout, args.seed, 0, steps, args.batch, rank * args.batch,
                           global_batch, vocabulary)
    if distributed:
        dist.barrier()
    start = time.monotonic()
    for y, dense, bags in batches:
        dense_opt.zero_grad()
        table_opt.zero_grad()
        loss = F.binary_cross_entropy_with_logits(wrapped(dense, bags), y)
        loss.backward()
        dense_opt.step()
        table_opt.step()
    if distributed:
        dist.barrier()
    seconds = time.monotonic() - start
    auc = log_loss = None
    if rank == 0:
        auc, log_loss = evaluate(model, args.data, layout, vocabulary)
    if distributed:
        dist.destroy_process_group()
    return rank, world, steps * args.batch, seconds, auc, log_loss


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data", required=True, help="pstrain-clickgen's --out directory")
    parser.add_argument("--ddp", action="store_true", help="DistributedDataParallel (gloo) instead")
    parser.add_argument("--single", action="store_true",
                        help="one process on every CPU it may use instead (--batch: the global)")
    parser.add_argument("--dim", type=int, default=16, help="the tables' (the job's, with pstrain)")
    parser.add_argument("--bottom", type=int, nargs="*", default=[64], help="hidden widths")
    parser.add_argument("--top", type=int, nargs="*", default=[64], help="hidden widths")
    parser.add_argument("--batch", type=int, default=512,
                        help="--ddp: batch per process; --single: the batch")
    parser.add_argument("--seed", type=int, default=1,
                        help="torch's seed (initial values); --ddp, --single: the job's seed "
                             "(sample order)")
    parser.add_argument("--lr", type=float, default=0.02, help="--ddp, --single: dense Adagrad's")
    parser.add_argument("--table-lr", type=float, default=0.05, help="--ddp, --single: the tables' Adagrad's")
    parser.add_argument("--train-samples", type=int, default=0,
                        help="--ddp, --single: train on the first N (0: the whole file, "
                             "one epoch)")
    args = parser.parse_args()
    if args.single:
        torch.set_num_threads(len(os.sched_getaffinity(0)))
    with open(os.path.join(args.data, "clicks.json")) as f:
        layout = json.load(f)
    if args.ddp or args.single:
        worker, world, samples, seconds, auc, log_loss = train_torch(args, layout, args.ddp)
    else:
        worker, world, samples, seconds, auc, log_loss = train_pstrain(args, layout)
    system = "ddp" if args.ddp else "single" if args.single else "pstrain"
    result = {"system": system, "worker": worker, "workers": world,
              "threads": torch.get_num_threads(),
              "samples_per_second": round(samples * world / seconds, 1),
              "train_seconds": round(seconds, 2),
              "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)}
    if worker == 0:
        result.update(test_auc=round(auc, 6), test_log_loss=round(log_loss, 6),
                      oracle_auc=layout["oracle_auc"])
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
