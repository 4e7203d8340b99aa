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
import hashlib
import itertools
import os

import torch

import pstrain
from pstrain import SetupError
from pstrain._torch_data import ShardSampler, ShardedLoader
from pstrain._torch_node import _Node
from pstrain._torch_tables import (Embedding, EmbeddingBag, EmbeddingBags, _bind_tables,
                                  _load_table_weights, sparse_embeddings)

__all__ = ["DistributedOptimizer", "Embedding", "EmbeddingBag", "EmbeddingBags", "ShardSampler",
           "ShardedLoader", "load"]

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
            raise SetupError("pstrain: buffer %s must be a contiguous CPU tensor of %s (got %s "
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
        module = isinstance(model, torch.nn.Module)
        # torch's own sparse embeddings train as tables (a pst module each).
        self._sparse_modules = sparse_embeddings(model) if module else []
        tables = [m for m in model.modules() if isinstance(m, EmbeddingBags)] if module else []
        tables += [m.rows for _, m in self._sparse_modules]
        if group and tables:
            raise SetupError("pstrain: embedding tables are not offered with several processes "
                             "per node")
        if group and overlap_values:
            raise SetupError("pstrain: overlap_values is not offered with several processes per "
                             "node (the node's values come in one broadcast)")
        if overlap_values and not isinstance(model, torch.nn.Module):
            raise SetupError("pstrain: overlap_values needs the model as a torch.nn.Module "
                             "(its modules' forward pre-hooks await the values)")
        named = model.named_parameters() if hasattr(model, "named_parameters") else model
        as_tables = {id(m.module.weight) for _, m in self._sparse_modules}
        named = [(name, p) for name, p in named if id(p) not in as_tables]
        for name, p in named:
            if p.dtype != torch.float32 or p.device.type != "cpu" or not p.is_contiguous():
                raise SetupError("pstrain: parameter %s must be a contiguous float32 CPU tensor "
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
        declared = [d for m in tables for d in m.declared_tables()]
        self.client = client or pstrain.init(tensors, job_yaml=job_yaml, tables=declared,
                                             **init_options)
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
            raise SetupError("pstrain: the job's tensors %s are not the model's parameters and "
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


def _floats(metrics):
    return {name: float(value.detach()) if torch.is_tensor(value) else float(value)
            for name, value in metrics.items()}


def load(path, model=None):
    """A model file (psctl export, pstrain-run --export), or the directory
    they write for a job with embedding tables, as a state dict of its
    dense tensors: model.load_state_dict(pstrain.torch.load(path)) puts the
    trained parameters and buffers into a fresh model.

    With `model`, everything goes into it and it is returned: the dense
    tensors (load_state_dict), and each table's rows into the module that
    reads the table — a pst.EmbeddingBags (EmbeddingBag, Embedding) then
    looks its keys up in the exported rows, in this process and without a
    job (a key without a row reads as zeros, as on the servers); an
    nn.Embedding or nn.EmbeddingBag trained as a table (sparse=True) gets
    them as its weight's rows. A model that evaluates so gives the job's
    own figures."""
    tensors, tables = pstrain.read_export(path)
    state = {}
    for name, shape, buffer, dtype, values in tensors:
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
    if model is None:
        return state
    exported = {name: (dim, keys, rows) for name, dim, keys, rows in tables}
    as_weights = _load_table_weights(model, exported)
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [name for name in missing if name not in as_weights]
    if missing or unexpected:
        raise SetupError("pstrain: %s does not fit the model: %s" % (path, "; ".join(
            part for part in ("missing " + ", ".join(missing) if missing else "",
                              "not in the model " + ", ".join(unexpected) if unexpected else "")
            if part)))
    for module in model.modules():
        if isinstance(module, EmbeddingBags):
            module._bind_export(exported)
    return model
