"""pstrain's client library for Python: a training loop of your own, as a
worker of a pstrain job whose model is external.

    import pstrain
    client = pstrain.init([("weight", [784, 10]), ("bias", [10])])
    client.bind(0, w); client.bind(1, b)      # float32 arrays, updated in place
    client.start()
    while client.step < client.total_steps:
        idx = client.batch_indices(client.step, len(train))
        ...                                   # gradient of the mean loss
        client.push(0, gw * client.gradient_scale); client.push(1, ...)
        client.end_step(loss, len(idx))
    client.finish(test_accuracy=acc, metrics={"mse": mse})  # metrics: any of the script's own

pstrain.torch has the drop-in for a PyTorch script. Errors are
pstrain.Error, whose .code is the status code ("INVALID_ARGUMENT", ...)
and .message the text.
"""
import ctypes
import os
import re
import sys

from pstrain._client import (ClickReader, Client, Error, copied_payload_bytes, read_export,
                             read_model, sample_order, set_log_level, submit_job)

Error.code = property(lambda self: self.args[0], doc="the status code, e.g. 'NOT_FOUND'")
Error.message = property(lambda self: self.args[1], doc="what went wrong")
Error.__str__ = lambda self: "%s: %s" % (self.args[0], self.args[1])


class SetupError(ValueError):
    """The job or the script cannot run as given (a missing job, a model
    pstrain cannot train): running it again would fail the same way."""


__all__ = ["ClickReader", "Client", "Error", "SetupError", "copied_payload_bytes", "init",
           "read_export", "read_model", "sample_order", "set_log_level", "submit_job"]

# The library's own log lines reach stderr from PSTRAIN_LOG_LEVEL up (info,
# warning, error, off): errors only unless asked.
set_log_level(os.environ.get("PSTRAIN_LOG_LEVEL", "error"))

# Status codes of errors that a second try would meet again.
_PERMANENT_CODES = ("INVALID_ARGUMENT", "PERMISSION_DENIED", "UNAUTHENTICATED")


def _is_permanent(error):
    return isinstance(error, SetupError) or (isinstance(error, Error) and
                                             error.code in _PERMANENT_CODES)


def _exit_2_when_permanent():
    """Under pstrain-run (PSTRAIN_RUN_ID), a script that dies of a permanent
    error exits 2, which pstrain-run does not start again: the traceback
    first, as Python prints it."""
    previous = sys.excepthook

    def hook(kind, value, traceback):
        previous(kind, value, traceback)
        if _is_permanent(value):
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(2)
    sys.excepthook = hook


if os.environ.get("PSTRAIN_RUN_ID"):
    _exit_2_when_permanent()

_THREAD_VARIABLES = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")


def _report_threads():
    """One line on stderr at the start: the process's compute threads and
    where their number comes from (pstrain-run sets the variables to each
    process's share of the CPUs, unless the user set one)."""
    pools = []
    if "torch" in sys.modules:
        pools.append("torch %d" % sys.modules["torch"].get_num_threads())
    try:  # only if loaded (numpy's and torch's matrix products)
        blas = ctypes.CDLL("libopenblas.so.0", mode=os.RTLD_NOLOAD)
        pools.append("OpenBLAS %d" % blas.openblas_get_num_threads())
    except (OSError, AttributeError):
        pass
    given = ["%s=%s" % (v, os.environ[v]) for v in _THREAD_VARIABLES if os.environ.get(v)]
    sys.stderr.write("pstrain: compute threads: %s (%s)\n" % (
        ", ".join(pools) or "no pool loaded",
        ", ".join(given) if given else "no thread variable set: each library's default"))


def _importing_the_script_again():
    """Whether multiprocessing is running the script's top level again in
    a process it starts (forkserver, spawn): where an unguarded script
    would join its job a second time."""
    import multiprocessing
    return bool(getattr(multiprocessing.current_process(), "_inheriting", False))


