"""The Python package against real clusters: pstrain.torch scripts run by
pstrain-run, and the client library called directly."""
import json
import os
import re
import subprocess
import tempfile

import numpy as np
import pytest
import torch

import pstrain
import pstrain.torch as pst
from conftest import BIN_DIR, processes_of_run, pstrain_run
import train_worker


def run_job(out_dir, *script_args, workers=2, per_node=1, launcher_args=()):
    """The job's result line and what each process trained, by RANK."""
    os.makedirs(out_dir, exist_ok=True)
    done = pstrain_run(["--workers", str(workers), "--servers", "2", "--run_dir", out_dir + "/run",
                        "--nproc_per_node", str(per_node)] + list(launcher_args),
                       [out_dir] + list(script_args))
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    names = ["worker-%d" % w for w in range(workers)] if per_node == 1 else \
        ["worker-%d-%d" % (w, j) for w in range(workers) for j in range(per_node)]
    return result, [dict(np.load(os.path.join(out_dir, name + ".npz"))) for name in names]


def one_process(indices_by_step, optimizer):
    """The same model trained by one torch process on each step's global
    batch (the workers' batches in worker order)."""
    x, y = train_worker.data()
    net = train_worker.model()
    opt = (torch.optim.SGD(net.parameters(), lr=0.05) if optimizer == "sgd"
           else torch.optim.Adam(net.parameters(), lr=0.001, eps=1e-8))
    for idx in indices_by_step:
        opt.zero_grad()
        torch.nn.functional.cross_entropy(net(x[idx]), y[idx]).backward()
        opt.step()
    return {name: p.detach().numpy() for name, p in net.named_parameters()}


def differences(actual, expected):
    """Per tensor: relative L2 distance and largest absolute difference."""
    out = {}
    for name, e in expected.items():
        d = actual[name].astype(np.float64) - e
        out[name] = (np.linalg.norm(d) / max(np.linalg.norm(e), 1e-30), np.abs(d).max())
    return out


def global_batches(workers):
    return [np.concatenate([w["indices"][i] for w in workers]) for i in range(len(workers[0]["steps"]))]


# The C++ sync-equivalence bounds: relative L2 per tensor, largest difference.
BOUNDS = {"sgd": (1e-5, 1e-4), "adam": (1e-5, 5e-4)}


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_sync_two_workers_equal_one_process_with_the_global_batch(optimizer):
    with tempfile.TemporaryDirectory() as out:
        model_file = os.path.join(out, "model.pstm")
        result, workers = run_job(out, "--optimizer", optimizer,
                                  launcher_args=["--export", model_file])
        assert result["steps"] == 50
        for w in workers:
            assert len(w["indices"][0]) == 32
        reference = one_process(global_batches(workers), optimizer)
        for name, (relative, largest) in differences(workers[0], reference).items():
            assert relative <= BOUNDS[optimizer][0], (name, relative)
            assert largest <= BOUNDS[optimizer][1], (name, largest)
        # Both workers end with the same model, bitwise, and --export kept it.
        for name in reference:
            assert np.array_equal(workers[0][name], workers[1][name])
        exported = pst.load(model_file)
        assert list(exported) == list(reference)
        for name in reference:
            assert np.array_equal(exported[name].numpy(), workers[0][name]), name


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_accumulated_micro_batches_equal_one_process_with_the_global_batch(optimizer):
    # 2 workers x 2 micro-batches of 16: one step of the global batch of 64.
    with tempfile.TemporaryDirectory() as out:
        _, workers = run_job(out, "--optimizer", optimizer, "--accumulate", "2")
        reference = one_process(global_batches(workers), optimizer)
        for name, (relative, largest) in differences(workers[0], reference).items():
            assert relative <= BOUNDS[optimizer][0], (name, relative)
            assert largest <= BOUNDS[optimizer][1], (name, largest)


def model_of(worker):
    return {name: v for name, v in worker.items()
            if name not in ("steps", "indices", "losses", "scales", "snapshots", "launch")}


def assert_same_model(actual, expected):
    """Bitwise the same parameters and buffers (npz of train_worker.py)."""
    for name, values in model_of(expected).items():
        assert np.array_equal(actual[name], values), name


