"""A push whose rows' shards are known (``router.ShardedPart``, made by the row cache from its
rows' shard column, ``cache_split.pack_push``) builds the very requests and payloads that a push
split by hashing its ids builds, and hashes nothing; one whose split does not fit is hashed."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tether.protos import tether_pb2 as pb
from tether.protos.errors import InvalidArgument
from tether.protos.partition import shard_of_ids, split_ids
from tether.protos.specs import OptimizerConfig, TableConfig
from tether.worker.cache.config import RowCacheConfig
from tether.worker.cache.row_cache import RowCache
from tether.worker.cache.split import group_ids, pack_push
from tether.worker.client.config import ClientConfig
from tether.worker.client.results import PullResult
from tether.worker.client.router import PackedParts, PackedPush, Router, ShardedPart
from tether.worker.client.traffic import TrafficMeter

_DIMS = {"a": 4, "b": 2}


def _router(num_shards: int, **config: object) -> Router:
    addresses = tuple(f"127.0.0.1:{9000 + s}" for s in range(num_shards))
    router = Router(ClientConfig(addresses=addresses, worker_id="w", **config), 7)  # type: ignore[arg-type]
    router.declared([TableConfig(name=t, dim=d) for t, d in _DIMS.items()], {})
    return router


def _wire(router: Router, sparse: dict[str, tuple[torch.Tensor, ...]], versions: PullResult | None) -> dict[int, tuple[bytes, bytes]]:
    """Each shard's push as sent: the request's bytes and the payload's."""
    requests, payloads = router.push_requests(sparse, {}, 5, versions)
    out = {}
    for s, r in requests.items():
        region = bytearray(payloads[s].nbytes)
        payloads[s].copy_into(memoryview(region))
        out[s] = (r.SerializeToString(), bytes(region))
    return out