def init(tensors, job_yaml=None, coordinator=None, job_id=None, node_id=None, tables=(),
         **options):
    """Joins this process's job as one of its workers and returns the Client.

    tensors: the model's tensors in order, (name, shape) of a parameter,
    (name, shape, True, dtype) of a buffer (dtype: "float32", "int64", ...). The job is job_id, or
    PSTRAIN_JOB_ID; without one, the job file job_yaml (or the text of the
    file PSTRAIN_JOB_FILE) is submitted with these tensors and `tables`
    ((name, dim, initial rows) of each table the model brings), under the
    request id PSTRAIN_RUN_ID if set, so that every process of one launch
    (pstrain-run) submits the same job and joins it. The coordinator is
    coordinator or PSTRAIN_COORDINATOR, the node id node_id or
    PSTRAIN_NODE_ID (a restarted process under its old id takes its place).
    Other keyword arguments go to Client (cert_file, key_file, ca_file, ...).
    """
    env = os.environ
    if _importing_the_script_again():
        raise SetupError("pstrain.init: called while a new process (a DataLoader's worker, its "
                         "forkserver) imports the script again: put the script's training under "
                         "`if __name__ == \"__main__\":`")
    if env.get("PSTRAIN_LOCAL_GROUP") and env.get("LOCAL_RANK", "0") != "0":
        raise SetupError("pstrain.init: this process is LOCAL_RANK %s of a node's %s processes "
                         "(pstrain-run --nproc_per_node): only LOCAL_RANK 0 joins the job; "
                         "pstrain.torch.DistributedOptimizer combines a node's processes" %
                         (env["LOCAL_RANK"], env.get("LOCAL_WORLD_SIZE")))
    coordinator = coordinator or env.get("PSTRAIN_COORDINATOR")
    if not coordinator:
        raise SetupError("pstrain.init: no coordinator: start the script with pstrain-run, or "
                         "give coordinator= (or PSTRAIN_COORDINATOR)")
    job_id = job_id or env.get("PSTRAIN_JOB_ID")
    _report_threads()
    tls = {k: options[k] for k in ("cert_file", "key_file", "ca_file") if k in options}
    token = options.pop("token", env.get("PSTRAIN_TOKEN", ""))  # the control API's, to submit
    if not job_id:
        if job_yaml is None:
            path = env.get("PSTRAIN_JOB_FILE")
            if not path:
                raise SetupError("pstrain.init: no job: give pstrain-run --job FILE (or "
                                 "job_yaml=, job_id=, PSTRAIN_JOB_FILE or PSTRAIN_JOB_ID)")
            with open(path) as f:
                job_yaml = f.read()
        job_yaml = _with_launch_settings(job_yaml, env)
        job_id = submit_job(coordinator, job_yaml, [(t[0], list(t[1])) + tuple(t[2:])
                                                    for t in tensors],
                            request_id=env.get("PSTRAIN_RUN_ID", ""), token=token,
                            tables=list(tables), **tls)
    return Client(coordinator, job_id, node_id=node_id or env.get("PSTRAIN_NODE_ID", ""),
                  **options)


def _with_launch_settings(job_yaml, env):
    """The job file with what pstrain-run decided: num_workers and
    num_servers (which the file may only repeat), and checkpoints in the
    run directory unless the file has its own."""
    for key, var in (("num_workers", "PSTRAIN_NUM_WORKERS"), ("num_servers", "PSTRAIN_NUM_SERVERS")):
        value = env.get(var)
        if not value:
            continue
        given = re.search(r"^%s\s*:\s*(\d+)" % key, job_yaml, re.MULTILINE)
        if given is None:
            job_yaml += "\n%s: %s\n" % (key, value)
        elif given.group(1) != value:
            raise SetupError("pstrain.init: the job says %s: %s, the launch %s" %
                             (key, given.group(1), value))
    run_dir = env.get("PSTRAIN_RUN_DIR")
    if run_dir and re.search(r"^checkpoint\s*:", job_yaml, re.MULTILINE) is None:
        job_yaml += "\ncheckpoint: {dir: %s/checkpoints}\n" % run_dir
    return job_yaml
