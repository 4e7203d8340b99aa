"""pstrain.torch's samplers: this worker's batch of each step, as indices
(ShardSampler) or read by a DataLoader's worker processes (ShardedLoader)."""
import ast
import multiprocessing
import sys

import torch

from pstrain import SetupError


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
    is not safe, so "fork" is refused. Both import the script again in the
    new processes, so the script must keep its work under
    `if __name__ == "__main__":` (one without is refused at once). The
    worker processes (and the forkserver) end with the training process,
    however it ends. The dataset (and collate_fn) must be picklable and
    draw no randomness of their own; other keyword arguments go to the
    DataLoader (pin_memory, prefetch_factor, worker_init_fn, ...)."""

    def __init__(self, dataset, client, num_workers=0, collate_fn=None, **loader_options):
        context = loader_options.pop("multiprocessing_context",
                                     "forkserver" if num_workers > 0 else None)
        if isinstance(context, str):
            context = multiprocessing.get_context(context)
        method = context.get_start_method() if context is not None else None
        if method == "fork":
            raise SetupError("pstrain: the DataLoader's workers cannot be forked from a process "
                             "whose client runs gRPC threads: use forkserver or spawn")
        for name in ("batch_size", "shuffle", "sampler", "batch_sampler", "drop_last"):
            if name in loader_options:
                raise SetupError("pstrain: ShardedLoader chooses the batches (%s)" % name)
        if num_workers > 0:
            if not _main_is_guarded():
                raise SetupError(
                    "pstrain: ShardedLoader's worker processes (%s) import the script %s again, "
                    "which would run its training again: put it under "
                    "`if __name__ == \"__main__\":` (or num_workers=0)" %
                    (method, sys.modules["__main__"].__file__))
            if method == "forkserver":
                _forkserver_dies_with_its_parent()
            loader_options["worker_init_fn"] = _WorkerStart(loader_options.get("worker_init_fn"))
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
            taken = None  # (step, generation) of the batch last taken
            for step, batch in loader:
                # The same step in the same generation: step() was not
                # called (a recovery to the step just taken is a new one).
                if taken == (self.client.step, self.client.generation):
                    raise RuntimeError("pstrain: ShardedLoader gives one batch a step: call "
                                       "step() before taking the next")
                if step != self.client.step:  # prefetched for a step the job went back from
                    went_back = True
                    break
                taken = (step, self.client.generation)
                yield batch
            del loader  # its worker processes end
            if not went_back and taken == (self.client.step, self.client.generation):
                return  # no step() after the last batch: the loop is done with them

    def __len__(self):
        return self.client.total_steps - self.client.step


def _main_is_guarded():
    """Whether the running script keeps its work under `if __name__ ==
    "__main__":` at its top level; True where there is no script file to
    read (python -c, an interactive session)."""
    path = getattr(sys.modules.get("__main__"), "__file__", None)
    if not path or not path.endswith(".py"):
        return True
    try:
        with open(path) as f:
            tree = ast.parse(f.read())
    except (OSError, SyntaxError, ValueError):
        return True

    def is_main_test(test):
        if not isinstance(test, ast.Compare) or len(test.ops) != 1 or \
                not isinstance(test.ops[0], ast.Eq):
            return False
        sides = [test.left, test.comparators[0]]
        return any(isinstance(n, ast.Name) and n.id == "__name__" for n in sides) and \
            any(isinstance(n, ast.Constant) and n.value == "__main__" for n in sides)
    return any(isinstance(node, ast.If) and is_main_test(node.test) for node in tree.body)


def _forkserver_dies_with_its_parent():
    """The forkserver (started once, by the first loader) imports
    pstrain._loader_process, which ends it with the training process."""
    from multiprocessing import forkserver
    server = forkserver._forkserver
    modules = list(getattr(server, "_preload_modules", ["__main__"]))
    if "pstrain._loader_process" not in modules:
        server.set_forkserver_preload(modules + ["pstrain._loader_process"])


class _WorkerStart:
    """The DataLoader's worker_init_fn: the worker process ends with the
    process that started it (the forkserver, or the training process),
    then the user's function runs."""

    def __init__(self, user_init):
        self.user_init = user_init

    def __call__(self, worker_id):
        from pstrain._loader_process import die_with_parent
        die_with_parent()
        if self.user_init is not None:
            self.user_init(worker_id)
