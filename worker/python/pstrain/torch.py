"""pstrain for PyTorch scripts: the servers run the optimizer, the script
computes gradients.

    import pstrain.torch as pst
    model = Net()
    opt = pst.DistributedOptimizer(model)        # joins the job, binds the parameters
    sampler = pst.ShardSampler(opt.client, len(train_set))
    for indices in sampler:                      # this worker's batch of each step
        x, y = ...                               # the samples `indices`
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)      # the mean loss of the batch
        loss.backward()                          # each gradient pushed as it is ready
        opt.step(loss)                           # the new values are in the parameters
    opt.finish(test_accuracy=..., metrics={"auc": ...})  # metrics: any of the script's own

A parameter's gradient is scaled in place by the worker's share of the
global batch (client.gradient_scale: 1/W for W workers of equal batches in
sync and ssp, 1 in async) and pushed from its own memory as soon as
backward has accumulated it (a hook on its AccumulateGrad node), while
backward goes on with the layers below. step() waits for the new values,
which the library writes into the parameters' own storage, in place (their
data_ptr() never changes). The sampler reads the client's step each time,
so after a recovery (the job gone back to a checkpoint) it goes on from
there without a word from the script; ShardedLoader does the same for a
DataLoader with worker processes. The module's buffers (BatchNorm's
statistics) are worker 0's after every step on every worker.

Gradient accumulation (the job's accumulate_steps, k): each step's batch
is k micro-batches; the script runs forward and backward on each in turn
(torch sums the gradients) and calls step() once:

    k = opt.client.accumulate_steps
    for indices in sampler:
        opt.zero_grad()
        for micro in range(k):
            part = indices[micro * len(indices) // k:(micro + 1) * len(indices) // k]
            loss = F.cross_entropy(model(x[part]), y[part])
            loss.backward()                      # the k-th pushes the sum
        opt.step(loss)

A gradient is pushed once a step, after the k-th backward has added to it
(scaled by gradient_scale, which divides by k too); step() pushes the ones
that had fewer.

Several processes per node (pstrain-run --nproc_per_node K, torchrun's
name): the node is one worker of the job, whose batch its K processes
share (opt.client.batch_indices gives each its LOCAL_RANK-th part, and
gradient_scale its share of the node's). They meet in a torch.distributed
gloo group (PSTRAIN_LOCAL_GROUP, which pstrain-run sets; the group is
torch.distributed's default one), step() sums their gradients there (one
all-reduce), and LOCAL_RANK 0, the node's worker, pushes the node's sum
and broadcasts the new values (parameters and buffers) to the others: one
push per node crosses to the servers. The script is the same on every
process; only LOCAL_RANK 0's metrics and finish() reach the job.

Embedding tables whose rows live on the servers (the job file's
`tables`, docs/sparse-tables.md): pst.EmbeddingBag and pst.Embedding in
place of nn.EmbeddingBag and nn.Embedding, or pst.EmbeddingBags for
several tables in one exchange; DistributedOptimizer(model) binds them to
the job:

    self.fields = pst.EmbeddingBags(["c1", "c2", ...], mode="sum")
    ...
    e = self.fields(keys)          # keys: int64 [batch, tables] -> [batch, tables, dim]

The forward pass pulls the batch's distinct keys (any 64-bit ids, no
vocabulary), backward pushes their summed gradients (scaled as the dense
ones) while it goes on below, and the servers' table optimizer updates the
rows.

overlap_values=True: step() returns once the servers have the step's end,
and the new values land while the next step begins: a forward pre-hook on
every module waits for the module's own parameters before its forward
runs, so the first layers compute while the later layers' values arrive.
A parameter read outside its own module's forward (another module's
weight used directly, a functional call on it) is not awaited: leave the
option off for such models. The results are bitwise those without it.
"""
import datetime
import hashlib
import itertools
import os

import torch

import pstrain

_DTYPE_NAMES = {torch.float32: "float32", torch.float64: "float64", torch.float16: "float16",
                torch.bfloat16: "bfloat16", torch.int64: "int64", torch.int32: "int32",
                torch.int16: "int16", torch.int8: "int8", torch.uint8: "uint8",
                torch.bool: "bool"}
