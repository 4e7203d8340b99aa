"""pstrain.torch's embedding modules whose rows are the job's tables, on
the servers (the module docstring of pstrain.torch describes them)."""
import torch


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
