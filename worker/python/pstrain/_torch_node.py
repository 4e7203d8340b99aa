"""pstrain.torch's several processes per node (pstrain-run --nproc_per_node):
the node's view of the job and the group that sums the processes'
gradients (the module docstring of pstrain.torch describes them)."""
import datetime
import os

import torch

import pstrain
from pstrain import SetupError


class _NodeClient:
    """The job as one of a node's processes sees it: the node's worker
    (LOCAL_RANK 0's client, `worker`, None elsewhere) with this process's
    part of the node's batch."""

    _JOB = ("job_id", "node_id", "seed", "total_steps", "steps_per_epoch", "accumulate_steps",
            "mode", "tensors", "buffers")
    # Of each step, from LOCAL_RANK 0 (a recovery, a lost worker change them).
    _STEP = ("step", "generation", "worker_index", "batch_offset", "node_batch", "global_batch",
             "num_workers", "node_gradient_scale", "loss_scale")

    def __init__(self, local_rank, local_size, job, worker=None):
        self.local_rank, self.local_size = local_rank, local_size
        self._job, self._worker = job, worker
        self._state = {}
        self._order = (None, None, None)  # (epoch, n, sample order)

    @classmethod
    def of(cls, worker, local_rank, local_size):
        return cls(local_rank, local_size, {k: getattr(worker, k) for k in cls._JOB}, worker)

    def state(self):
        """LOCAL_RANK 0: the step's values, from the worker."""
        w = self._worker
        self._state = dict(step=w.step, generation=w.generation, worker_index=w.worker_index,
                           batch_offset=w.batch_offset, node_batch=w.batch_size,
                           global_batch=w.global_batch, num_workers=w.num_workers,
                           node_gradient_scale=w.gradient_scale, loss_scale=w.loss_scale)
        return [float(self._state[k]) for k in self._STEP]

    def set_state(self, values):
        self._state = {k: (v if k in ("node_gradient_scale", "loss_scale") else int(v))
                       for k, v in zip(self._STEP, values)}

    def __getattr__(self, name):
        if name.startswith("_"):
            raise AttributeError(name)
        if name in _NodeClient._JOB:
            return self._job[name]
        if name in _NodeClient._STEP:
            return self._state[name]
        if self._worker is None:
            raise AttributeError("pstrain: %s is LOCAL_RANK 0's (the node's worker of the job)"
                                 % name)
        return getattr(self._worker, name)

    def _part(self):
        b, k, j = self.node_batch, self.local_size, self.local_rank
        return j * b // k, (j + 1) * b // k

    @property
    def batch_size(self):
        lo, hi = self._part()
        return hi - lo

    @property
    def gradient_scale(self):
        """This process's share of the node's gradient scale."""
        return self.node_gradient_scale * self.batch_size / self.node_batch

    def batch_indices(self, step, dataset_size):
        """This process's part of the node's samples of `step` (what the
        worker's batch_indices gives, cut in LOCAL_WORLD_SIZE parts)."""
        if dataset_size < self.global_batch or step < 0:
            raise pstrain.Error("INVALID_ARGUMENT", "a training set of %d samples is smaller than "
                                "the global batch of %d, or a negative step" %
                                (dataset_size, self.global_batch))
        per_epoch = dataset_size // self.global_batch
        epoch = step // per_epoch
        if self._order[:2] != (epoch, dataset_size):
            self._order = (epoch, dataset_size, pstrain.sample_order(self.seed, epoch,
                                                                      dataset_size))
        first = (step % per_epoch) * self.global_batch + self.batch_offset
        lo, hi = self._part()
        return self._order[2][first + lo:first + hi]

    def report_metrics(self, metrics):
        if self._worker is not None:  # the node's are LOCAL_RANK 0's
            self._worker.report_metrics(metrics)

    def finish(self, **evaluation):
        if self._worker is not None:
            self._worker.finish(**evaluation)


