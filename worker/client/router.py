"""Routing of the client's calls: ids and dense chunks split by owning shard into one request
per shard, and the shards' answers placed back into one result."""

from __future__ import annotations

import contextlib
import itertools
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import torch

from tether.protos import framing as dp
from tether.protos import tether_pb2 as pb
from tether.protos.codec import decode_tensor, encode_ids, encode_tensor, int64_ids, wire_dtype
from tether.protos.errors import InvalidArgument
from tether.protos.partition import dense_shard, split_ids
from tether.protos.specs import OptimizerConfig, TableConfig
from tether.worker.client.config import ClientConfig
from tether.worker.client.device_pull import DevicePull, DeviceRows
from tether.worker.client.results import PullResult, Splits

__all__ = ["JOIN_ELEMENTS", "DenseLayout", "PackedParts", "PackedPush", "PullAnswer", "PullPlan", "Router", "ShardedPart"]

# A CPU pull of at least this many floats (1 MiB) is received into one buffer per row width,
# which the model then takes as it is; smaller ones into a tensor per table, joined by a copy.
JOIN_ELEMENTS = 1 << 18


@dataclass
class PullPlan:
    """Where a pull's answers go: result tensors allocated up front, filled shard by shard."""

    rows: dict[str, torch.Tensor]
    flats: dict[str, torch.Tensor]
    shapes: dict[str, tuple[int, ...]]
    # (shard, table) -> positions of that shard's ids in the table's request (None: all, in order).
    positions: dict[tuple[int, str], np.ndarray | None] = field(default_factory=dict)
    response_bytes: dict[int, int] = field(default_factory=dict)
    table_versions: dict[tuple[int, str], int] = field(default_factory=dict)
    dense_versions: dict[tuple[str, int], int] = field(default_factory=dict)
    # The rows that arrive in a registered shared region go to the device from there (``Router.rows_to``).
    device: DevicePull | None = None

    def result(self) -> PullResult:
        dense = {name: flat.view(self.shapes[name]) for name, flat in self.flats.items()}
        rows = self.rows if self.device is None else {**self.rows, **self.device.finish(self.rows, self.positions)}
        return PullResult(rows, dense, self.table_versions, self.dense_versions)


@dataclass(frozen=True)
class DenseLayout:
    """How one dense parameter is cut into chunks."""

    shape: tuple[int, ...]
    numel: int
    chunks: tuple[tuple[int, int, int], ...]  # (index, start, stop) into the flat tensor
    owners: tuple[int, ...]  # the shard that owns each chunk (``dense_shard``)


class PackedPush(NamedTuple):
    """A push's rows of several tables laid out as each shard's payload already (the row cache's,
    ``cache_split.pack_push``), table g's part a ``ShardedPart`` pointing here: shard s's bytes are
    ``payload[starts[s]:starts[s + 1]]``, holding table by table (those with rows for shard s)
    the shard's rows of sums (``voff[g, s]`` floats into the run) and, where ``combined[g]``,
    their statistics (``soff[g, s]``), each block where ``PayloadWriter.add`` would place it; the
    ids, table g's from ``at[g]``, each shard's group one after another (``ShardedPart.bounds``).
    ``tables``: the tables that have rows, in that order, the push's parts' order. A push whose
    parts are exactly these (``Router.push_requests``) sends each shard's run as one payload part."""

    payload: np.ndarray
    starts: np.ndarray
    voff: np.ndarray
    soff: np.ndarray
    gids: np.ndarray
    at: np.ndarray
    combined: np.ndarray
    tables: tuple[str, ...]


