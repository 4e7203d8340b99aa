"""One worker of the embedding tests' jobs (started by pstrain-run): a
linear click model whose two categorical fields are read from the job's
tables through pst.EmbeddingBags (field "a": one key a sample, field "b":
bags of 0-3 keys with offsets). Writes OUT_DIR/worker-W.npz: the final
dense parameters, every key's final row of each table (pulled after the
last step), and each step's sample indices.

  embedding_worker.py OUT_DIR [--mode sum|mean] [--die-at STEP] [--steps N] [--stacked]
                      [--separate] [--torch-sparse | --pst-initial]

--torch-sparse: the fields through torch's own nn.EmbeddingBag(KEYS, DIM,
sparse=True), keys their row indices, which pstrain trains as tables
"tables.a" and "tables.b" of the modules' initial rows; --pst-initial: the
same model written with pst.EmbeddingBag and those initial rows.
"""
import argparse
import os
import signal

import numpy as np
import torch

import pstrain.torch as pst

SAMPLES, DENSE, KEYS, DIM = 512, 6, 50, 4
LR = 0.1  # SGD's, on the dense tensors and the rows


def job_yaml(steps, declared=True):
    """declared: the tables in the job file (else the model brings them,
    with its optimizer's twin: SGD at LR)."""
    table = "{name: %%s, dim: %d, initializer: {type: zeros}, optimizer: {type: sgd, " \
        "learning_rate: %g}}" % (DIM, LR)
    tables = "tables: [%s, %s]\n" % (table % "a", table % "b") if declared else ""
    return ("name: pytest-tables\noptimizer: {type: sgd, learning_rate: %g}\nbatch_size: 16\n"
            "steps: %d\nseed: 3\nmode: sync\n%s"
            "checkpoint: {dir: %s/checkpoints, every_steps: 5}\n" %
            (LR, steps, tables, os.environ["PSTRAIN_RUN_DIR"]))


def data():
    """Dense features, labels, field a's key of each sample, and field b's
    bags (keys, offsets) of each sample; keys are spread over 64 bits."""
    rng = np.random.RandomState(3)
    x = rng.randn(SAMPLES, DENSE).astype(np.float32)
    a = rng.zipf(1.3, SAMPLES) % KEYS
    sizes = rng.randint(0, 4, SAMPLES)
    b = [rng.randint(0, KEYS, n) for n in sizes]
    y = ((x[:, 0] + (a % 3 == 0) + np.array([len(k) for k in b]) * 0.3) > 1).astype(np.float32)
    return torch.from_numpy(x), torch.from_numpy(y), a, b


def key(k):
    """Key k of the tests as a 64-bit id (int64 bits), far from 0..KEYS."""
    return np.int64((int(k) * 0x9E3779B97F4A7C15 + 12345) % (1 << 64) - (1 << 63))


def bags_of(a, b, indices, stacked=False, raw=False):
    """The two fields' (keys, offsets) for the samples `indices`; stacked:
    keys [batch, 2] of field a and a field of one key a sample; raw: keys
    0..KEYS-1 (row indices) instead of 64-bit ids."""
    key = (lambda k: int(k)) if raw else globals()["key"]
    keys_a = torch.tensor([key(a[i]) for i in indices], dtype=torch.int64)
    if stacked:
        keys_c = torch.tensor([key((a[i] * 7 + 3) % KEYS) for i in indices], dtype=torch.int64)
        return torch.stack([keys_a, keys_c], dim=1)
    keys_b = [key(k) for i in indices for k in b[i]]
    offsets_b = np.concatenate([[0], np.cumsum([len(b[i]) for i in indices])[:-1]])
    return [(keys_a, None),
            (torch.tensor(keys_b, dtype=torch.int64), torch.tensor(offsets_b, dtype=torch.int64))]


class Separate(torch.nn.Module):
    """The two tables as a module each: pst.Embedding for field a (one key
    a sample), pst.EmbeddingBag for field b."""

    def __init__(self, mode):
        super().__init__()
        self.a = pst.Embedding("a")
        self.b = pst.EmbeddingBag("b", mode=mode)

    def forward(self, bags):
        (keys_a, _), (keys_b, offsets_b) = bags
        return [self.a(keys_a), self.b(keys_b, offsets_b)]


