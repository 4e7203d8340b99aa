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
backward goes on with the layers below.

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
that had fewer. step() waits for the new values,
which the library writes into the parameters' own storage, in place (their
data_ptr() never changes). The sampler reads the client's step each time,
so after a recovery (the job gone back to a checkpoint) it goes on from
there without a word from the script.

overlap_values=True: step() returns once the servers have the step's end,
and the new values land while the next step begins: a forward pre-hook on
every module waits for the module's own parameters before its forward
runs, so the first layers compute while the later layers' values arrive.
A parameter read outside its own module's forward (another module's
weight used directly, a functional call on it) is not awaited: leave the
option off for such models. The results are bitwise those without it.
"""
import torch

import pstrain


class DistributedOptimizer:
    """Trains `model` (a torch.nn.Module, or its named_parameters()) as a
    worker of this process's pstrain job (pstrain.init: PSTRAIN_* from
    pstrain-run), whose optimizer runs on the servers. Parameters must be
    contiguous float32 CPU tensors; the job's tensors are the parameters'
    names and shapes."""

    def __init__(self, model, client=None, job_yaml=None, overlap_values=False, **init_options):
        if overlap_values and not isinstance(model, torch.nn.Module):
            raise ValueError("pstrain: overlap_values needs the model as a torch.nn.Module "
                             "(its modules' forward pre-hooks await the values)")
        named = model.named_parameters() if hasattr(model, "named_parameters") else model
        self._params = [(name, p) for name, p in named]
        for name, p in self._params:
            if p.dtype != torch.float32 or p.device.type != "cpu" or not p.is_contiguous():
                raise ValueError("pstrain: parameter %s must be a contiguous float32 CPU tensor "
                                 "(got %s on %s)" % (name, p.dtype, p.device))
        shapes = [(name, list(p.shape)) for name, p in self._params]
        self.client = client or pstrain.init(shapes, job_yaml=job_yaml, **init_options)
        if [name for name, _ in self.client.tensors] != [name for name, _ in shapes]:
            raise ValueError("pstrain: the job's tensors %s are not the model's parameters %s"
                             % (self.client.tensors, shapes))
        self._pushed = []      # this step's pushed gradients, alive until step() returns
        self._backwards = [0] * len(self._params)  # this step's, by parameter
        # overlap_values: the last step's, alive until its values are all in
        self._overlap = overlap_values
        self._previous = []
        self._accumulators = []  # the AccumulateGrad nodes the hooks sit on
        for index, (name, p) in enumerate(self._params):
            self.client.bind_address(index, p.data_ptr(), p.numel())
            if p.requires_grad:
                accumulator = p.expand_as(p).grad_fn.next_functions[0][0]
                accumulator.register_hook(self._push_hook(index, p))
                self._accumulators.append(accumulator)
        if overlap_values:
            index_of = {id(p): index for index, (_, p) in enumerate(self._params)}
            for module in model.modules():
                own = [index_of[id(p)] for p in module.parameters(recurse=False)
                       if id(p) in index_of]
                if own:
                    module.register_forward_pre_hook(self._await_hook(own))
        self.client.start()

    def _await_hook(self, tensors):
        def hook(*_):
            self.client.await_values(tensors)
        return hook

    def _push_hook(self, index, p):
        def hook(*_):
            if p.grad is None:
                return
            # Pushed once the step's last micro-batch has added to it (a
            # second backward without accumulation pushes again: an error).
            self._backwards[index] += 1
            if self._backwards[index] >= self.client.accumulate_steps:
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
        try:
            # A parameter that had a gradient in fewer than all of the
            # step's micro-batches: its sum goes now.
            for index, (_, p) in enumerate(self._params):
                if 0 < self._backwards[index] < self.client.accumulate_steps:
                    self._push(index, p)
            return self.client.end_step(value, samples or self.client.batch_size,
                                        await_values=not self._overlap)
        finally:
            self._previous, self._pushed = (self._pushed if self._overlap else []), []
            self._backwards = [0] * len(self._params)

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


class ShardSampler:
    """This worker's batch of sample indices of each step, as pstrain's own
    workers shard data: every epoch a permutation of the training set by the
    job's seed, the global batch of a step cut by worker index. A
    torch.utils.data.DataLoader takes it as batch_sampler (num_workers=0:
    the step is read as each batch is taken)."""

    def __init__(self, client, dataset_size):
        self.client = client
        self.dataset_size = dataset_size

    def __iter__(self):
        while self.client.step < self.client.total_steps:
            yield self.client.batch_indices(self.client.step, self.dataset_size).tolist()

    def __len__(self):
        return self.client.total_steps - self.client.step
