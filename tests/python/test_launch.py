"""What a user meets first with pstrain-run: the threads it gives each
script, a job file checked before anything starts, errors that are not
retried when a retry cannot help, the failing script's own last line on
pstrain-run's stderr, DataLoader workers that neither hang nor outlive
their script, and a signal to pstrain-run that ends every process of the
run."""
import os
import signal
import subprocess
import sys
import tempfile
import time

import pytest

from conftest import BIN_DIR, HERE, processes_of_run, pstrain_run

THREAD_VARIABLES = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")


def environment(**variables):
    """This process's environment without the thread variables, with
    `variables`."""
    env = {k: v for k, v in os.environ.items() if k not in THREAD_VARIABLES}
    env.update(variables)
    return env


def read(path):
    with open(path) as f:
        return f.read()


def test_pstrain_run_gives_each_script_its_share_of_the_cpus_unless_the_user_chose():
    with tempfile.TemporaryDirectory() as out:
        # 2 scripts and 2 servers share the CPUs this process may use.
        done = pstrain_run(["--workers", "2", "--servers", "2", "--run_dir", out + "/run"],
                           [out, "--steps", "5"], env=environment())
        assert done.returncode == 0, done.stdout + done.stderr
        share = max(1, len(os.sched_getaffinity(0)) // 4)
        assert "pstrain-run: %d compute thread(s) a worker process" % share in done.stdout
        assert "shared by 4 processes" in done.stdout
        log = read(out + "/run/worker-0.log")
        assert "pstrain: compute threads: torch %d, OpenBLAS %d (OMP_NUM_THREADS=%d" % (
            share, share, share) in log, log
        # A variable the user set wins, and pstrain-run sets none of the others.
        done = pstrain_run(["--workers", "2", "--servers", "2", "--run_dir", out + "/user"],
                           [out, "--steps", "5"], env=environment(OMP_NUM_THREADS="3"))
        assert done.returncode == 0, done.stdout + done.stderr
        assert "threads are the environment's (OMP_NUM_THREADS=3)" in done.stdout
        log = read(out + "/user/worker-0.log")
        assert "pstrain: compute threads: torch 3" in log and "(OMP_NUM_THREADS=3)" in log, log


@pytest.mark.parametrize("job, field", [
    ("optimizer: {type: sgd, learning_rate: 0.1}\nbatch_size: 4\nsteps: 3\ntables:\n"
     "  - {name: t, dim: 0}\n", "tables[0].dim: must be in [1, 1024], got 0"),
    ("batch_size: 4\nsteps: 3\n", "optimizer.type: required"),
    ("optimizer: {type: sgd, learning_rate: 0.1}\nbatch_size: 4\nsteps: 3\nnum_workers: 3\n",
     "num_workers: 3"),
    ("optimizer: {type: sgd, learning_rate: 0.1}\nbatch_size: 4\nsteps: 3\n"
     "model: {type: mlp}\n", "model.type: the program gives the model's tensors"),
])
def test_a_bad_job_file_is_refused_before_anything_starts(job, field):
    with tempfile.TemporaryDirectory() as out:
        with open(out + "/job.yaml", "w") as f:
            f.write(job)
        done = pstrain_run(["--workers", "2", "--job", out + "/job.yaml", "--run_dir",
                            out + "/run"], [out])
        assert done.returncode == 2, done.stdout + done.stderr
        assert done.stdout == ""
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1 and field in lines[0], done.stderr
        assert lines[0].startswith("pstrain-run: " + out + "/job.yaml: ")
        assert not os.path.exists(out + "/run")  # nothing started


@pytest.mark.parametrize("what, says", [
    ("no-job", "pstrain.init: no job: give pstrain-run --job FILE"),
    ("no-table", "the job has no table nope"),
])
def test_a_permanent_error_ends_the_run_at_once_with_the_scripts_line(what, says):
    with tempfile.TemporaryDirectory() as out:
        done = pstrain_run(["--workers", "2", "--run_dir", out + "/run"], [what],
                           script="failing_worker.py")
        assert done.returncode == 1, done.stdout + done.stderr
        assert "starting it again" not in done.stderr  # not retried
        assert "exit 2" in done.stderr and says in done.stderr, done.stderr


def test_a_node_that_keeps_failing_shows_its_last_error_line():
    with tempfile.TemporaryDirectory() as out:
        done = pstrain_run(["--workers", "1", "--max_restarts", "1", "--run_dir", out + "/run"],
                           ["crash"], script="failing_worker.py")
        assert done.returncode == 1, done.stdout + done.stderr
        assert done.stderr.count("starting it again") == 1, done.stderr
        last = done.stderr.strip().splitlines()[-1]
        assert "RuntimeError: the script's own error, line 42" in last, done.stderr


def test_a_script_without_a_main_guard_fails_at_once_saying_what_to_add():
    with tempfile.TemporaryDirectory() as out:
        done = pstrain_run(["--workers", "2", "--run_dir", out + "/run"], [],
                           script="unguarded_worker.py")
        assert done.returncode == 1, done.stdout + done.stderr
        assert 'put it under `if __name__ == "__main__":`' in done.stderr, done.stderr
        assert "starting it again" not in done.stderr
        assert processes_of_run(out + "/run") == []


def test_a_signal_to_pstrain_run_alone_ends_every_process_of_the_run():
    with tempfile.TemporaryDirectory() as out:
        run_dir = out + "/run"
        argv = [os.path.join(BIN_DIR, "pstrain-run"), "--workers", "2", "--servers", "2",
                "--run_dir", run_dir, "--", sys.executable, os.path.join(HERE, "train_worker.py"),
                out, "--loader-workers", "2", "--steps", "100000"]
        launcher = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    text=True)
        try:
            # Once training runs, the loaders' processes are up.
            deadline = time.monotonic() + 300
            while True:
                line = launcher.stdout.readline()
                assert line and time.monotonic() < deadline, "the job did not start"
                if "running" in line:
                    break
            while len(processes_of_run(run_dir)) < 4:  # 2 scripts, their loaders
                assert time.monotonic() < deadline, processes_of_run(run_dir)
                time.sleep(0.1)
            launcher.send_signal(signal.SIGTERM)
            _, err = launcher.communicate(timeout=120)
        finally:
            launcher.kill()
        assert launcher.returncode == 128 + signal.SIGTERM, err
        assert "pstrain-run: signal 15, stopping" in err
        assert processes_of_run(run_dir) == []
