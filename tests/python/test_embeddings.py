"""Embedding tables from PyTorch (pst.EmbeddingBags, the client library's
row pulls and pushes) against real clusters, and the DLRM example under
pstrain-run and under DDP."""
import json
import os
import subprocess
import sys
import tempfile

import numpy as np
import pytest
import torch

import pstrain
import pstrain.torch as pst
from conftest import BIN_DIR
import embedding_worker as ew

HERE = os.path.dirname(os.path.abspath(__file__))
EXAMPLES = os.path.join(HERE, "..", "..", "examples", "torch")


def run_job(out_dir, *script_args, workers=2, launcher_args=()):
    """The job's result line and each worker's npz."""
    os.makedirs(out_dir, exist_ok=True)
    argv = [os.path.join(BIN_DIR, "pstrain-run"), "--workers", str(workers), "--servers", "2",
            "--run_dir", out_dir + "/run"] + list(launcher_args) + ["--", sys.executable,
            os.path.join(HERE, "embedding_worker.py"), out_dir] + list(script_args)
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    return result, [dict(np.load(os.path.join(out_dir, "worker-%d.npz" % w)))
                    for w in range(workers)]


class LocalRows(torch.nn.Module):
    """The tables in this process, as the servers keep them: zeros until a
    key's first update, SGD on the rows a step touched."""

    def __init__(self, mode, initial=None):
        super().__init__()
        self.mode = mode
        self.rows = [{}, {}]
        self.initial = initial  # the rows of keys 0..KEYS-1 before training; else zeros
        self.looked_up = []

    def row(self, t, k):
        if k in self.rows[t]:
            return self.rows[t][k]
        return self.initial[t][k] if self.initial is not None else torch.zeros(ew.DIM)

    def forward(self, bags):
        if torch.is_tensor(bags):  # one key a sample and table
            return torch.stack(self.forward([(c, None) for c in bags.t()]), dim=1)
        out, self.looked_up = [], []
        for t, (keys, offsets) in enumerate(bags):
            if offsets is None:
                offsets = torch.arange(keys.numel())
            distinct, inverse = torch.unique(keys, return_inverse=True)
            rows = torch.stack([self.row(t, int(k)) for k in distinct]
                               + [torch.zeros(ew.DIM)])[:distinct.numel()].requires_grad_()
            self.looked_up.append((t, distinct, rows))
            out.append(torch.nn.functional.embedding_bag(inverse, rows, offsets, mode=self.mode))
        return out

    def sgd(self):
        for t, distinct, rows in self.looked_up:
            for k, row, grad in zip(distinct.tolist(), rows.detach(), rows.grad):
                self.rows[t][k] = row - ew.LR * grad


def one_process(batches, mode, stacked=False, raw=False):
    """The model trained by one torch process on each step's global batch;
    raw: keys 0..KEYS-1 whose rows start from ew.initial_rows()."""
    x, y, a, b = ew.data()
    tables = LocalRows(mode, ew.initial_rows() if raw else None)
    net = ew.Net(tables)
    opt = torch.optim.SGD(net.parameters(), lr=ew.LR)
    for idx in batches:
        opt.zero_grad()
        torch.nn.functional.binary_cross_entropy_with_logits(
            net(x[idx], ew.bags_of(a, b, idx, stacked, raw)), y[idx]).backward()
        opt.step()
        tables.sgd()
    out = {name: p.detach().numpy() for name, p in net.named_parameters()}
    for t, name in enumerate(("rows_a", "rows_b")):
        out[name] = np.stack([tables.row(t, k if raw else int(ew.key(k))).detach().numpy()
                              for k in range(ew.KEYS)])
    return out


MODEL = ("dense.weight", "dense.bias", "weights", "rows_a", "rows_b")


def within_the_sync_bounds(actual, expected):
    for name in MODEL:
        d = actual[name].astype(np.float64) - expected[name]
        assert np.linalg.norm(d) <= 1e-5 * np.linalg.norm(expected[name]), name
        assert np.abs(d).max() <= 1e-4, name


@pytest.mark.parametrize("mode", ["sum", "mean", "stacked", "separate"])
def test_sync_two_workers_with_tables_equal_one_process_with_the_global_batch(mode):
    # stacked: keys [batch, tables] (one sort for all tables, one rows
    # tensor); separate: pst.Embedding and pst.EmbeddingBag (mean), a module
    # a table.
    args = {"stacked": ["--stacked"], "separate": ["--separate", "--mode", "mean"]}.get(
        mode, ["--mode", mode])
    with tempfile.TemporaryDirectory() as out:
        result, workers = run_job(out, *args)
        assert result["steps"] == 24
        batches = [np.concatenate([w["indices"][i] for w in workers]) for i in range(24)]
        reference = one_process(batches, {"stacked": "sum", "separate": "mean"}.get(mode, mode),
                                stacked=mode == "stacked")
        assert np.abs(reference["rows_b"]).max() > 0.001  # the rows were trained
        within_the_sync_bounds(workers[0], reference)
        for name in MODEL:
            assert np.array_equal(workers[0][name], workers[1][name]), name