class ShardedPart(tuple[torch.Tensor, ...]):
    """A table's ``(ids, grads[, stats])`` for ``Router.push_requests`` whose rows' shards are
    known already (the row cache's, ``cache_split.pack_push``): ``order`` holds the rows' positions
    grouped by shard, shard s's at ``order[bounds[s]:bounds[s + 1]]`` in row order, which is
    what ``split_ids`` finds by hashing the ids, and table ``g`` of ``packed`` holds the same
    rows in that order (each shard's rows one after another). The push takes that split as it
    is: the same requests and payloads, with no id hashed and no row gathered. One whose split
    does not fit the push is split by hashing."""

    order: np.ndarray
    bounds: np.ndarray
    packed: PackedPush
    g: int

    def __new__(cls, items: tuple[torch.Tensor, ...], order: np.ndarray, bounds: np.ndarray, packed: PackedPush, g: int) -> ShardedPart:
        part = super().__new__(cls, items)
        part.order, part.bounds, part.packed, part.g = order, bounds, packed, g
        return part

    def fits(self, num_shards: int, rows: int) -> bool:
        """Whether the split is one of ``rows`` rows for ``num_shards`` shards."""
        return (len(self.bounds) == num_shards + 1 and bool(self.packed.combined[self.g]) == (len(self) > 2)
                and len(self.order) == rows == self.bounds[-1])

    def split(self) -> list[tuple[np.ndarray, np.ndarray, list[torch.Tensor]]]:
        """Per shard: ``split_ids``'s (positions, ids), and the shard's rows of the other arrays."""
        p, g = self.packed, self.g
        b, at = self.bounds.tolist(), int(p.at[g])
        d, k = self[1].shape[1], self[2].shape[1] if len(self) > 2 else 0
        out = []
        for s in range(len(b) - 1):
            lo, hi = b[s], b[s + 1]
            n = hi - lo
            rest = []
            if n:
                v = int(p.starts[s] + p.voff[g, s])
                rest.append(torch.from_numpy(p.payload[v: v + n * d].reshape(n, d)))
                if k:
                    c = int(p.starts[s] + p.soff[g, s])
                    rest.append(torch.from_numpy(p.payload[c: c + n * k].reshape(n, k)))
            out.append((self.order[lo:hi], p.gids[at + lo: at + hi], rest))
        return out


class PackedParts(Mapping[str, tuple[torch.Tensor, ...]]):
    """A push's sparse part that is one ``PackedPush`` and nothing else (the row cache's usual
    push, ``RowCache._taken``): per table of ``packed.tables`` its ``ShardedPart`` ``(ids, sums[,
    stats])``, views of the buffers ``take_all`` wrote (``ids``; ``sums``, table g's rows of
    ``dims[g]`` floats; ``stats``, table g's rows of ``nstats[g]`` floats, there whether or not its
    part carries them, which it does where ``packed.combined[g]``), made the first time it is
    read. ``Router.push_requests`` and ``TrafficMeter.pushed`` read the layout (``layout``) and
    make none of them."""

    def __init__(self, packed: PackedPush, ids: np.ndarray, sums: np.ndarray, stats: np.ndarray, dims: Sequence[int], nstats: Sequence[int],
                 order: np.ndarray, bounds: np.ndarray, groups: Sequence[int]) -> None:
        self.packed, self.order, self.bounds = packed, order, bounds
        self._ids, self._sums, self._stats = ids, sums, stats
        self._groups = dict(zip(packed.tables, groups, strict=True))  # table -> its index g
        self._dims, self._nstats = dims, nstats
        self._made: dict[str, ShardedPart] = {}
        self._offsets: dict[str, tuple[int, int]] = {}  # per table: where its sums and statistics start
        self._layout: list[tuple[str, int, int, int, int]] | None = None

    def __getitem__(self, table: str) -> ShardedPart:
        got = self._made.get(table)
        if got is None:
            g = self._groups[table]  # KeyError for a table not in the push, as a dict's
            if not self._offsets:
                f = q = 0
                for t, h in self._groups.items():  # every table's statistics, combined or not, have their place
                    n = int(self.packed.at[h + 1] - self.packed.at[h])
                    self._offsets[t] = (f, q)
                    f, q = f + n * self._dims[h], q + n * self._nstats[h]
            a, b = int(self.packed.at[g]), int(self.packed.at[g + 1])
            (f, q), n, d, k = self._offsets[table], b - a, self._dims[g], self._nstats[g]
            part: tuple[torch.Tensor, ...] = (torch.from_numpy(self._ids[a:b]), torch.from_numpy(self._sums[f: f + n * d].reshape(n, d)))
            if self.packed.combined[g]:
                part = (*part, torch.from_numpy(self._stats[q: q + n * k].reshape(n, k)))
            got = self._made[table] = ShardedPart(part, self.order[a:b], self.bounds[g], self.packed, g)
        return got

    def __iter__(self) -> Iterator[str]:
        return iter(self.packed.tables)

    def __len__(self) -> int:
        return len(self.packed.tables)

    def layout(self) -> list[tuple[str, int, int, int, int]]:
        """Per table in push order: (name, index g, rows, row width, statistics columns or 0)."""
        if self._layout is None:
            p, at = self.packed, self.packed.at.tolist()
            self._layout = [(t, g, at[g + 1] - at[g], self._dims[g], self._nstats[g] if p.combined[g] else 0)
                            for t, g in self._groups.items()]
        return self._layout