@pytest.fixture(scope="module")
def plain_job(tmp_path_factory):
    """The workers of the default job (SGD, sync, 50 steps): the reference
    of the tests that change one thing about it."""
    return run_job(str(tmp_path_factory.mktemp("plain")))[1]


def test_values_awaited_by_the_forward_pass_change_nothing():
    with tempfile.TemporaryDirectory() as out:
        _, waited = run_job(out + "/waited", "--optimizer", "adam")
        _, overlapped = run_job(out + "/overlapped", "--optimizer", "adam", "--overlap-values")
        assert_same_model(overlapped[0], waited[0])
        assert_same_model(overlapped[1], waited[0])


def test_leaving_out_a_worker_breaks_the_bound():
    with tempfile.TemporaryDirectory() as out:
        _, workers = run_job(out, "--drop-worker", "1")
        reference = one_process(global_batches(workers), "sgd")
        assert any(r > BOUNDS["sgd"][0] or m > BOUNDS["sgd"][1]
                   for r, m in differences(workers[0], reference).values())


@pytest.mark.parametrize("mode", ["async", "ssp"])
def test_async_and_ssp_train(mode):
    with tempfile.TemporaryDirectory() as out:
        result, workers = run_job(out, "--mode", mode, "--steps", "200")
        assert result["mode"] == mode
        for w in workers:
            assert w["losses"][-20:].mean() < 0.8 * w["losses"][:20].mean()


@pytest.mark.parametrize("overlap", [False, True])
def test_a_killed_worker_is_restarted_and_changes_nothing(overlap, plain_job):
    # With overlap, the survivor learns of the recovery while the values of
    # its last step arrive, and discards the step it was computing.
    extra = ["--overlap-values"] if overlap else []
    with tempfile.TemporaryDirectory() as out:
        result, killed = run_job(out, "--die-at", "25", *extra)
        assert os.path.exists(out + "/died-1")
        assert result["recoveries"] >= 1
        assert_same_model(killed[0], plain_job[0])


@pytest.mark.parametrize("overlap", [False, True])
def test_buffers_are_kept_in_step_recovered_and_exported(overlap):
    # BatchNorm's running statistics (and num_batches_tracked, int64) are
    # buffers: both workers end with worker 0's, bitwise; a worker killed
    # and restarted (dropout seeded by step) changes nothing; the exported
    # model loads into a fresh one that evaluates as the workers' does.
    extra = ["--model", "bn", "--seed-rng"] + (["--overlap-values"] if overlap else [])
    with tempfile.TemporaryDirectory() as out:
        model_file = os.path.join(out, "model.pstm")
        result, clean = run_job(out + "/clean", *extra, launcher_args=["--export", model_file])
        assert clean[0]["1.num_batches_tracked"] == 50
        assert_same_model(clean[1], clean[0])
        result_killed, killed = run_job(out + "/killed", "--die-at", "25", *extra)
        assert result_killed["recoveries"] >= 1
        assert_same_model(killed[0], clean[0])
        assert_same_model(killed[1], clean[0])
        fresh = train_worker.model("bn")
        fresh.load_state_dict(pst.load(model_file))
        for name, values in fresh.state_dict().items():
            assert values.dtype == (torch.int64 if "num_batches" in name else torch.float32)
            assert np.array_equal(values.numpy(), clean[0][name]), name
        x, y = train_worker.data()
        assert abs(train_worker.accuracy(fresh, x, y) - result["metrics"]["train_accuracy"]) < 1e-6


def test_a_frozen_layer_is_not_trained_even_with_weight_decay():
    with tempfile.TemporaryDirectory() as out:
        _, workers = run_job(out, "--model", "frozen", "--weight-decay", "0.1")
        initial = {name: t.detach().numpy()
                   for name, t in train_worker.model("frozen").state_dict().items()}
        for w in workers:
            assert np.array_equal(w["0.weight"], initial["0.weight"])
            assert np.array_equal(w["0.bias"], initial["0.bias"])
            assert not np.array_equal(w["2.weight"], initial["2.weight"])
        assert np.array_equal(workers[0]["2.weight"], workers[1]["2.weight"])