@pytest.mark.parametrize("mode", ["sum", "mean"])
def test_torchs_sparse_embeddings_train_as_tables_bitwise_as_pst_modules(mode):
    # nn.EmbeddingBag(sparse=True) given to DistributedOptimizer: a table of
    # each module's name, its weight the initial rows; the same model with
    # pst.EmbeddingBag and those rows gives the same bits, one torch
    # process on the global batch the same within the sync bounds, and the
    # export puts the rows back into plain nn.EmbeddingBags.
    with tempfile.TemporaryDirectory() as out:
        export = out + "/export"
        _, ours = run_job(out + "/torch", "--torch-sparse", "--mode", mode,
                          launcher_args=["--export", export])
        _, written = run_job(out + "/pst", "--pst-initial", "--mode", mode)
        for name in MODEL:
            assert np.array_equal(ours[0][name], written[0][name]), name
            assert np.array_equal(ours[0][name], ours[1][name]), name
        batches = [np.concatenate([w["indices"][i] for w in ours]) for i in range(24)]
        reference = one_process(batches, mode, raw=True)
        assert not np.array_equal(reference["rows_b"], ew.initial_rows()[1].numpy())
        within_the_sync_bounds(ours[0], reference)
        fresh = ew.Net(ew.TorchSparse(mode))
        assert pst.load(export, fresh) is fresh
        assert np.array_equal(fresh.tables.a.weight.detach().numpy(), ours[0]["rows_a"])
        assert np.array_equal(fresh.tables.b.weight.detach().numpy(), ours[0]["rows_b"])
        assert np.array_equal(fresh.dense.weight.detach().numpy(), ours[0]["dense.weight"])


@pytest.mark.parametrize("module, says", [
    (torch.nn.EmbeddingBag(10, 4, max_norm=1.0, sparse=True), "max_norm"),
    (torch.nn.EmbeddingBag(10, 4, mode="max", sparse=True), 'mode "max"'),
    (torch.nn.Embedding(10, 4, padding_idx=0, sparse=True), "padding_idx"),
    (torch.nn.Embedding(10, 4, scale_grad_by_freq=True, sparse=True), "scale_grad_by_freq"),
])
def test_a_sparse_module_the_servers_cannot_train_is_refused_naming_it(module, says):
    net = torch.nn.Sequential(torch.nn.Linear(2, 2))
    net.add_module("emb", module)
    with pytest.raises(pstrain.SetupError) as e:
        pst.DistributedOptimizer(net, job_yaml="optimizer: {type: sgd, learning_rate: 0.1}\n",
                                 coordinator="127.0.0.1:1")  # refused before any call
    assert str(e.value).startswith("pstrain: emb (nn.%s, sparse=True)" % type(module).__name__)
    assert says in str(e.value) and "sparse=False" in str(e.value), str(e.value)


def test_a_killed_worker_with_tables_is_restarted_and_changes_nothing():
    with tempfile.TemporaryDirectory() as out:
        _, clean = run_job(out + "/clean")
        result, killed = run_job(out + "/killed", "--die-at", "13")
        assert os.path.exists(out + "/killed/died")
        assert result["recoveries"] >= 1
        for name in MODEL:
            assert np.array_equal(killed[0][name], clean[0][name]), name


def test_row_pulls_and_pushes_refuse_bad_calls(cluster):
    job = ("name: bad-rows\noptimizer: {type: sgd, learning_rate: 0.1}\nbatch_size: 4\nsteps: 2\n"
           "num_workers: 1\nnum_servers: 2\n"
           "tables: [{name: t, dim: 2, optimizer: {type: sgd, learning_rate: 0.1}}]\n")
    client = pstrain.init([("w", [3])], job_yaml=job, coordinator=cluster.coordinator)
    assert client.tables == [("t", 2)]
    w = torch.zeros(3)
    client.bind_address(0, w.data_ptr(), 3)
    client.start()
    keys = torch.tensor([5, 5], dtype=torch.int64)
    rows = torch.zeros(2, 2)
    with pytest.raises(pstrain.Error) as e:
        client.pull_rows([(0, keys.data_ptr(), 2, rows.data_ptr())])
    assert e.value.code == "INVALID_ARGUMENT" and "twice" in e.value.message
    with pytest.raises(pstrain.Error) as e:
        client.pull_rows([(1, keys.data_ptr(), 1, rows.data_ptr())])
    assert e.value.code == "INVALID_ARGUMENT" and "table 1" in e.value.message
    with pytest.raises(pstrain.Error) as e:
        client.table_index("u")
    assert e.value.code == "NOT_FOUND"
    one = torch.tensor([7], dtype=torch.int64)
    counts = torch.ones(1, dtype=torch.int32)
    grads = torch.ones(1, 2)
    client.pull_rows([(0, one.data_ptr(), 1, rows.data_ptr())])
    client.push_rows_address(0, one.data_ptr(), counts.data_ptr(), grads.data_ptr(), 1)
    with pytest.raises(pstrain.Error) as e:
        client.push_rows_address(0, one.data_ptr(), counts.data_ptr(), grads.data_ptr(), 1)
    assert e.value.code == "INVALID_ARGUMENT" and "already pushed" in e.value.message
    assert client.end_step(0.5, 4) == 1
    # The row was admitted and moved by SGD: 0.01 (the default initializer's
    # scale) at most from 0 at first, minus 0.1 * 1 now.
    client.pull_rows([(0, one.data_ptr(), 1, rows.data_ptr())])
    assert (rows[0] < -0.08).all() and (rows[0] > -0.12).all(), rows
    client.end_step(0.5, 4)
    client.finish()