_DTYPES = {name: dtype for dtype, name in _DTYPE_NAMES.items()}


class _Buffer:
    """One of the model's buffers and the float32 words its bytes travel
    in: `words` bound to the client (the values it receives), `outgoing`
    what a step sends."""

    def __init__(self, index, name, tensor):
        if tensor.device.type != "cpu" or not tensor.is_contiguous() or \
                tensor.dtype not in _DTYPE_NAMES:
            raise ValueError("pstrain: buffer %s must be a contiguous CPU tensor of %s (got %s "
                             "on %s)" % (name, ", ".join(_DTYPE_NAMES.values()), tensor.dtype,
                                         tensor.device))
        self.index, self.name, self.tensor = index, name, tensor
        self.nbytes = tensor.numel() * tensor.element_size()
        self.words = torch.zeros((self.nbytes + 3) // 4, dtype=torch.float32)
        self.outgoing = torch.zeros_like(self.words)
        self.stale = False  # the words hold new values the tensor has not

    def spec(self):
        return (self.name, list(self.tensor.shape), True, _DTYPE_NAMES[self.tensor.dtype])

    def save(self, words):
        words.view(torch.uint8)[:self.nbytes].copy_(self.tensor.reshape(-1).view(torch.uint8))

    def load(self):
        self.tensor.view(-1).view(torch.uint8).copy_(self.words.view(torch.uint8)[:self.nbytes])
        self.stale = False

    def send(self, client):
        """The values the forward passes left, as this step's push."""
        self.save(self.outgoing)
        client.push_address(self.index, self.outgoing.data_ptr(), self.outgoing.numel())


class DistributedOptimizer:
    """Trains `model` (a torch.nn.Module, or its named_parameters()) as a
    worker of this process's pstrain job (pstrain.init: PSTRAIN_* from
    pstrain-run), whose optimizer runs on the servers. Parameters must be
    contiguous float32 CPU tensors. The job's tensors are the parameters'
    names and shapes, then the module's buffers (those its state_dict
    holds: BatchNorm's running statistics, say), which every step keeps in
    step across the workers: each worker gets worker 0's values of the step
    (as DistributedDataParallel broadcasts rank 0's), and checkpoints and
    the exported model hold them. A parameter frozen when the optimizer is
    made (requires_grad=False) is kept as a buffer is: never trained, not
    even by weight decay.

    seed_rng=True seeds torch's global generator at the start of every step
    from (the job's seed, the worker, the step), so that what draws from it
    (dropout) draws the same after a recovery as in a run without one."""

    def __init__(self, model, client=None, job_yaml=None, overlap_values=False, seed_rng=False,
                 **init_options):
        group = os.environ.get("PSTRAIN_LOCAL_GROUP") if client is None else None
        tables = [m for m in model.modules() if isinstance(m, EmbeddingBags)] \
            if isinstance(model, torch.nn.Module) else []
        if group and tables:
            raise ValueError("pstrain: embedding tables are not offered with several processes "
                             "per node")
        if group and overlap_values:
            raise ValueError("pstrain: overlap_values is not offered with several processes per "
                             "node (the node's values come in one broadcast)")
        if overlap_values and not isinstance(model, torch.nn.Module):
            raise ValueError("pstrain: overlap_values needs the model as a torch.nn.Module "
                             "(its modules' forward pre-hooks await the values)")
        named = model.named_parameters() if hasattr(model, "named_parameters") else model
        named = list(named)
        for name, p in named:
            if p.dtype != torch.float32 or p.device.type != "cpu" or not p.is_contiguous():
                raise ValueError("pstrain: parameter %s must be a contiguous float32 CPU tensor "
                                 "(got %s on %s)" % (name, p.dtype, p.device))
        # A frozen parameter is kept as a buffer is: never trained.
        self._params = [(name, p) for name, p in named if p.requires_grad]
        kept = [(name, p) for name, p in named if not p.requires_grad]
        if isinstance(model, torch.nn.Module):
            persistent = model.state_dict().keys()
            kept += [(name, b) for name, b in model.named_buffers() if name in persistent]
        self._buffers = [_Buffer(len(self._params) + i, name, t)
                         for i, (name, t) in enumerate(kept)]
        tensors = [(name, list(p.shape)) for name, p in self._params] + \
            [b.spec() for b in self._buffers]
        self._pushed = []      # this step's pushed gradients, alive until step() returns
        self._backwards = [0] * len(self._params)  # this step's, by parameter
        # overlap_values: the last step's, alive until its values are all in
        self._overlap = overlap_values
        self._previous = []
        self._accumulators = []  # the AccumulateGrad nodes the hooks sit on
        self._seed_rng = seed_rng
        self._node = _Node(group, self._params, self._buffers) if group else None
        if self._node is not None and self._node.local_rank > 0:
            self.client = self._node.join()  # LOCAL_RANK 0's view of the job
            self._check_tensors(tensors)
            self._seed(self.client.step)
            return
        self.client = client or pstrain.init(tensors, job_yaml=job_yaml, **init_options)
        self._check_tensors(tensors)
        self._micro_batches = self.client.accumulate_steps  # the job's: the same every step
        _bind_tables(tables, self.client)
        for index, (name, p) in enumerate(self._params):
            self.client.bind_address(index, p.data_ptr(), p.numel())
            if self._node is None:  # a node's processes push their sum in step()
                accumulator = p.expand_as(p).grad_fn.next_functions[0][0]
                accumulator.register_hook(self._push_hook(index, p))
                self._accumulators.append(accumulator)
        for b in self._buffers:
            self.client.bind_address(b.index, b.words.data_ptr(), b.words.numel())
            b.save(b.words)  # worker 0's are every worker's first values
        if overlap_values:
            index_of = {id(p): index for index, (_, p) in enumerate(self._params)}
            buffer_of = {id(b.tensor): b for b in self._buffers}
            for module in model.modules():
                own = [index_of[id(p)] for p in module.parameters(recurse=False)
                       if id(p) in index_of]
                buffers = [buffer_of[id(t)] for t in itertools.chain(
                    module.parameters(recurse=False), module.buffers(recurse=False))
                    if id(t) in buffer_of]
                if own or buffers:
                    module.register_forward_pre_hook(self._await_hook(own, buffers))
        self.client.start()
        for b in self._buffers:
            b.stale = True
        self._load_buffers()
        if self._node is not None:
            self.client = self._node.lead(self.client)
        self._seed(self.client.step)

    def _check_tensors(self, tensors):
        if [name for name, _ in self.client.tensors] != [t[0] for t in tensors] or \
                [i for i, _ in self.client.buffers] != [b.index for b in self._buffers]:
            raise ValueError("pstrain: the job's tensors %s are not the model's parameters and "
                             "buffers %s" % (self.client.tensors, tensors))

    @property
    def loss_scale(self):
        """precision fp16: what the script multiplies the step's loss by
        before backward ((loss * opt.loss_scale).backward()); the pushed
        gradients are divided by it again. Halved after a step whose
        gradient was not finite (the servers skip it), doubled after
        loss_scale.growth_steps good steps. 1 for other precisions."""
        return self.client.loss_scale

    def _await_hook(self, tensors, buffers):
        tensors = tensors + [b.index for b in buffers]

        def hook(*_):
            self.client.await_values(tensors)
            for b in buffers:
                if b.stale:
                    b.load()
        return hook

    def _load_buffers(self):
        """The new values of the buffers whose module has not taken them."""
        stale = [b for b in self._buffers if b.stale]
        if stale:
            self.client.await_values([b.index for b in stale])
        for b in stale:
            b.load()

    def _seed(self, step):
        if self._seed_rng:
            text = "%d:%d:%d" % (self.client.seed, self.client.worker_index, step)
            if self._node is not None:
                text += ":%d" % self._node.local_rank
            torch.manual_seed(int.from_bytes(hashlib.sha256(text.encode()).digest()[:8],
                                             "little") >> 1)

    def _push_hook(self, index, p):
        def hook(*_):
            if p.grad is None:
                return
            # Pushed once the step's last micro-batch has added to it (a
            # second backward without accumulation pushes again: an error).
            self._backwards[index] += 1
            if self._backwards[index] >= self._micro_batches:
                self._push(index, p)
        return hook

    def _push(self, index, p):
        grad = p.grad
        if not grad.is_contiguous() or grad.dtype != torch.float32:
            p.grad = grad = grad.contiguous().float()
        grad.mul_(self.client.gradient_scale)
        self._pushed.append(grad)
        self.client.push_address(index, grad.data_ptr(), grad.numel())
        self._previous = []  # the push waited for the last step's exchanges

    def step(self, loss=None, samples=None, metrics=None):
        """Ends the step (parameters without a gradient push zeros) and waits
        for the new values; returns the step to compute next. `loss`: the
        batch's mean loss (a tensor or a float) for the job's progress;
        `metrics`: the script's own ({name: value}, values floats or
        one-element tensors), shown with the job's progress."""
        value = float(loss.detach()) if torch.is_tensor(loss) else float(loss or 0.0)
        if metrics:
            self.client.report_metrics(_floats(metrics))
        if self._node is not None:
            step = self._node.step(value, samples)
            self._seed(step)
            return step
        try:
            # A parameter that had a gradient in fewer than all of the
            # step's micro-batches: its sum goes now.
            for index, (_, p) in enumerate(self._params):
                if 0 < self._backwards[index] < self._micro_batches:
                    self._push(index, p)
            self._load_buffers()  # those of a module that did not run
            for b in self._buffers:
                b.send(self.client)
            step = self.client.end_step(value, samples or self.client.batch_size,
                                        await_values=not self._overlap)
        finally:
            self._previous, self._pushed = (self._pushed if self._overlap else []), []
            self._backwards = [0] * len(self._params)
        # The buffers' new values (worker 0's): with overlap_values each
        # module's forward takes its own as it takes its parameters', and
        # after the last step they come now.
        for b in self._buffers:
            b.stale = True
        if not self._overlap or step >= self.client.total_steps:
            self._load_buffers()
        self._seed(step)
        return step

    def zero_grad(self, set_to_none=True):
        # A new gradient tensor each step: the pushed one is never written.
        # Zeroed in place: once the last step's values are in (no retry
        # reads the gradients any more).
        if not set_to_none and self._previous:
            self.client.await_values(range(len(self._params)))
        for _, p in self._params:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()

    def finish(self, test_accuracy=None, test_loss=None, metrics=None):
        """After the job's last step: worker 0's final model becomes the
        job's model file, with this evaluation; `metrics`: the script's own
        final ones ({name: value}), in the job's result (the mean over the
        workers that gave each)."""
        self.client.finish(test_accuracy=test_accuracy, test_loss=test_loss,
                           metrics=_floats(metrics or {}))


class _NodeClient:
    """The job as one of a node's processes sees it: the node's worker
    (LOCAL_RANK 0's client, `worker`, None elsewhere) with this process's
    part of the node's batch."""

    _JOB = ("job_id", "node_id", "seed", "total_steps", "steps_per_epoch", "accumulate_steps",
            "mode", "tensors", "buffers")
    # Of each step, from LOCAL_RANK 0 (a recovery, a lost worker change them).
    _STEP = ("step", "worker_index", "batch_offset", "node_batch", "global_batch", "num_workers",
             "node_gradient_scale", "loss_scale")

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
        self._state = dict(step=w.step, worker_index=w.worker_index,
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
            raise ValueError("pstrain: torch.distributed is initialized already; with several "
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
            raise ValueError("pstrain: a node's batch of %d samples cannot be split among its %d "
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


class EmbeddingBags(torch.nn.Module):
    """Embedding bags of the job's tables `tables` (names in the job file's
    `tables`, whose dim and optimizer are the job's), rows on the servers:
    one pull of every table's distinct keys in the forward pass, each
    table's gradients pushed in backward. mode "sum" or "mean" (as
    nn.EmbeddingBag's; an empty bag gives zeros). forward(keys) with an
    int64 tensor [batch, tables] (one key a table and sample) gives
    [batch, tables, dim]; forward(bags) with a list of (input, offsets)
    a table, as nn.EmbeddingBag takes them (offsets None: input is 2-D,
    [batch, bag size]), gives a list of [batch, dim]. Keys are any 64-bit
    ids (int64 bits); a key the table has not admitted reads as zeros.
    DistributedOptimizer(model) binds the module to the job; each table may
    be read by one module of the model."""

    def __init__(self, tables, mode="mean"):
        super().__init__()
        if mode not in ("sum", "mean"):
            raise ValueError("pstrain: mode must be 'sum' or 'mean', not %r" % (mode,))
        self.tables, self.mode = list(tables), mode
        if len(set(self.tables)) != len(self.tables):
            raise ValueError("pstrain: a table twice in %s" % self.tables)
        self._client, self._indices, self._dims = None, None, None

    def extra_repr(self):
        return "tables=%s, mode=%s" % (self.tables, self.mode)

    def _bind(self, client):
        known = dict(client.tables)
        missing = [t for t in self.tables if t not in known]
        if missing:
            raise ValueError("pstrain: the job has no table %s (its tables: %s)" %
                             (", ".join(missing), ", ".join(known) or "none"))
        self._client = client
        self._indices = [client.table_index(t) for t in self.tables]
        self._dims = [known[t] for t in self.tables]

    def forward(self, bags):
        if self._client is None:
            raise RuntimeError("pstrain: %s is not bound to a job: make the "
                               "DistributedOptimizer of the model first" % self)
        if torch.is_tensor(bags):
            if bags.dim() != 2 or bags.shape[1] != len(self.tables):
                raise ValueError("pstrain: keys must be [batch, %d], got %s" %
                                 (len(self.tables), list(bags.shape)))
            if len(set(self._dims)) != 1:
                raise ValueError("pstrain: keys [batch, tables] need tables of one dim (these "
                                 "have %s): give a list of (input, offsets)" % self._dims)
            return self._lookup_keys(bags.to(torch.int64))
        if len(bags) != len(self.tables):
            raise ValueError("pstrain: %d bags for %d tables" % (len(bags), len(self.tables)))
        looked_up = []
        pulls = []
        for (index, dim), (keys, offsets) in zip(zip(self._indices, self._dims), bags):
            keys = keys.to(torch.int64)
            if offsets is None:
                if keys.dim() == 1:  # one key a bag
                    keys = keys.unsqueeze(1)
                if keys.dim() != 2:
                    raise ValueError("pstrain: input without offsets must be 2-D")
                offsets = torch.arange(keys.shape[0]) * keys.shape[1]
            distinct, inverse = torch.unique(keys.reshape(-1), return_inverse=True)
            rows = torch.empty(distinct.numel(), dim, dtype=torch.float32)
            pulls.append((index, distinct.data_ptr(), distinct.numel(), rows.data_ptr()))
            looked_up.append((index, distinct, inverse, offsets, rows))
        self._client.pull_rows(pulls)
        out = []
        for index, distinct, inverse, offsets, rows in looked_up:
            if torch.is_grad_enabled():
                rows.requires_grad_()
                rows.register_hook(self._push_hook([(index, 0, distinct.numel())], distinct,
                                                   inverse, rows.shape[1]))
            out.append(torch.nn.functional.embedding_bag(inverse, rows, offsets, mode=self.mode))
        return out

    def _lookup_keys(self, keys):
        """One key a table and sample, every table of one dim: the tables'
        distinct keys found at once (a sort of each column), one rows
        tensor for all, [batch, tables, dim] out."""
        columns = keys.t().contiguous()  # [tables, batch]
        ordered, order = columns.sort(dim=1)
        first = torch.ones_like(ordered, dtype=torch.bool)
        first[:, 1:] = ordered[:, 1:] != ordered[:, :-1]
        distinct = ordered[first]  # table by table, ascending
        sizes = first.sum(dim=1)
        starts = torch.cumsum(sizes, 0) - sizes
        inverse = torch.empty_like(order).scatter_(
            1, order, first.cumsum(dim=1) - 1 + starts.unsqueeze(1))
        dim = self._dims[0]
        rows = torch.empty(distinct.numel(), dim, dtype=torch.float32)
        spans = list(zip(self._indices, starts.tolist(), sizes.tolist()))
        self._client.pull_rows([(index, distinct.data_ptr() + 8 * start, size,
                                 rows.data_ptr() + 4 * dim * start)
                                for index, start, size in spans])
        if torch.is_grad_enabled():
            rows.requires_grad_()
            rows.register_hook(self._push_hook(spans, distinct, inverse, dim))
        return torch.nn.functional.embedding(inverse.t(), rows)

    def _push_hook(self, spans, distinct, inverse, dim):
        """Backward's push of the rows' gradients: the rows of `distinct`
        (whose occurrences `inverse` gives), a span (table index, first,
        count) of them a table."""
        def hook(grad):
            grad = (grad * self._client.gradient_scale).contiguous()
            counts = torch.bincount(inverse.reshape(-1),
                                    minlength=distinct.numel()).to(torch.int32)
            for index, start, size in spans:
                self._client.push_rows_address(
                    index, distinct.data_ptr() + 8 * start, counts.data_ptr() + 4 * start,
                    grad.data_ptr() + 4 * dim * start, size)
        return hook


class EmbeddingBag(EmbeddingBags):
    """nn.EmbeddingBag whose rows are table `table` of the job, on the
    servers (EmbeddingBags of one table): forward(input, offsets=None) as
    nn.EmbeddingBag's, giving [batch, dim]."""

    def __init__(self, table, mode="mean"):
        super().__init__([table], mode)

    def forward(self, input, offsets=None):
        return super().forward([(input, offsets)])[0]


class Embedding(EmbeddingBags):
    """nn.Embedding whose rows are table `table` of the job, on the
    servers: forward(input) with int64 keys of any shape gives input.shape
    + [dim], a key's row at each place."""

    def __init__(self, table):
        super().__init__([table], "sum")

    def extra_repr(self):
        return "table=%s" % self.tables[0]

    def forward(self, input):
        # A bag of one key at each place: its row.
        rows = super().forward([(input.reshape(-1), None)])[0]
        return rows.reshape(list(input.shape) + [rows.shape[1]])


def _bind_tables(modules, client):
    """Binds the model's embedding modules to the job's client."""
    if not modules:
        return
    if client.accumulate_steps > 1:
        raise ValueError("pstrain: embedding tables are not offered with accumulate_steps > 1")
    seen = set()
    for module in modules:
        again = seen.intersection(module.tables)
        if again:
            raise ValueError("pstrain: table %s is read by two modules of the model" %
                             ", ".join(sorted(again)))
        seen.update(module.tables)
        module._bind(client)


def _floats(metrics):
    return {name: float(value.detach()) if torch.is_tensor(value) else float(value)
            for name, value in metrics.items()}


def load(path):
    """A model file (psctl export, pstrain-run --export) as a state dict:
    model.load_state_dict(pstrain.torch.load(path)) puts the trained
    parameters and buffers into a fresh model."""
    state = {}
    for name, shape, buffer, dtype, values in pstrain.read_model(path):
        words = torch.from_numpy(values)
        if buffer:
            dtype = _DTYPES[dtype]
            count = 1
            for dim in shape:
                count *= dim
            nbytes = count * torch.empty((), dtype=dtype).element_size()
            state[name] = words.view(torch.uint8)[:nbytes].clone().view(dtype).reshape(shape)
        else:
            state[name] = words.reshape(shape)
    return state


class ShardSampler:
    """This worker's batch of sample indices of each step, as pstrain's own
    workers shard data: every epoch a permutation of the training set by the
    job's seed, the global batch of a step cut by worker index. A
    torch.utils.data.DataLoader takes it as batch_sampler with num_workers=0
    (the step is read as each batch is taken); with worker processes, use
    ShardedLoader."""

    def __init__(self, client, dataset_size):
        self.client = client
        self.dataset_size = dataset_size

    def __iter__(self):
        while self.client.step < self.client.total_steps:
            yield self.client.batch_indices(self.client.step, self.dataset_size).tolist()

    def __len__(self):
        return self.client.total_steps - self.client.step


class _StepsFrom:
    """The index batches of the steps from `start` on, each as (step, i)
    pairs: the batch carries its step through the DataLoader's workers."""

    def __init__(self, client, dataset_size, start):
        self.client, self.dataset_size, self.start = client, dataset_size, start

    def __iter__(self):
        for step in range(self.start, self.client.total_steps):
            yield [(step, int(i)) for i in self.client.batch_indices(step, self.dataset_size)]

    def __len__(self):
        return self.client.total_steps - self.start


class _StepTagged(torch.utils.data.Dataset):
    """The dataset read by (step, index) keys; only this goes to the worker
    processes, never the client."""

    def __init__(self, dataset, collate_fn):
        self.dataset, self.collate_fn = dataset, collate_fn

    def __getitem__(self, key):
        return key[0], self.dataset[key[1]]

    def __len__(self):
        return len(self.dataset)

    def collate(self, items):
        return items[0][0], self.collate_fn([item for _, item in items])


class ShardedLoader:
    """This worker's batches of each step from `dataset`, read by a
    torch.utils.data.DataLoader with worker processes that prefetch ahead
    of the training loop:

        loader = pst.ShardedLoader(train_set, opt.client, num_workers=2)
        for x, y in loader:          # the batch of the step to compute
            ...
            opt.step(loss)

    The batches are ShardSampler's, step after step. When a recovery sends
    the job back to an earlier step, the batches prefetched for the steps
    after it are dropped and the loader starts again from the step the job
    goes on from, so no batch is trained twice and the sync result is
    bitwise that of num_workers=0. The worker processes start by
    `multiprocessing_context` ("forkserver" unless given; "spawn" works
    too): forking the training process, whose client runs gRPC threads,
    is not safe, so "fork" is refused. The dataset (and collate_fn) must
    be picklable and draw no randomness of their own; other keyword
    arguments go to the DataLoader (pin_memory, prefetch_factor, ...)."""

    def __init__(self, dataset, client, num_workers=0, collate_fn=None, **loader_options):
        context = loader_options.pop("multiprocessing_context",
                                     "forkserver" if num_workers > 0 else None)
        if context == "fork" or getattr(context, "get_start_method", lambda: "")() == "fork":
            raise ValueError("pstrain: the DataLoader's workers cannot be forked from a process "
                             "whose client runs gRPC threads: use forkserver or spawn")
        for name in ("batch_size", "shuffle", "sampler", "batch_sampler", "drop_last"):
            if name in loader_options:
                raise ValueError("pstrain: ShardedLoader chooses the batches (%s)" % name)
        self.client = client
        self._dataset = _StepTagged(dataset, collate_fn or torch.utils.data.default_collate)
        self._size = len(dataset)
        self._options = dict(loader_options, num_workers=num_workers,
                             multiprocessing_context=context)

    def __iter__(self):
        while self.client.step < self.client.total_steps:
            start = self.client.step
            loader = torch.utils.data.DataLoader(
                self._dataset, batch_sampler=_StepsFrom(self.client, self._size, start),
                collate_fn=self._dataset.collate, **self._options)
            went_back = False
            taken = None  # the step of the batch last taken
            for step, batch in loader:
                if taken is not None and self.client.step == taken:
                    raise RuntimeError("pstrain: ShardedLoader gives one batch a step: call "
                                       "step() before taking the next")
                if step != self.client.step:  # prefetched for a step the job went back from
                    went_back = True
                    break
                taken = step
                yield batch
            del loader  # its worker processes end
            if not went_back and self.client.step == taken:
                return  # no step() after the last batch: the loop is done with them

    def __len__(self):
        return self.client.total_steps - self.client.step