class Router:
    """What a client knows of the job's layout (declared tables and dense parameters, push
    sequence numbers) and the requests it builds from it."""

    def __init__(self, config: ClientConfig, incarnation: int) -> None:
        self.config = config
        self.num_shards = len(config.addresses)
        self.incarnation = incarnation
        self._seq = [itertools.count(1) for _ in range(self.num_shards)]
        self._seq_lock = threading.Lock()
        # Declared tables' dims and dense parameters' layouts.
        self.dims: dict[str, int] = {}
        self.dense: dict[str, DenseLayout] = {}
        self._splits: dict[str, list[tuple[np.ndarray, list[tuple[np.ndarray, np.ndarray]]]]] = {}
        self._split_lock = threading.Lock()
        # Pulls answer into page-locked (pinned) memory, the rows of same-width tables one after
        # another in one buffer (a CUDA worker's ``PSModel`` turns this on): its copy to the GPU
        # is then one asynchronous copy of what was received, with no host copy before it.
        self.pin_memory = False
        # Per thread: where the pulls it starts put rows that arrive in a shared region (``rows_to``).
        self._scope = threading.local()

    @contextlib.contextmanager
    def rows_to(self, sink: DeviceRows | None) -> Iterator[None]:
        """Pulls (and push_pulls) this thread starts inside the block put the rows that arrive in a
        shared region registered as pinned memory on ``sink``'s device, copied from the region
        itself (``DevicePull``); their ``PullResult`` then holds those widths' rows on the device.
        None: on the host, as outside the block."""
        before = getattr(self._scope, "sink", None)
        self._scope.sink = sink
        try:
            yield
        finally:
            self._scope.sink = before

    # -- declare -----------------------------------------------------------------------------

    def declare_requests(
        self, tables: Sequence[TableConfig], dense: Mapping[str, torch.Tensor], dense_optimizer: OptimizerConfig | None
    ) -> tuple[dict[int, pb.DeclareRequest], dict[str, DenseLayout]]:
        """Every shard's ``Declare`` request, and the layouts of the dense parameters."""
        opt = (dense_optimizer or OptimizerConfig()).to_proto()
        requests = {s: pb.DeclareRequest() for s in range(self.num_shards)}
        for t in tables:
            spec = t.to_proto()
            for r in requests.values():
                r.tables.append(spec)
        layouts = {}
        for name, tensor in dense.items():
            flat = tensor.detach().reshape(-1).to("cpu", torch.float32)
            step = self.config.chunk_elems
            chunks = tuple((i, a, min(a + step, flat.numel())) for i, a in enumerate(range(0, flat.numel(), step)))
            owners = tuple(dense_shard(name, index, self.num_shards) for index, _, _ in chunks)
            layouts[name] = DenseLayout(tuple(tensor.shape), flat.numel(), chunks, owners)
            for (index, a, b), s in zip(chunks, owners, strict=False):
                d = requests[s].dense.add(name=name, index=index, optimizer=opt)
                encode_tensor(flat[a:b], d.init)
        return requests, layouts

    def declared(self, tables: Sequence[TableConfig], layouts: Mapping[str, DenseLayout]) -> None:
        """Remember what the shards accepted."""
        for t in tables:
            self.dims[t.name] = t.dim
        self.dense.update(layouts)

    # -- pull --------------------------------------------------------------------------------

    def _check_ids(self, table: str, ids: torch.Tensor) -> np.ndarray:
        """The ids of a 1-D integer tensor as int64 (any value; narrower integers widened)."""
        if table not in self.dims:
            raise InvalidArgument(f"table {table!r} was not declared by this client")
        if ids.dim() != 1:
            raise InvalidArgument(f"table {table!r}: ids must be a 1-D tensor, got shape {tuple(ids.shape)}")
        return int64_ids(ids.detach(), table).cpu().numpy()

    def pull_requests(self, sparse: Mapping[str, torch.Tensor], dense: Sequence[str],
                      splits: Splits | None = None) -> tuple[dict[int, pb.PullRequest], PullPlan]:
        """One ``PullRequest`` per shard that owns something asked for, and the plan of the result.

        ``splits``: per table, its ids split by shard as ``split_ids`` would (a row cache's, which
        knows them: ``Plan.splits``), taken as they are where they fit the ids (one part per
        shard, as many ids in all); a table without one is split by hashing its ids.

        Raises:
            InvalidArgument: undeclared table or tensor, or ids that are not a 1-D integer tensor.
        """
        requests: dict[int, pb.PullRequest] = {}
        layouts = {name: self.dense_layout(name) for name in dense}
        arrays = {table: self._check_ids(table, ids) for table, ids in sparse.items()}
        plan = PullPlan(
            rows=self._row_buffers(arrays),
            flats={name: torch.empty(layout.numel, pin_memory=self.pin_memory) for name, layout in layouts.items()},
            shapes={name: layout.shape for name, layout in layouts.items()},
        )
        sink = getattr(self._scope, "sink", None)
        if sink is not None:
            plan.device = DevicePull(sink, {table: (self.dims[table], arr.size) for table, arr in arrays.items()})
        itemsize = self.config.wire_dtype.itemsize

        def req(s: int) -> pb.PullRequest:
            if s not in requests:
                requests[s] = pb.PullRequest(worker_id=self.config.worker_id, wire_dtype=wire_dtype(self.config.wire_dtype))
            return requests[s]

        for table, arr in arrays.items():
            known = splits.get(table) if splits else None
            fits = known is not None and len(known) == self.num_shards and sum(len(p) for _, p in known) == arr.size
            for s, (pos, part) in enumerate(known if fits and known is not None else self._split(table, arr)):
                if part.size:
                    req(s).sparse.add(table=table, ids=encode_ids(part))
                    plan.positions[(s, table)] = None if part.size == arr.size else pos
                    plan.response_bytes[s] = plan.response_bytes.get(s, 0) + dp.align(part.size * self.dims[table] * itemsize)
        for name in dense:
            layout = layouts[name]
            for (index, a, b), s in zip(layout.chunks, layout.owners, strict=False):
                req(s).dense.add(name=name, index=index)
                plan.response_bytes[s] = plan.response_bytes.get(s, 0) + dp.align((b - a) * itemsize)
        return requests, plan

    def _row_buffers(self, arrays: Mapping[str, np.ndarray]) -> dict[str, torch.Tensor]:
        """Where each table's pulled rows go: a slice of one buffer per row width (tables in
        request order, back to back; pinned with ``pin_memory``), so that the model takes each
        width's rows as they are, with no copy that joins them (``PSModel.install``); on the CPU
        a pull under ``JOIN_ELEMENTS`` floats gets a tensor per table."""
        totals: dict[int, int] = {}
        for table, arr in arrays.items():
            totals[self.dims[table]] = totals.get(self.dims[table], 0) + arr.size
        if not self.pin_memory and sum(n * dim for dim, n in totals.items()) < JOIN_ELEMENTS:
            # Small pulls: a tensor per table and a join cost less than slicing one buffer.
            return {table: torch.empty(arr.size, self.dims[table]) for table, arr in arrays.items()}
        buffers = {dim: torch.empty(n, dim, pin_memory=self.pin_memory) for dim, n in totals.items()}
        start = dict.fromkeys(totals, 0)
        rows = {}
        for table, arr in arrays.items():
            dim = self.dims[table]
            rows[table] = buffers[dim][start[dim] : start[dim] + arr.size]
            start[dim] += arr.size
        return rows

    def _split(self, table: str, arr: np.ndarray) -> list[tuple[np.ndarray, np.ndarray]]:
        """``split_ids``, remembered for the last two id sets of each table: a step pushes the
        very ids it pulled (compared, not trusted, before reuse)."""
        with self._split_lock:
            recent = self._splits.setdefault(table, [])
            for ids, parts in recent:
                if ids.shape == arr.shape and np.array_equal(ids, arr):
                    return parts
        parts = split_ids(arr, self.num_shards)
        with self._split_lock:
            recent.insert(0, (arr.copy(), parts))
            del recent[2:]
        return parts

    def _push_table(self, table: str, entry: tuple[torch.Tensor, ...], versions: PullResult | None,
                    req: Callable[[int], pb.PushRequest], payloads: dict[int, dp.PayloadWriter]) -> None:
        """One table's ``SparseBlock`` per shard that owns some of its rows, with their payload
        (``push_requests``): split by the ids' hashes, or as a ``ShardedPart`` says."""
        ids, grads = entry[0], entry[1]
        arr = self._check_ids(table, ids)
        if tuple(grads.shape) != (arr.size, self.dims[table]):
            raise InvalidArgument(f"table {table!r}: gradient shape {tuple(grads.shape)} != ({arr.size}, {self.dims[table]})")
        grads = grads.detach().to("cpu")
        stats = entry[2].detach().to("cpu", torch.float32) if len(entry) > 2 else None
        if stats is not None and (stats.dim() != 2 or stats.shape[0] != arr.size):
            raise InvalidArgument(f"table {table!r}: combined statistics of shape {tuple(stats.shape)} for {arr.size} rows")
        # DC-ASGD, DC-ASGD-a, gap-aware: the rows as read go along (the pull's, in the order of these ids).
        read = versions.rows.get(table) if versions and self.config.sends_read_values else None
        read = read.detach().to("cpu") if read is not None and tuple(read.shape) == tuple(grads.shape) else None
        wire = self.config.wire_dtype
        split: list[tuple[np.ndarray, np.ndarray, list[torch.Tensor]]]
        if isinstance(entry, ShardedPart) and entry.fits(self.num_shards, arr.size):
            split = entry.split()  # each shard's rows one after another already: added as they are
        else:
            split = [(pos, part, []) for pos, part in self._split(table, arr)]
        for s, (pos, part, own) in enumerate(split):
            if not part.size:
                continue
            rv = versions.table_versions.get((s, table), 0) if versions else 0
            b = req(s).sparse.add(table=table, ids=encode_ids(part), read_version=rv)
            rows = None if part.size == arr.size or (own and read is None) else torch.from_numpy(pos)
            if own:
                payloads[s].add(own[0], b.values, wire)
            else:
                payloads[s].add(grads, b.values, wire, rows=rows)
            if read is not None:
                payloads[s].add(read, b.read_values, wire, rows=rows)
            if stats is not None:  # float32 whatever the wire type: counts and squares, not values
                payloads[s].add(own[1] if own else stats, b.combined, torch.float32, rows=None if own else rows)

    def _packed(self, sparse: Mapping[str, tuple[torch.Tensor, ...]],
                versions: PullResult | None) -> list[tuple[str, int, int, int, int]] | None:
        """Where ``sparse`` is one ``PackedPush`` (a ``PackedParts``, or every part a table of one,
        covering its tables in its order) that fits this push (float32 on the wire, no values
        read going along): per table (name, index g, rows, row width, statistics columns), the
        gradients' shapes checked against the declared tables. Else None.

        Raises:
            InvalidArgument: undeclared table, or a gradient of the wrong shape.
        """
        if self.config.wire_dtype != torch.float32 or (versions is not None and self.config.sends_read_values
                                                       and any(t in versions.rows for t in sparse)):
            return None
        if isinstance(sparse, PackedParts):
            if sparse.bounds.shape[1] != self.num_shards + 1:
                return None
            layout = sparse.layout()
            shapes: list[tuple[int, ...]] = [(n, d) for _, _, n, d, _ in layout]
        else:
            first = next(iter(sparse.values()), None)
            packed = first.packed if isinstance(first, ShardedPart) else None
            if packed is None or tuple(sparse) != packed.tables:
                return None
            layout, shapes = [], []
            for table, entry in sparse.items():
                if not isinstance(entry, ShardedPart) or entry.packed is not packed or not entry.fits(self.num_shards, len(entry[0])):
                    return None
                shape = tuple(entry[1].shape)
                layout.append((table, entry.g, len(entry[0]), shape[-1] if shape else 0, entry[2].shape[1] if len(entry) > 2 else 0))
                shapes.append(shape)
        for (table, _, n, _, _), shape in zip(layout, shapes, strict=True):
            if table not in self.dims:
                raise InvalidArgument(f"table {table!r} was not declared by this client")
            if shape != (n, self.dims[table]):
                raise InvalidArgument(f"table {table!r}: gradient shape {shape} != ({n}, {self.dims[table]})")
        return layout

    def _push_packed(self, packed: PackedPush, layout: list[tuple[str, int, int, int, int]], bounds: Callable[[int], np.ndarray],
                     versions: PullResult | None, req: Callable[[int], pb.PushRequest], payloads: dict[int, dp.PayloadWriter]) -> None:
        """``_push_table`` for every table of a ``PackedPush`` at once (``layout``: ``_packed``'s;
        ``bounds(g)``: table g's rows per shard): each shard's run of the payload added as one
        part, each table's blocks pointing into it (the same requests and payload bytes as the
        tables pushed one by one)."""
        f32 = wire_dtype(torch.float32)
        starts = packed.starts.tolist()
        cuts = [(table, g, d, k, bounds(g).tolist()) for table, g, _, d, k in layout]
        for s in range(self.num_shards):
            if starts[s + 1] == starts[s]:
                continue
            r = req(s)
            base = payloads[s].add_run(packed.payload[starts[s]: starts[s + 1]])
            for table, g, d, k, b in cuts:
                lo, hi = b[s], b[s + 1]
                if hi == lo:
                    continue
                a = int(packed.at[g])
                rv = versions.table_versions.get((s, table), 0) if versions else 0
                block = r.sparse.add(table=table, ids=encode_ids(packed.gids[a + lo: a + hi]), read_version=rv)
                _describe(block.values, f32, hi - lo, d, base + 4 * int(packed.voff[g, s]))
                if k:
                    _describe(block.combined, f32, hi - lo, k, base + 4 * int(packed.soff[g, s]))

    def dense_layout(self, name: str) -> DenseLayout:
        """The layout of a declared dense parameter.

        Raises:
            InvalidArgument: ``name`` was not declared by this client.
        """
        try:
            return self.dense[name]
        except KeyError:
            raise InvalidArgument(f"dense parameter {name!r} was not declared by this client") from None

    def place_pull(
        self, plan: PullPlan, shard: int, response: pb.PullResponse, payload: memoryview | None, placed: frozenset = frozenset()
    ) -> None:
        """Copy one shard's pulled rows and chunks into the result (while ``payload`` is valid),
        but for the blocks in ``placed``, received there already (``PullAnswer.direct``), and
        the rows a ``DevicePull`` puts on the device straight from a shared region."""
        device = plan.device
        on_device = device.place(shard, response, payload, plan.positions) if device is not None and payload is not None else frozenset()
        for block in response.sparse:
            pos = plan.positions[(shard, block.table)]
            if block.table in on_device:
                plan.table_versions[(shard, block.table)] = block.read_version
                continue
            if device is not None:
                device.placed_on_host(shard, block.table)
            if ("sparse", block.table) in placed:
                pass
            elif pos is None:
                plan.rows[block.table].copy_(decode_tensor(block.values, torch.float32, payload))
            else:
                # NumPy's row scatter is 2-3x torch's index_copy_ here (a memcpy per row).
                plan.rows[block.table].numpy()[pos] = decode_tensor(block.values, torch.float32, payload).numpy()
            plan.table_versions[(shard, block.table)] = block.read_version
        for b in response.dense:
            _, a, stop = self.dense[b.name].chunks[b.index]
            if ("dense", b.name, b.index) not in placed:
                plan.flats[b.name][a:stop] = decode_tensor(b.value, torch.float32, payload)
            plan.dense_versions[(b.name, b.index)] = b.read_version

    # -- push --------------------------------------------------------------------------------

    def next_seq(self, shard: int) -> int:
        """The next push sequence number for ``shard``."""
        with self._seq_lock:
            return next(self._seq[shard])

    def push_requests(
        self,
        sparse: Mapping[str, tuple[torch.Tensor, ...]],
        dense: Mapping[str, torch.Tensor],
        clock: int,
        versions: PullResult | None,
    ) -> tuple[dict[int, pb.PushRequest], dict[int, dp.PayloadWriter]]:
        """One ``PushRequest`` (with its payload) per shard that owns a gradient; with a
        ``clock``, every shard gets one, empty or not. A table's ``(ids, grads)`` may carry a
        combined push's statistics third (rows x columns, ``SparseBlock.combined``, float32), and
        may be a ``ShardedPart`` (its split known: not hashed again).

        Raises:
            InvalidArgument: undeclared table or tensor, or a gradient of the wrong shape.
        """
        requests: dict[int, pb.PushRequest] = {}
        payloads: dict[int, dp.PayloadWriter] = {}
        wire = self.config.wire_dtype

        def req(s: int) -> pb.PushRequest:
            if s not in requests:
                requests[s] = pb.PushRequest(worker_id=self.config.worker_id, incarnation=self.incarnation, clock=clock)
                payloads[s] = dp.PayloadWriter()
            return requests[s]

        parts = self._packed(sparse, versions)
        if parts is not None:
            if isinstance(sparse, PackedParts):
                self._push_packed(sparse.packed, parts, sparse.bounds.__getitem__, versions, req, payloads)
            else:
                entries = {entry.g: entry for entry in sparse.values() if isinstance(entry, ShardedPart)}
                self._push_packed(entries[parts[0][1]].packed, parts, lambda g: entries[g].bounds, versions, req, payloads)
        else:
            for table, entry in sparse.items():
                self._push_table(table, entry, versions, req, payloads)
        for name, grad in dense.items():
            layout = self.dense_layout(name)
            if tuple(grad.shape) != layout.shape:
                raise InvalidArgument(f"dense {name!r}: gradient shape {tuple(grad.shape)} != {layout.shape}")
            flat = grad.detach().reshape(-1).to("cpu")
            seen = versions.dense.get(name) if versions and self.config.sends_read_values else None
            seen = seen.detach().reshape(-1).to("cpu") if seen is not None and seen.numel() == flat.numel() else None
            for (index, a, b), s in zip(layout.chunks, layout.owners, strict=False):
                rv = versions.dense_versions.get((name, index), 0) if versions else 0
                d = req(s).dense.add(name=name, index=index, read_version=rv)
                payloads[s].add(flat[a:b], d.value, wire)
                if seen is not None:
                    payloads[s].add(seen[a:b], d.read_value, wire)
        if clock:
            # Every shard tracks every worker's clock, so each gets the push, empty or not.
            for s in range(self.num_shards):
                req(s)
        for s, r in requests.items():
            r.seq = self.next_seq(s)
            r.staleness_aware = self.config.staleness_aware
            r.delay_compensation = self.config.delay_compensation
            r.dc_adaptive = self.config.dc_adaptive
            r.gap_aware = self.config.gap_aware
            if self.config.dc_adaptive or self.config.gap_aware:
                # Only where a remedy keeps running means: 0 (unset) costs no byte on the wire,
                # and the shard reads it as its default.
                r.remedy_decay = self.config.remedy_decay
        return requests, payloads