def test_a_model_reading_a_table_the_job_lacks_is_refused(cluster):
    job = ("name: no-table\noptimizer: {type: sgd, learning_rate: 0.1}\nbatch_size: 4\n"
           "steps: 1\nnum_workers: 1\nnum_servers: 2\ntables: [{name: t, dim: 2}]\n")
    net = ew.Net(pst.EmbeddingBags(["t", "u"]))
    with pytest.raises(ValueError, match="no table u"):
        pst.DistributedOptimizer(net, job_yaml=job, coordinator=cluster.coordinator)


def test_the_dlrm_example_trains_under_pstrain_run_and_under_ddp():
    with tempfile.TemporaryDirectory() as out:
        data = os.path.join(out, "clicks")
        subprocess.run([os.path.join(BIN_DIR, "pstrain-clickgen"), "--out", data,
                        "--train_rows", "81920", "--test_rows", "4000", "--vocabulary", "200",
                        "--fields", "6", "--dense", "4"],
                       check=True, capture_output=True, timeout=120)
        with open(os.path.join(data, "clicks.json")) as f:
            oracle = json.load(f)
        with open(os.path.join(EXAMPLES, "dlrm.yaml")) as f:
            job = f.read().replace("train_samples: 1000000", "train_samples: 81920")
        job = job[:job.index("tables:")] + "tables:\n" + "".join(
            "  - {name: c%d, dim: 16, optimizer: {type: adagrad, learning_rate: 0.05}}\n" % f
            for f in range(1, 7))
        with open(os.path.join(out, "job.yaml"), "w") as f:
            f.write(job)
        script = [sys.executable, os.path.join(EXAMPLES, "dlrm.py"), "--data", data]
        export = os.path.join(out, "export")
        done = subprocess.run([os.path.join(BIN_DIR, "pstrain-run"), "--workers", "2",
                               "--servers", "2", "--job", os.path.join(out, "job.yaml"),
                               "--run_dir", os.path.join(out, "run"), "--export", export,
                               "--"] + script,
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stdout + done.stderr
        with open(os.path.join(out, "run", "worker-0.log")) as f:
            ours = json.loads([line for line in f if line.startswith("{")][-1])
        # The export, its tables included, evaluates offline to the job's AUC.
        sys.path.insert(0, EXAMPLES)
        try:
            import dlrm
        finally:
            sys.path.remove(EXAMPLES)
        layout = dict(oracle)
        offline = dlrm.DLRM(layout["dense"], layout["fields"], 16, [64], [64],
                            pst.EmbeddingBags(["c%d" % f for f in range(1, 7)], mode="sum"))
        assert pst.load(export, offline) is offline
        auc, _ = dlrm.evaluate(offline, data, layout, None)
        assert abs(auc - ours["test_auc"]) <= 1e-6, (auc, ours["test_auc"])
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
                   WORLD_SIZE="2")
        ddp = [subprocess.Popen(script + ["--ddp", "--batch", "512", "--seed", "1"],
                                env=dict(env, RANK=str(r)), stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True) for r in (0, 1)]
        outputs = [p.communicate(timeout=300)[0] for p in ddp]
        assert all(p.returncode == 0 for p in ddp), outputs
        theirs = json.loads(outputs[0].strip().splitlines()[-1])
        for result in (ours, theirs):
            # The tables matter: well above what the integer features allow.
            assert result["test_auc"] > oracle["dense_only_oracle_auc"] + 0.03, \
                (ours["test_auc"], theirs["test_auc"], oracle)
            assert result["test_auc"] < oracle["oracle_auc"], result
        assert abs(ours["test_auc"] - theirs["test_auc"]) < 0.02, (ours, theirs)


def free_port():
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
