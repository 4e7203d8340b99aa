"""pstrain.torch's embedding modules whose rows are the job's tables, on
the servers (the module docstring of pstrain.torch describes them)."""
import torch

from pstrain import SetupError


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
    be read by one module of the model. pstrain.torch.load(export, model)
    binds it to an export's rows instead, to evaluate without a job.

    initial: {table: float32 tensor [rows, dim]}: the table is one of a
    fixed vocabulary, keys [0, rows), starting from these rows (key k's is
    row k, as an nn.EmbeddingBag's weight); the module brings the table to
    the job (its initial_rows; the job file need not declare it, and if it
    does, its optimizer and settings hold). Worker 0's rows are the job's;
    the tensor must stay alive and unchanged while the job runs."""

    def __init__(self, tables, mode="mean", initial=None):
        super().__init__()
        if mode not in ("sum", "mean"):
            raise SetupError("pstrain: mode must be 'sum' or 'mean', not %r" % (mode,))
        self.tables, self.mode = list(tables), mode
        if len(set(self.tables)) != len(self.tables):
            raise SetupError("pstrain: a table twice in %s" % self.tables)
        self._initial = dict(initial or {})
        for table, rows in self._initial.items():
            if table not in self.tables or not torch.is_tensor(rows) or rows.dim() != 2 or \
                    rows.dtype != torch.float32 or rows.device.type != "cpu" or \
                    not rows.is_contiguous() or rows.shape[0] == 0:
                raise SetupError("pstrain: the initial rows of %s must be a non-empty contiguous "
                                 "float32 CPU tensor [rows, dim] of one of the module's tables"
                                 % table)
        self._source, self._indices, self._dims = None, None, None

    def declared_tables(self):
        """(name, dim, initial rows) of the tables the module brings to the
        job: those it has initial rows of."""
        return [(t, int(rows.shape[1]), int(rows.shape[0])) for t, rows in self._initial.items()]

    def extra_repr(self):
        return "tables=%s, mode=%s" % (self.tables, self.mode)

    def _bind(self, client):
        self._check_tables(dict(client.tables), "the job")
        self._source = _ServerRows(client)
        self._indices = [client.table_index(t) for t in self.tables]
        for table, rows in self._initial.items():
            client.bind_table_rows(client.table_index(table), rows.data_ptr(), rows.shape[0])

    def _bind_export(self, tables):
        """`tables`: {name: (dim, keys, rows)} of an export."""
        self._check_tables({name: dim for name, (dim, _, _) in tables.items()}, "the export")
        self._source = _ExportedRows([tables[t] for t in self.tables])
        self._indices = list(range(len(self.tables)))

    def _check_tables(self, dims, where):
        missing = [t for t in self.tables if t not in dims]
        if missing:
            raise SetupError("pstrain: %s has no table %s (its tables: %s)" %
                             (where, ", ".join(missing), ", ".join(dims) or "none"))
        self._dims = [dims[t] for t in self.tables]

    def forward(self, bags):
        if self._source is None:
            raise RuntimeError("pstrain: %s is not bound to a job: make the "
                               "DistributedOptimizer of the model first" % self)
        if torch.is_tensor(bags):
            if bags.dim() != 2 or bags.shape[1] != len(self.tables):
                raise SetupError("pstrain: keys must be [batch, %d], got %s" %
                                 (len(self.tables), list(bags.shape)))
            if len(set(self._dims)) != 1:
                raise SetupError("pstrain: keys [batch, tables] need tables of one dim (these "
                                 "have %s): give a list of (input, offsets)" % self._dims)
            return self._lookup_keys(bags.to(torch.int64))
        if len(bags) != len(self.tables):
            raise SetupError("pstrain: %d bags for %d tables" % (len(bags), len(self.tables)))
        looked_up = []
        pulls = []
        for (index, dim), (keys, offsets) in zip(zip(self._indices, self._dims), bags):
            keys = keys.to(torch.int64)
            if offsets is None:
                if keys.dim() == 1:  # one key a bag
                    keys = keys.unsqueeze(1)
                if keys.dim() != 2:
                    raise SetupError("pstrain: input without offsets must be 2-D")
                offsets = torch.arange(keys.shape[0]) * keys.shape[1]
            distinct, inverse = torch.unique(keys.reshape(-1), return_inverse=True)
            rows = torch.empty(distinct.numel(), dim, dtype=torch.float32)
            pulls.append((index, distinct, rows))
            looked_up.append((index, distinct, inverse, offsets, rows))
        self._source.fetch(pulls)
        out = []
        for index, distinct, inverse, offsets, rows in looked_up:
            if self._source.trains and torch.is_grad_enabled():
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
        self._source.fetch([(index, distinct[start:start + size], rows[start:start + size])
                            for index, start, size in spans])
        if self._source.trains and torch.is_grad_enabled():
            rows.requires_grad_()
            rows.register_hook(self._push_hook(spans, distinct, inverse, dim))
        return torch.nn.functional.embedding(inverse.t(), rows)

    def _push_hook(self, spans, distinct, inverse, dim):
        """Backward's push of the rows' gradients: the rows of `distinct`
        (whose occurrences `inverse` gives), a span (table index, first,
        count) of them a table."""
        client = self._source.client

        def hook(grad):
            grad = (grad * client.gradient_scale).contiguous()
            counts = torch.bincount(inverse.reshape(-1),
                                    minlength=distinct.numel()).to(torch.int32)
            for index, start, size in spans:
                client.push_rows_address(
                    index, distinct.data_ptr() + 8 * start, counts.data_ptr() + 4 * start,
                    grad.data_ptr() + 4 * dim * start, size)
        return hook


class _ServerRows:
    """The job's rows, on the servers: pulled for the forward pass, their
    gradients pushed in backward."""
    trains = True

    def __init__(self, client):
        self.client = client

    def fetch(self, pulls):
        """pulls: (table index, distinct int64 keys, float32 rows to fill),
        each tensor contiguous; one exchange for all."""
        self.client.pull_rows([(index, keys.data_ptr(), keys.numel(), rows.data_ptr())
                               for index, keys, rows in pulls])


class _ExportedRows:
    """An export's rows, looked up in this process (a key without a row
    reads as zeros, as on the servers); nothing is trained."""
    trains = False

    def __init__(self, tables):
        self.tables = []
        for table in tables:  # (dim, uint64 keys ascending, rows), or None
            _, keys, rows = table
            keys = torch.from_numpy(keys.view("int64"))
            order = keys.argsort()  # keys of 2^63 and up sort first as int64
            self.tables.append((keys[order].contiguous(), torch.from_numpy(rows)[order]))

    def fetch(self, pulls):
        for index, keys, out in pulls:
            known, rows = self.tables[index]
            if known.numel() == 0:
                out.zero_()
                continue
            at = torch.searchsorted(known, keys).clamp_(max=known.numel() - 1)
            found = (known[at] == keys).unsqueeze(1)
            out.copy_(torch.where(found, rows[at], torch.zeros((), dtype=rows.dtype)))


class EmbeddingBag(EmbeddingBags):
    """nn.EmbeddingBag whose rows are table `table` of the job, on the
    servers (EmbeddingBags of one table): forward(input, offsets=None) as
    nn.EmbeddingBag's, giving [batch, dim]."""

    def __init__(self, table, mode="mean", initial=None):
        super().__init__([table], mode, None if initial is None else {table: initial})

    def forward(self, input, offsets=None):
        return super().forward([(input, offsets)])[0]