def _describe(msg: pb.Tensor, dtype: int, rows: int, width: int, offset: int) -> None:
    """Point ``msg`` at ``rows`` x ``width`` float32s at ``offset`` of the payload (``PayloadWriter.add``'s fields)."""
    msg.dtype = dtype
    msg.shape.extend((rows, width))
    if rows * width:
        msg.payload_offset = offset
        msg.payload_bytes = 4 * rows * width


class PullAnswer:
    """A pull's answer: each shard's values copied into the plan's result tensors; over a TCP data
    connection, whole fp32 blocks (a dense chunk, a table's rows in request order) are received
    straight into them instead (``direct``), which saves a copy of every byte pulled."""

    def __init__(self, router: Router, plan: PullPlan) -> None:
        self._router = router
        self._plan = plan
        # shard -> blocks the last data-plane answer received in place (keys of ``Router.place_pull``).
        self._placed: dict[int, frozenset] = {}

    def __call__(self, shard: int, response: pb.PullResponse, payload: memoryview | None) -> None:
        # Over gRPC (no payload) nothing was received in place, whatever an earlier try named.
        placed = self._placed.pop(shard, frozenset()) if payload is not None else frozenset()
        self._router.place_pull(self._plan, shard, response, payload, placed)

    def push_pull(self, shard: int, response: pb.PushPullResponse, payload: memoryview | None) -> pb.PushResponse:
        """A ``PushPull`` answer: its pull placed as a ``Pull`` answer's is; the push's response."""
        self(shard, response.pull, payload)
        return response.push

    def direct(self, shard: int, meta: bytes, payload_len: int) -> list[tuple[int, memoryview]]:
        """Where the blocks of this answer can be received in place: (payload offset, bytes),
        ascending and disjoint inside ``payload_len`` (else none: all go through the buffer)."""
        return self._direct(shard, pb.PullResponse.FromString(meta), payload_len)

    def direct_push_pull(self, shard: int, meta: bytes, payload_len: int) -> list[tuple[int, memoryview]]:
        """``direct`` for a ``PushPull`` answer (its pull's blocks)."""
        return self._direct(shard, pb.PushPullResponse.FromString(meta).pull, payload_len)

    def _direct(self, shard: int, response: pb.PullResponse, payload_len: int) -> list[tuple[int, memoryview]]:
        plan = self._plan
        fp32 = wire_dtype(torch.float32)
        out: list[tuple[int, memoryview]] = []
        keys: list[tuple[object, ...]] = []
        for block in response.sparse:
            rows = plan.rows.get(block.table)
            v = block.values
            if (rows is not None and plan.positions.get((shard, block.table), 0) is None and v.dtype == fp32
                    and not v.data and v.payload_bytes == rows.numel() * 4 and tuple(v.shape) == tuple(rows.shape)):
                out.append((v.payload_offset, rows.numpy().data.cast("B")))
                keys.append(("sparse", block.table))
        for b in response.dense:
            layout = self._router.dense.get(b.name)
            flat = plan.flats.get(b.name)
            if layout is None or flat is None or not 0 <= b.index < len(layout.chunks):
                continue
            _, a, stop = layout.chunks[b.index]
            v = b.value
            if v.dtype == fp32 and not v.data and v.payload_bytes == (stop - a) * 4 and list(v.shape) == [stop - a]:
                out.append((v.payload_offset, flat[a:stop].numpy().data.cast("B")))
                keys.append(("dense", b.name, b.index))
        order = sorted(range(len(out)), key=lambda i: out[i][0])
        end = 0
        for i in order:
            offset, dest = out[i]
            if offset < end or offset + dest.nbytes > payload_len:
                self._placed[shard] = frozenset()
                return []
            end = offset + dest.nbytes
        self._placed[shard] = frozenset(keys)
        return [out[i] for i in order]
