"""pstrain.torch's samplers: this worker's batch of each step, as indices
(ShardSampler) or read by a DataLoader's worker processes (ShardedLoader)."""
import torch


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