@pytest.mark.parametrize("num_shards", [1, 2, 3, 5])
def test_pack_push_finds_split_ids_split_and_lays_each_shards_rows_out_as_its_payload(num_shards: int) -> None:
    rng = np.random.default_rng(num_shards)
    parts = [np.unique(rng.integers(-(1 << 62), 1 << 62, n)) for n in (0, 1, 40, 300)]
    dims, kinds = np.array([3, 1, 4, 2], np.int64), np.array([[0, 1], [-1, -1], [0, -1], [1, 0]], np.int64)
    combined = np.array([True, False, False, True])  # table 2 has a statistic but sums no several gradients: none sent
    ids = np.concatenate(parts)
    count = np.array([len(p) for p in parts], np.int64)
    sums = rng.standard_normal(int((count * dims).sum())).astype(np.float32)
    nstats = (kinds >= 0).sum(1)
    stats = rng.standard_normal(int((count * nstats).sum())).astype(np.float32)
    for _ in range(3):  # memory of the payload's size freed full of NaN first: the padding must be written, not found zero
        poison = np.full(int((count * (dims + nstats)).sum()) + 64 * num_shards * len(parts), np.nan, np.float32)
        del poison
        order, bounds, gids, payload, starts, voff, soff = pack_push(shard_of_ids(ids, num_shards), count, num_shards, ids, sums, stats,
                                                                     dims, kinds, combined, 16)
    packed = PackedPush(payload, starts, voff, soff, gids, np.concatenate([[0], np.cumsum(count)]), combined,
                        tuple(f"t{g}" for g in range(len(parts)) if count[g]))
    want_run: dict[int, list[tuple[int, np.ndarray]]] = {s: [] for s in range(num_shards)}  # each shard's blocks, as PayloadWriter places them
    at = flat = sflat = 0
    for g, part in enumerate(parts):
        n, d, k = len(part), int(dims[g]), int(nstats[g])
        rows = sums[flat: flat + n * d].reshape(n, d)
        extra = stats[sflat: sflat + n * k].reshape(n, k)
        items = (torch.from_numpy(part), torch.from_numpy(rows)) + ((torch.from_numpy(extra),) if combined[g] else ())
        sharded = ShardedPart(items, order[at: at + n], bounds[g], packed, g)
        assert sharded.fits(num_shards, n) and not sharded.fits(num_shards + 1, n) and not sharded.fits(num_shards, n + 1)
        assert not ShardedPart(items[:2] if combined[g] else (*items, torch.zeros(n, 1)), order[at: at + n], bounds[g], packed, g).fits(num_shards, n)
        got, want = sharded.split(), split_ids(part, num_shards)
        assert len(got) == num_shards and bounds[g, -1] == n
        for s, ((pos, sub, own), (wpos, wsub)) in enumerate(zip(got, want, strict=True)):
            assert pos.tolist() == wpos.tolist() and sub.tolist() == wsub.tolist()
            if len(wpos):
                assert torch.equal(own[0], torch.from_numpy(rows[wpos]))
                want_run[s].append((int(voff[g, s]), rows[wpos].reshape(-1)))
                if combined[g]:
                    assert len(own) == 2 and torch.equal(own[1], torch.from_numpy(extra[wpos]))
                    want_run[s].append((int(soff[g, s]), extra[wpos].reshape(-1)))
                else:
                    assert len(own) == 1 and soff[g, s] == -1
            else:
                assert own == [] and voff[g, s] == -1 and soff[g, s] == -1
        at, flat, sflat = at + n, flat + n * d, sflat + n * k
    for s, blocks in want_run.items():  # each run: its blocks 16 floats aligned one after another, zeros between, nothing past the last
        run = np.zeros(0, np.float32)
        for off, block in blocks:
            assert off == -(-len(run) // 16) * 16
            run = np.concatenate([run, np.zeros(off - len(run), np.float32), block])
        assert np.array_equal(payload[starts[s]: starts[s + 1]], run)


def _cached_push(num_shards: int) -> tuple[dict[str, tuple[torch.Tensor, ...]], PullResult]:
    """A combined push of the row cache (adam on "a", adagrad on "b"), its rows held 3 clocks."""
    cache = RowCache(RowCacheConfig(rows=500, bound=3, admission="all"), _DIMS, num_shards)
    cache.use_tables([TableConfig(name=t, dim=d, optimizer=OptimizerConfig(name=r, lr=0.1)) for (t, d), r in zip(_DIMS.items(), ("adam", "adagrad"), strict=False)])
    gen = torch.Generator().manual_seed(num_shards)
    ids = {t: torch.unique(torch.randint(0, 1 << 40, (120,), generator=gen)) for t in _DIMS}
    plan = cache.plan(ids, 0)
    versions = {(s, t): 10 + s for t in ids for s in range(num_shards)}
    pulled, _ = cache.merge(plan, PullResult({t: torch.zeros(len(i), _DIMS[t]) for t, i in plan.miss.items()}, {}, versions, {}))
    for clock in (1, 2, 3):
        step = {t: i if clock == 1 else i[::2] for t, i in ids.items()}  # half the rows one gradient, half several
        pushed, _ = cache.accumulate({t: (i, torch.randn(len(i), _DIMS[t], generator=gen)) for t, i in step.items()}, clock, pulled)
        assert pushed == {}
    pushed, table_versions = cache.accumulate({}, 4, None)
    return pushed, PullResult({}, {}, table_versions, {})


@pytest.mark.parametrize("num_shards", [1, 2, 3, 4])
def test_a_cached_push_with_known_shards_sends_what_a_hashed_split_sends(num_shards: int, monkeypatch: pytest.MonkeyPatch) -> None:
    pushed, versions = _cached_push(num_shards)
    assert isinstance(pushed, PackedParts) and list(pushed) == list(_DIMS)
    plain = {t: tuple(p) for t, p in pushed.items()}  # the same rows, split by hashing their ids
    assert all(isinstance(p, ShardedPart) and len(p) == 3 for p in pushed.values())
    want = _wire(_router(num_shards), plain, versions)
    hashed: list[int] = []
    monkeypatch.setattr("tether.worker.client.router.split_ids", lambda ids, n: hashed.append(len(ids)) or split_ids(ids, n))
    one_by_one: list[str] = []

    def watched() -> Router:
        router = _router(num_shards)
        real = router._push_table
        monkeypatch.setattr(router, "_push_table", lambda table, *a: one_by_one.append(table) or real(table, *a))
        return router

    got = _wire(watched(), pushed, versions)
    assert hashed == []  # no id hashed: the cache's split taken as it is
    assert one_by_one == []  # every table's rows sent as the cache laid them out (one payload part a shard)
    assert got == want
    # A push of some of its tables only, or in another order, goes table by table, and still sends the same.
    for sub in ({"b": pushed["b"]}, {"b": pushed["b"], "a": pushed["a"]}):
        assert _wire(watched(), sub, versions) == _wire(_router(num_shards), {t: tuple(p) for t, p in sub.items()}, versions)
    assert one_by_one == ["b", "b", "a"]
    assert sorted(got) == sorted({int(s) for s in shard_of_ids(np.concatenate([p[0].numpy() for p in pushed.values()]), num_shards)})
    for meta, _ in got.values():  # each table's part carries its combined statistics (adam 2 columns, adagrad 1)
        blocks = pb.PushRequest.FromString(meta).sparse
        assert {b.table: list(b.combined.shape)[1:] for b in blocks} == {"a": [2], "b": [1]}


def test_a_packed_push_is_counted_and_checked_without_its_parts_made(monkeypatch: pytest.MonkeyPatch) -> None:
    """``PackedParts``: the meter counts its rows and statistics bytes and the router checks its
    tables and widths from its layout (the same figures and errors as from the parts), and
    neither makes a table's part; a push to a client with other tables is refused whole."""
    pushed, versions = _cached_push(2)
    made: list[str] = []
    real = PackedParts.__getitem__
    monkeypatch.setattr(PackedParts, "__getitem__", lambda self, t: made.append(t) or real(self, t))
    fast = TrafficMeter(_DIMS, 4)
    fast.pushed(pushed)
    assert _wire(_router(2), pushed, versions) and made == []
    plain = {t: tuple(p) for t, p in pushed.items()}
    slow = TrafficMeter(_DIMS, 4)
    slow.pushed(plain)
    assert fast.totals() == slow.totals() and fast.pushed_stats_bytes == slow.pushed_stats_bytes
    assert fast.pushed_rows == {t: len(p[0]) for t, p in plain.items()} and all(fast.pushed_stats_bytes[t] > 0 for t in _DIMS)
    wide = Router(ClientConfig(addresses=("127.0.0.1:9000", "127.0.0.1:9001"), worker_id="w"), 7)
    wide.declared([TableConfig(name="a", dim=4), TableConfig(name="b", dim=3)], {})
    with pytest.raises(InvalidArgument, match=r"table 'b': gradient shape \(\d+, 2\) != \(\d+, 3\)"):
        wide.push_requests(pushed, {}, 5, versions)
    narrow = Router(ClientConfig(addresses=("127.0.0.1:9000", "127.0.0.1:9001"), worker_id="w"), 7)
    narrow.declared([TableConfig(name="a", dim=4)], {})
    with pytest.raises(InvalidArgument, match="table 'b' was not declared by this client"):
        narrow.push_requests(pushed, {}, 5, versions)
    assert wide.next_seq(0) == narrow.next_seq(0) == 1  # nothing counted as sent
    # The same parts one by one: a table's sums of another row count are refused, as ever.
    a, b = pushed["a"], pushed["b"]
    short = ShardedPart((b[0], b[1][:-1], b[2]), b.order, b.bounds, b.packed, b.g)
    with pytest.raises(InvalidArgument, match=rf"table 'b': gradient shape \({len(b[0]) - 1}, 2\) != \({len(b[0])}, 2\)"):
        _router(2).push_requests({"a": a, "b": short}, {}, 5, versions)


def test_a_known_split_for_another_shard_count_is_hashed_instead(monkeypatch: pytest.MonkeyPatch) -> None:
    pushed, versions = _cached_push(2)
    plain = {t: tuple(p) for t, p in pushed.items()}
    want = _wire(_router(3), plain, versions)
    hashed: list[int] = []
    monkeypatch.setattr("tether.worker.client.router.split_ids", lambda ids, n: hashed.append(n) or split_ids(ids, n))
    assert _wire(_router(3), pushed, versions) == want
    assert hashed == [3, 3]  # both tables split by hashing, for the router's 3 shards


def test_a_known_split_sends_what_a_hashed_one_sends_in_bfloat16_with_the_values_read(monkeypatch: pytest.MonkeyPatch) -> None:
    pushed, versions = _cached_push(3)
    # DC-ASGD's read values (gathered per shard from the pull's rows) beside the known split's own rows.
    gen = torch.Generator().manual_seed(1)
    versions.rows.update({t: torch.randn(p[1].shape, generator=gen) for t, p in pushed.items()})
    plain = {t: tuple(p) for t, p in pushed.items()}
    config = {"wire_dtype": torch.bfloat16, "delay_compensation": 0.5}
    want = _wire(_router(3, **config), plain, versions)
    hashed: list[int] = []
    monkeypatch.setattr("tether.worker.client.router.split_ids", lambda ids, n: hashed.append(n) or split_ids(ids, n))
    got = _wire(_router(3, **config), pushed, versions)
    assert hashed == [] and got == want
    blocks = [b for meta, _ in got.values() for b in pb.PushRequest.FromString(meta).sparse]
    assert blocks and all(b.read_values.payload_bytes == b.values.payload_bytes > 0 for b in blocks)


@pytest.mark.parametrize("num_shards", [1, 2, 3, 5])
def test_group_ids_finds_split_ids_split_of_each_part(num_shards: int) -> None:
    rng = np.random.default_rng(10 + num_shards)
    parts = [np.unique(rng.integers(-(1 << 62), 1 << 62, n)) for n in (0, 1, 40, 300)]
    ids = np.concatenate(parts)
    offs = np.concatenate([[0], np.cumsum([len(p) for p in parts])]).astype(np.int64)
    order, bounds, grouped = group_ids(ids, offs, num_shards)
    for k, part in enumerate(parts):
        a = int(offs[k])
        for s, (pos, want) in enumerate(split_ids(part, num_shards)):
            lo, hi = a + int(bounds[k, s]), a + int(bounds[k, s + 1])
            assert np.array_equal(order[lo:hi], pos) and np.array_equal(grouped[lo:hi], want)
        assert bounds[k, num_shards] == len(part)


@pytest.mark.parametrize("num_shards", [1, 2, 3])
def test_a_cached_pull_sends_what_hashing_sends_and_hashes_nothing(num_shards: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """The row cache's plan splits its misses by shard (``Plan.splits``); ``Router.pull_requests``
    takes that split and builds the very requests a split by hashing builds."""
    rng = np.random.default_rng(num_shards)
    cache = RowCache(RowCacheConfig(rows=1000, bound=2, admission="all"), _DIMS, num_shards)
    cache.plan({"a": torch.from_numpy(np.unique(rng.integers(0, 500, 60)))}, 1)  # some rows cached, so misses are a subset
    sparse = {t: torch.from_numpy(np.unique(rng.integers(0, 500, 80))) for t in _DIMS}
    plan = cache.plan(sparse, 2)
    ask = {t: ids for t, ids in plan.miss.items() if len(ids)}
    hashed = _router(num_shards).pull_requests(ask, [])[0]
    router = _router(num_shards)
    calls: list[str] = []
    real = router._split
    monkeypatch.setattr(router, "_split", lambda table, arr: calls.append(table) or real(table, arr))
    known = router.pull_requests(ask, [], plan.splits)[0]
    assert calls == []
    assert {s: r.SerializeToString() for s, r in known.items()} == {s: r.SerializeToString() for s, r in hashed.items()}
    # A split made for another shard count does not fit: those ids are hashed.
    other = _router(num_shards + 1)
    assert {s: r.SerializeToString() for s, r in other.pull_requests(ask, [], plan.splits)[0].items()} == \
        {s: r.SerializeToString() for s, r in _router(num_shards + 1).pull_requests(ask, [])[0].items()}