def initial_rows():
    """The rows torch initialises an nn.EmbeddingBag(KEYS, DIM) of each
    field with (seeded): the initial rows of --torch-sparse and
    --pst-initial."""
    torch.manual_seed(11)
    return [torch.nn.EmbeddingBag(KEYS, DIM).weight.detach().clone() for _ in range(2)]


class TorchSparse(torch.nn.Module):
    """The fields through torch's nn.EmbeddingBag(sparse=True) (--torch-sparse),
    or the same written with pst.EmbeddingBag and the same initial rows."""

    def __init__(self, mode, pst_modules=False):
        super().__init__()
        rows_a, rows_b = initial_rows()
        if pst_modules:
            self.a = pst.EmbeddingBag("tables.a", mode=mode, initial=rows_a)
            self.b = pst.EmbeddingBag("tables.b", mode=mode, initial=rows_b)
        else:
            self.a = torch.nn.EmbeddingBag(KEYS, DIM, mode=mode, sparse=True, _weight=rows_a)
            self.b = torch.nn.EmbeddingBag(KEYS, DIM, mode=mode, sparse=True, _weight=rows_b)

    def forward(self, bags):
        (keys_a, _), (keys_b, offsets_b) = bags
        return [self.a(keys_a.unsqueeze(1)), self.b(keys_b, offsets_b)]


class Net(torch.nn.Module):
    def __init__(self, tables):
        super().__init__()
        torch.manual_seed(5)
        self.dense = torch.nn.Linear(DENSE, 1)
        self.weights = torch.nn.Parameter(torch.randn(2, DIM))
        self.tables = tables

    def forward(self, x, bags):
        e = self.tables(bags)
        if isinstance(e, list):
            e = torch.stack(e, dim=1)  # [batch, 2, DIM]
        return self.dense(x).squeeze(1) + (e * self.weights).sum(dim=(1, 2))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("out_dir")
    parser.add_argument("--mode", default="sum")
    parser.add_argument("--die-at", type=int, default=-1)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--stacked", action="store_true", help="keys [batch, 2] (bags_of)")
    parser.add_argument("--separate", action="store_true",
                        help="pst.Embedding and pst.EmbeddingBag modules")
    parser.add_argument("--torch-sparse", action="store_true")
    parser.add_argument("--pst-initial", action="store_true")
    args = parser.parse_args()
    x, y, a, b = data()
    raw = args.torch_sparse or args.pst_initial  # keys: row indices
    if raw:
        tables = TorchSparse(args.mode, pst_modules=args.pst_initial)
    elif args.separate:
        tables = Separate(args.mode)
    else:
        tables = pst.EmbeddingBags(["a", "b"], mode=args.mode)
    net = Net(tables)
    opt = pst.DistributedOptimizer(net, job_yaml=job_yaml(args.steps, declared=not raw))
    client = opt.client
    steps, indices = [], []
    for idx in pst.ShardSampler(client, SAMPLES):
        if client.step == args.die_at and client.worker_index == 1 and \
                not os.path.exists(os.path.join(args.out_dir, "died")):
            open(os.path.join(args.out_dir, "died"), "w").close()
            os.kill(os.getpid(), signal.SIGKILL)
        opt.zero_grad()
        loss = torch.nn.functional.binary_cross_entropy_with_logits(
            net(x[idx], bags_of(a, b, idx, args.stacked, raw)), y[idx])
        loss.backward()
        steps.append(client.step)
        indices.append(np.asarray(idx))
        opt.step(loss)
    with torch.no_grad():  # every key's row: a bag of its own, summed
        every = torch.tensor([int(k) if raw else key(k) for k in range(KEYS)], dtype=torch.int64)
        if raw:
            rows_a, rows_b = net.tables.a(every.unsqueeze(1)), net.tables.b(every.unsqueeze(1))
        else:
            rows_a, rows_b = net.tables([(every, None), (every, None)])
    # The rows are the tables' (torch's modules keep their initial weight).
    saved = {name: p.detach().numpy() for name, p in net.named_parameters()
             if not name.startswith("tables.")}
    saved.update(rows_a=rows_a.numpy(), rows_b=rows_b.numpy(), steps=np.array(steps),
                 indices=np.array(indices))
    np.savez(os.path.join(args.out_dir, "worker-%d.npz" % client.worker_index), **saved)
    opt.finish()


if __name__ == "__main__":
    main()