class _Node:
    """A node's processes (pstrain-run --nproc_per_node): torch.distributed's
    default group over gloo, where each step sums their gradients and
    LOCAL_RANK 0 gives the new values."""

    def __init__(self, group, params, buffers):
        import torch.distributed as dist
        self.dist = dist
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        self.local_size = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        if dist.is_initialized():
            raise SetupError("pstrain: torch.distributed is initialized already; with several "
                             "processes per node pstrain.torch makes its group")
        dist.init_process_group("gloo", init_method=group, rank=self.local_rank,
                                world_size=self.local_size, timeout=datetime.timedelta(hours=1))
        self.params, self.buffers = params, buffers
        floats = sum(p.numel() for _, p in params)
        self.grads = torch.zeros(floats + 2, dtype=torch.float32)  # + loss sum, samples
        self.values = torch.zeros(floats + sum(b.words.numel() for b in buffers),
                                  dtype=torch.float32)
        self.client = None  # the node's view of the job (_NodeClient)
        self.worker = None  # LOCAL_RANK 0: its client, the job's worker

    def _broadcast(self, stop=False):
        """LOCAL_RANK 0: the step's state and the values; elsewhere: takes them."""
        state = torch.zeros(len(_NodeClient._STEP) + 1, dtype=torch.float64)
        if self.local_rank == 0:
            state[0] = float(stop)
            if not stop:
                state[1:] = torch.tensor(self.client.state(), dtype=torch.float64)
        self.dist.broadcast(state, 0)
        if stop:
            return
        if state[0] != 0:
            raise RuntimeError("pstrain: the node's LOCAL_RANK 0 process (its worker of the job) "
                               "stopped: see its log")
        tensors = [p.data.view(-1) for _, p in self.params] + [b.words for b in self.buffers]
        if self.local_rank == 0:
            torch.cat(tensors, out=self.values)
        else:
            self.client.set_state(state[1:].tolist())
        self.dist.broadcast(self.values, 0)
        if self.local_rank > 0:
            offset = 0
            for t in tensors:
                t.copy_(self.values[offset:offset + t.numel()])
                offset += t.numel()
            for b in self.buffers:
                b.load()

    def lead(self, worker):
        """LOCAL_RANK 0, once its worker has started: the others join."""
        self.worker = worker
        self.client = _NodeClient.of(worker, 0, self.local_size)
        self.dist.broadcast_object_list([self.client._job], 0)
        self._broadcast()
        return self._checked(self.client)

    def join(self):
        """LOCAL_RANK > 0: the job's view from LOCAL_RANK 0, its values."""
        job = [None]
        self.dist.broadcast_object_list(job, 0)
        self.client = _NodeClient(self.local_rank, self.local_size, job[0])
        self._broadcast()
        return self._checked(self.client)

    def _checked(self, client):
        if client.node_batch < self.local_size:  # each process needs samples
            raise SetupError("pstrain: a node's batch of %d samples cannot be split among its %d "
                             "processes" % (client.node_batch, self.local_size))
        return client

    def step(self, loss, samples):
        """The node's step: the sum of its processes' gradients pushed by
        LOCAL_RANK 0, whose new values every process gets; returns the
        step to compute next."""
        c = self.client
        samples = samples or c.batch_size
        scale = c.gradient_scale
        offset = 0
        for _, p in self.params:
            part = self.grads[offset:offset + p.numel()]
            offset += p.numel()
            if p.grad is None:
                part.zero_()
            else:
                torch.mul(p.grad.reshape(-1), scale, out=part)
        self.grads[-2] = loss * samples
        self.grads[-1] = samples
        self.dist.all_reduce(self.grads)
        if self.local_rank > 0:
            self._broadcast()
            return c.step
        try:
            worker = self.worker
            offset = 0
            for index, (_, p) in enumerate(self.params):
                worker.push_address(index, self.grads[offset:].data_ptr(), p.numel())
                offset += p.numel()
            for b in self.buffers:
                b.send(worker)
            worker.end_step(float(self.grads[-2] / self.grads[-1]), int(self.grads[-1]))
            for b in self.buffers:
                b.load()
        except BaseException:
            self._broadcast(stop=True)
            raise
        self._broadcast()
        return c.step