class Embedding(EmbeddingBags):
    """nn.Embedding whose rows are table `table` of the job, on the
    servers: forward(input) with int64 keys of any shape gives input.shape
    + [dim], a key's row at each place."""

    def __init__(self, table, initial=None):
        super().__init__([table], "sum", None if initial is None else {table: initial})

    def extra_repr(self):
        return "table=%s" % self.tables[0]

    def forward(self, input):
        # A bag of one key at each place: its row.
        rows = super().forward([(input.reshape(-1), None)])[0]
        return rows.reshape(list(input.shape) + [rows.shape[1]])


def sparse_embeddings(model):
    """The model's nn.Embedding and nn.EmbeddingBag modules with
    sparse=True, each turned into the job's table of its name (keys its
    row indices, its weight the initial rows): (name, rows module) each.
    A module with an option the servers' rows cannot give is refused with
    a line naming it and what to do instead."""
    found = []
    for name, module in model.named_modules():
        if isinstance(module, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and module.sparse:
            found.append((name, _TableOfModule(name, module)))
    return found


class _TableOfModule:
    """An nn.Embedding or nn.EmbeddingBag (sparse=True) trained as table
    `name` of the job: its forward reads the rows through a pst module
    (whose initial rows are its weight, left as they are), with torch's
    checks of the keys."""

    def __init__(self, name, module):
        kind = "nn." + type(module).__name__
        label = "%s (%s, sparse=True)" % (name or "the model", kind)

        def refuse(option, instead):
            raise SetupError("pstrain: %s trains as a table on the servers, which have no %s: %s"
                             % (label, option, instead))
        dense = "or keep the module dense (sparse=False)"
        if not name:
            refuse("module of the model's own to name the table", "put it in a model")
        if len(name) > 64:
            refuse("table name of %d characters (64 at most)" % len(name),
                   "name the module shorter, " + dense)
        if module.max_norm is not None:
            refuse("max_norm (rows renormalised by the forward pass)", "drop it, " + dense)
        if module.scale_grad_by_freq:
            refuse("scale_grad_by_freq", "drop it, " + dense)
        if module.padding_idx is not None:
            refuse("padding_idx", "drop it (mask the padded places instead), " + dense)
        if isinstance(module, torch.nn.EmbeddingBag) and module.mode not in ("sum", "mean"):
            refuse('mode "%s"' % module.mode, 'use "sum" or "mean", ' + dense)
        weight = module.weight
        if weight.dtype != torch.float32 or weight.device.type != "cpu" or \
                not weight.is_contiguous():
            refuse("weight other than a contiguous float32 CPU tensor", dense)
        self.name, self.module, self.label = name, module, label
        if isinstance(module, torch.nn.EmbeddingBag):
            self.rows = EmbeddingBag(name, mode=module.mode, initial=weight.detach())
            module.forward = self._bags
        else:
            self.rows = Embedding(name, initial=weight.detach())
            module.forward = self._lookups

    def _check(self, keys):
        if keys.numel() and (int(keys.min()) < 0 or int(keys.max()) >= self.module.num_embeddings):
            raise IndexError("pstrain: %s: an index outside [0, %d)" %
                             (self.label, self.module.num_embeddings))

    def _bags(self, input, offsets=None, per_sample_weights=None):
        if per_sample_weights is not None:
            raise SetupError("pstrain: %s: per_sample_weights are not offered for rows on the "
                             "servers" % self.label)
        if offsets is not None and self.module.include_last_offset:
            offsets = offsets[:-1]
        self._check(input)
        return self.rows(input, offsets)

    def _lookups(self, input):
        self._check(input)
        return self.rows(input)


def _bind_tables(modules, client):
    """Binds the model's embedding modules to the job's client."""
    if not modules:
        return
    if client.accumulate_steps > 1:
        raise SetupError("pstrain: embedding tables are not offered with accumulate_steps > 1")
    seen = set()
    for module in modules:
        again = seen.intersection(module.tables)
        if again:
            raise SetupError("pstrain: table %s is read by two modules of the model" %
                             ", ".join(sorted(again)))
        seen.update(module.tables)
        module._bind(client)


def _load_table_weights(model, tables):
    """Puts each exported table named after an nn.Embedding or
    nn.EmbeddingBag of the model (one trained as a table, sparse=True)
    into its weight: row k is the table's key k (rows never admitted stay
    zeros). Returns the state-dict names of the weights it filled."""
    filled = []
    for name, module in model.named_modules():
        if not isinstance(module, (torch.nn.Embedding, torch.nn.EmbeddingBag)) or \
                name not in tables:
            continue
        dim, keys, rows = tables[name]
        weight = module.weight
        if dim != weight.shape[1]:
            raise SetupError("pstrain: table %s has rows of %d, %s of %d" %
                             (name, dim, name, weight.shape[1]))
        keys = torch.from_numpy(keys.view("int64"))
        inside = (keys >= 0) & (keys < weight.shape[0])
        with torch.no_grad():
            weight.zero_()
            weight[keys[inside]] = torch.from_numpy(rows)[inside]
        filled.append(name + ".weight")
    return filled