def test_dataloader_workers_give_the_bits_of_no_workers_with_and_without_a_kill(plain_job):
    # Two DataLoader processes prefetching ahead: the batches are the
    # sampler's; after a recovery those prefetched for the redone steps are
    # dropped, none is trained twice.
    with tempfile.TemporaryDirectory() as out:
        _, loader = run_job(out + "/loader", "--loader-workers", "2")
        result, killed = run_job(out + "/loader_killed", "--loader-workers", "2", "--die-at", "25")
        assert result["recoveries"] >= 1
        assert_same_model(loader[0], plain_job[0])
        assert_same_model(killed[0], plain_job[0])
        assert np.array_equal(loader[0]["indices"], plain_job[0]["indices"])
        assert np.array_equal(killed[0]["indices"], plain_job[0]["indices"])
        # The killed script's loader processes and forkserver ended with it.
        assert processes_of_run(out + "/loader_killed/run") == []


def test_two_nodes_of_two_processes_equal_four_workers_and_a_killed_process_changes_nothing():
    # pstrain-run --nproc_per_node 2: each node's two processes sum their
    # gradients (gloo) and its LOCAL_RANK 0 pushes the sum: a job of 2
    # workers of batch 32, each process training the samples one of 4
    # workers of batch 16 trains.
    with tempfile.TemporaryDirectory() as out:
        _, four = run_job(out + "/four", "--batch", "16", workers=4)
        result, nodes = run_job(out + "/nodes", per_node=2)
        assert result["workers"] == 2
        for rank, (process, worker) in enumerate(zip(nodes, four)):
            assert list(process["launch"]) == [str(rank // 2), str(rank % 2), "2", str(rank), "4"]
            assert np.array_equal(process["indices"], worker["indices"])
            assert_same_model(process, nodes[0])
        for name, (relative, largest) in differences(nodes[0], model_of(four[0])).items():
            assert relative <= BOUNDS["sgd"][0], (name, relative)
            assert largest <= BOUNDS["sgd"][1], (name, largest)
        # A node's second process killed, then its first (the job's worker):
        # the node's processes start again and the job recovers, bitwise.
        for rank in ("3", "2"):
            result, killed = run_job(out + "/killed" + rank, "--die-at", "25", "--die-rank", rank,
                                     per_node=2)
            assert os.path.exists(out + "/killed%s/died-%s" % (rank, rank))
            assert result["recoveries"] >= 1
            for process in killed:
                assert_same_model(process, nodes[0])


def test_a_nodes_processes_hold_worker_0s_buffers_through_a_kill():
    extra = ["--model", "bn", "--seed-rng"]
    with tempfile.TemporaryDirectory() as out:
        _, clean = run_job(out + "/clean", *extra, per_node=2)
        _, killed = run_job(out + "/killed", *extra, "--die-at", "25", "--die-rank", "3",
                            per_node=2)
        assert clean[0]["1.num_batches_tracked"] == 50
        for process in clean + killed:
            assert_same_model(process, clean[0])


def test_only_a_nodes_first_process_joins_the_job_and_a_bad_count_is_refused(monkeypatch):
    for count in ("0", "65"):
        done = pstrain_run(["--nproc_per_node", count], ["/nonexistent"])
        assert done.returncode == 2
        assert "--nproc_per_node in [1, 64]" in done.stderr
    with tempfile.TemporaryDirectory() as out:  # a node's batch of 1 for 2 processes
        done = pstrain_run(["--nproc_per_node", "2", "--max_restarts", "0", "--run_dir", out],
                           [out, "--batch", "1"])
        assert done.returncode == 1
        with open(os.path.join(out, "worker-0-1.log")) as log:
            assert "a node's batch of 1 samples cannot be split among its 2 processes" in log.read()
    for name, value in (("PSTRAIN_LOCAL_GROUP", "file:///nowhere"), ("LOCAL_RANK", "1"),
                        ("LOCAL_WORLD_SIZE", "2"), ("PSTRAIN_COORDINATOR", "127.0.0.1:1")):
        monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match="LOCAL_RANK 1 of a node's 2 processes"):
        pstrain.init([("w", [2])], job_yaml="steps: 1")


def test_a_loss_scale_changes_no_bit_and_an_overflow_skips_the_step_and_halves_it(plain_job):
    # precision fp16 with a loss scale of 1024: a power of two, scaled and
    # unscaled exactly, so the model is bitwise fp32's. An infinite loss on
    # worker 1 at step 10: every server skips the step (both workers' values
    # after it are those before it) and worker 1's scale halves.
    with tempfile.TemporaryDirectory() as out:
        _, fp16 = run_job(out + "/fp16", "--fp16")
        result, overflow = run_job(out + "/overflow", "--fp16", "--inf-at", "10")
        assert list(fp16[1]["scales"][:3]) == [1024, 1024, 1024]
        assert_same_model(fp16[0], plain_job[0])
        for w in overflow:
            assert np.array_equal(w["snapshots"][10], w["snapshots"][9])
            assert not np.array_equal(w["snapshots"][11], w["snapshots"][10])
        assert overflow[1]["scales"][10] == 1024 and overflow[1]["scales"][11] == 512
        assert overflow[0]["scales"][11] == 1024
        assert result["steps"] == 50


def test_a_bf16_autocast_forward_trains_one_model_on_both_workers(plain_job):
    # torch.autocast on the CPU (bf16 matmuls): the gradients the library
    # sees are fp32; the model differs from fp32's by bf16's rounding.
    with tempfile.TemporaryDirectory() as out:
        _, workers = run_job(out, "--autocast-bf16")
        assert_same_model(workers[1], workers[0])
        for name, (relative, _) in differences(workers[0], model_of(plain_job[0])).items():
            assert BOUNDS["sgd"][0] < relative < 0.02, (name, relative)


def test_pushes_and_values_use_the_tensors_own_memory(cluster):
    net = torch.nn.Linear(2, 3)
    with torch.no_grad():
        net.weight.fill_(1.0)
        net.bias.fill_(0.0)
    # The job's tensors are the model's parameters (weight {3, 2}, bias {3}),
    # in chunks of 4 floats over 2 servers.
    job = pstrain.submit_job(cluster.coordinator,
                             "optimizer: {type: sgd, learning_rate: 0.5}\nbatch_size: 4\n"
                             "steps: 3\nnum_workers: 1\nnum_servers: 2\nchunk_bytes: 16\n",
                             [("weight", [3, 2]), ("bias", [3])])
    opt = pst.DistributedOptimizer(net, client=pstrain.Client(cluster.coordinator, job))
    addresses = [p.data_ptr() for p in net.parameters()]
    copied = pstrain.copied_payload_bytes()
    for step in range(3):
        opt.zero_grad()
        (net.weight.sum() + 2 * net.bias.sum()).backward()  # gradients 1 and 2
        assert opt.step(1.0, 4) == step + 1
        # Updated in place: the same storage, SGD's values.
        assert [p.data_ptr() for p in net.parameters()] == addresses
        assert torch.all(net.weight == 1.0 - 0.5 * (step + 1))
        assert torch.all(net.bias == -1.0 * (step + 1))
    assert pstrain.copied_payload_bytes() == copied  # nothing copied on the way
    opt.finish()


def test_errors_are_exceptions_with_the_status(cluster):
    with pytest.raises(pstrain.Error) as e:
        pstrain.submit_job(cluster.coordinator, "optimizer: {type: sgd, learning_rate: 1}\n"
                           "batch_size: 1\nsteps: 1\nnum_workers: 1\nnum_servers: 1\n",
                           [("w", [3, 0])])
    assert e.value.code == "INVALID_ARGUMENT"
    assert "model.tensors[0].shape[1]" in e.value.message
    with pytest.raises(pstrain.Error) as e:
        pstrain.Client(cluster.coordinator, "no-such-job")
    assert e.value.code == "NOT_FOUND"
    job = pstrain.submit_job(cluster.coordinator, "optimizer: {type: sgd, learning_rate: 1}\n"
                             "batch_size: 1\nsteps: 1\nnum_workers: 1\nnum_servers: 1\n",
                             [("w", [2, 3])])
    client = pstrain.Client(cluster.coordinator, job)
    with pytest.raises(pstrain.Error) as e:
        client.tensor_index("v")
    assert e.value.code == "NOT_FOUND" and "'v'" in e.value.message
    with pytest.raises(pstrain.Error) as e:
        client.bind(0, np.zeros(5, np.float32))
    assert e.value.code == "INVALID_ARGUMENT"
    with pytest.raises(TypeError):
        client.bind(0, np.zeros(6, np.float64))
    with pytest.raises(ValueError):
        pst.DistributedOptimizer(torch.nn.Linear(3, 2), client=client)  # not the job's tensors


def test_the_scripts_own_metrics_reach_psctl_prometheus_and_the_result(cluster):
    job = pstrain.submit_job(cluster.coordinator,
                             "optimizer: {type: sgd, learning_rate: 0.1}\nbatch_size: 4\n"
                             "steps: 5\nnum_workers: 1\nnum_servers: 2\n", [("w", [3])])
    client = pstrain.Client(cluster.coordinator, job)
    w = np.zeros(3, np.float32)
    client.bind(0, w)
    client.start()
    client.report_metrics({"mse": 2.0})
    for bad in ({"no-dashes": 1.0}, {"mse": float("nan")},
                {"m%d" % i: 1.0 for i in range(33)}):
        with pytest.raises(pstrain.Error) as e:
            client.report_metrics(bad)
        assert e.value.code == "INVALID_ARGUMENT" and "metrics" in e.value.message
    grad = np.ones(3, np.float32)
    while client.step < client.total_steps:
        client.push(0, grad)
        client.report_metrics({"mse": 1.0 / (client.step + 1)})
        client.end_step(0.5, 4)
    client.finish(metrics={"auc": 0.75})  # mse: the last step's, 0.2

    psctl = subprocess.run([os.path.join(BIN_DIR, "psctl"), "--coordinator", cluster.coordinator,
                            "get", job], capture_output=True, text=True, timeout=60)
    assert psctl.returncode == 0, psctl.stderr
    assert re.search(r"^metrics: +auc 0.75, mse 0.2$", psctl.stdout, re.MULTILINE), psctl.stdout
    assert "test accuracy" not in psctl.stdout  # none was reported
    as_json = subprocess.run([os.path.join(BIN_DIR, "psctl"), "--coordinator", cluster.coordinator,
                              "-o", "json", "get", job], capture_output=True, text=True, timeout=60)
    assert json.loads(as_json.stdout)["result"]["metrics"] == {"auc": 0.75, "mse": 0.2}
    exposition = cluster.coordinator_metrics()
    series = dict(re.findall(r'^pstrain_job_metric\{job_id="%s",name="(\w+)"\} (\S+)$' % job,
                             exposition, re.MULTILINE))
    assert {name: float(value) for name, value in series.items()} == {"auc": 0.75, "mse": 0.2}, \
        exposition


def test_a_jobs_summary_shows_the_scripts_metrics_and_no_library_log_lines():
    with tempfile.TemporaryDirectory() as out:
        done = pstrain_run(["--workers", "2", "--servers", "2", "--run_dir", out + "/run"],
                           [out, "--steps", "20"])
        assert done.returncode == 0, done.stdout + done.stderr
        result = json.loads(done.stdout.strip().splitlines()[-1])
        assert 0.0 <= result["metrics"]["train_accuracy"] <= 1.0
        assert 0.0 <= result["metrics"]["batch_accuracy"] <= 1.0
        summary = [line for line in done.stdout.splitlines() if " succeeded: " in line][0]
        assert "batch_accuracy" in summary and "train_accuracy" in summary, summary
        assert "test accuracy" not in summary, summary
        # The scripts' own output (pstrain-run keeps it in RUN_DIR/worker-N.log)
        # has no log line of the library's (with PSTRAIN_LOG_LEVEL=info it has
        # "I20261207 00:04:45.258678 ... registered with coordinator ...").
        for w in range(2):
            with open(os.path.join(out, "run", "worker-%d.log" % w)) as f:
                log = f.read()
            assert "InitGoogleLogging" not in log, log
            assert not any(line[:1] in "IWE" and line[1:9].isdigit()
                           for line in log.splitlines()), log
