"""Fixtures of the Python package's tests: the pstrain binaries (ctest
passes PSTRAIN_BIN_DIR and puts build/python on PYTHONPATH) and a cluster
of a coordinator and parameter servers as real processes on 127.0.0.1."""
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request

import pytest

BIN_DIR = os.environ.get("PSTRAIN_BIN_DIR", os.path.join(os.path.dirname(__file__), "../../build/bin"))
HERE = os.path.dirname(os.path.abspath(__file__))


class Cluster:
    def __init__(self, servers, run_dir):
        self.run_dir = run_dir
        self.processes = []
        address_file = os.path.join(run_dir, "coordinator.address")
        self.targets_file = os.path.join(run_dir, "prometheus-targets.json")
        self._start("coordinator", [os.path.join(BIN_DIR, "pstrain-coordinator"),
                                    "--listen=127.0.0.1:0", "--address_file=" + address_file,
                                    "--prometheus_sd_file=" + self.targets_file, "--lease_s=10"])
        deadline = time.monotonic() + 60
        while not os.path.exists(address_file):
            assert time.monotonic() < deadline, "the coordinator did not start"
            time.sleep(0.05)
        with open(address_file) as f:
            self.coordinator = f.read().strip()
        for s in range(servers):
            self._start("server-%d" % s, [os.path.join(BIN_DIR, "pstrain-server"),
                                          "--listen=127.0.0.1:0", "--coordinator=" + self.coordinator,
                                          "--node_id=server-%d" % s, "--checkpoint_root=" + run_dir,
                                          "--coordinator_loss_exit_s=30"])

    def coordinator_metrics(self):
        """The text of the coordinator's /metrics (its address from the
        Prometheus targets file)."""
        deadline = time.monotonic() + 60
        while True:
            try:
                with open(self.targets_file) as f:
                    groups = json.load(f)
                address = next(g["targets"][0] for g in groups
                               if g["labels"]["role"] == "coordinator")
                break
            except (OSError, ValueError, StopIteration):
                assert time.monotonic() < deadline, "no coordinator in the targets file"
                time.sleep(0.05)
        with urllib.request.urlopen("http://%s/metrics" % address, timeout=30) as response:
            return response.read().decode()

    def _start(self, name, argv):
        log = open(os.path.join(self.run_dir, name + ".log"), "w")
        self.processes.append(subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT))

    def stop(self):
        for p in reversed(self.processes):
            p.terminate()
        for p in self.processes:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()


@pytest.fixture
def cluster():
    with tempfile.TemporaryDirectory(prefix="pstrain-pytest.") as run_dir:
        c = Cluster(2, run_dir)
        try:
            yield c
        finally:
            c.stop()


def pstrain_run(args, script_args, timeout=300, env=None, script="train_worker.py"):
    """Runs `script` (of tests/python) through pstrain-run, in `env` (this
    process's environment if None); returns the completed process (stdout:
    the progress and the JSON result line)."""
    argv = [os.path.join(BIN_DIR, "pstrain-run")] + args + [
        "--", sys.executable, os.path.join(HERE, script)] + script_args
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=env)


def processes_of_run(run_dir):
    """The pids of the processes whose environment names `run_dir` as
    PSTRAIN_RUN_DIR: what pstrain-run started there, and what those
    started in turn (DataLoader workers, their forkserver)."""
    wanted = ("PSTRAIN_RUN_DIR=" + run_dir).encode()
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open("/proc/%s/environ" % pid, "rb") as f:
                if wanted in f.read().split(b"\0"):
                    found.append(int(pid))
        except OSError:
            pass  # ended, or not ours to read
    return found
