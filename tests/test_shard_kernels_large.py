"""The shard's paths for GPU-sized steps: new rows initialised by the compiled kernel, tables
growing inside their reserved room, pulled rows gathered by the compiled gather, and large
calls split across threads, each bit for bit what the plain path gives."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tether.protos.specs import OptimizerConfig, TableConfig
from tether.rules import kernel_threads, row_kernels
from tether.rules.initial import column_steps, init_rows, salt
from tether.rules.optimizers import rule
from tether.server.serving.data_port import gather_rows
from tether.server.storage.tables import EmbeddingTable
from tether.server.storage.zeroed import MAPPED_BYTES, RESERVE_FACTOR, float_rows, grow_rows


@pytest.fixture
def threads(monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    """Set how many threads a large call is split across (the pool is made again)."""

    def use(n: int) -> None:
        monkeypatch.setattr(kernel_threads, "_threads", n)
        monkeypatch.setattr(kernel_threads, "_pool", None)

    return use


@pytest.mark.parametrize("dim", [1, 3, 16, 128])
@pytest.mark.parametrize("scale", [0.01, 0.123, 1.0])
def test_compiled_initial_rows_are_init_rows_bit_for_bit(dim: int, scale: float) -> None:
    rng = np.random.default_rng(dim)
    ids = np.concatenate([rng.integers(-(2**63), 2**63 - 1, 3000, dtype=np.int64), [-1, 0, 2**63 - 1, -(2**63)]]).astype(np.int64)
    out = np.full((len(ids), dim), np.nan, np.float32)
    row_kernels.init_rows_into(ids, salt(7, "cat_3"), column_steps(dim)[0], np.float32(2 * scale / (1 << 24)), np.float32(scale), out)
    assert np.array_equal(out.view(np.uint32), init_rows(ids, dim, 7, "cat_3", scale).numpy().view(np.uint32))


def test_a_table_grows_in_its_reserved_room_without_moving_its_rows() -> None:
    table = EmbeddingTable(TableConfig("t", 128, OptimizerConfig("adagrad", 0.1), init_scale=0.05, seed=3))
    ids = np.arange(1, 40_001, dtype=np.int64) * 7919
    table.pull(ids[:3000])  # past its first 1,024 rows (plain memory): storage with room reserved
    first = table._weights
    rows, _ = table.pull(ids)
    grown = table._weights
    assert grown.shape[0] >= 40_000 > first.shape[0]
    assert grown.data_ptr() == first.data_ptr()  # a longer view of the same pages: nothing copied
    assert torch.equal(rows, init_rows(ids, 128, 3, "t", 0.05))
    assert not grown[40_000:].any() and not table._state["sum"][40_000:].any()
    assert torch.equal(first, grown[: first.shape[0]])


def test_growth_past_the_reservation_copies_the_rows_and_leaves_the_rest_zero() -> None:
    rows = float_rows(MAPPED_BYTES // 64, (16,))
    rows[:10] = 2.5
    inside = grow_rows(rows, rows.shape[0] * RESERVE_FACTOR, 10)
    assert inside.data_ptr() == rows.data_ptr() and inside.shape == (rows.shape[0] * RESERVE_FACTOR, 16)
    past = grow_rows(inside, inside.shape[0] + 1, 10)
    assert past.data_ptr() != rows.data_ptr() and past.shape == (inside.shape[0] + 1, 16)
    assert (past[:10] == 2.5).all() and not past[10:].any()
    small = float_rows(4, (4,))  # under MAPPED_BYTES: plain memory, grown by a copy
    small[:2] = 1.0
    bigger = grow_rows(small, 9, 2)
    assert bigger.shape == (9, 4) and (bigger[:2] == 1.0).all() and not bigger[2:].any()


@pytest.mark.parametrize(("name", "combined"), [("adagrad", False), ("adam", False), ("sgd", False), ("rowwise_adagrad", False),
                                                ("adagrad", True), ("adam", True), ("ftrl", True)])
def test_a_large_update_split_across_threads_is_the_one_thread_update_bit_for_bit(name: str, combined: bool, threads) -> None:  # type: ignore[no-untyped-def]
    # combined: a combined push's rows (row_kernels.combined_update), every other row one gradient.
    r, dim, n = rule(name), 128, 6000
    assert n * dim >= kernel_threads.PARALLEL_ELEMENTS
    cfg = OptimizerConfig(name, 0.05, weight_decay=0.01)
    rng = np.random.default_rng(0)
    slots = rng.choice(20_000, n, replace=False).astype(np.int64)
    grads, lr = rng.normal(size=(n, dim)).astype(np.float32), rng.uniform(0.5, 1.5, n).astype(np.float32)
    stats = np.full((n, max(len(r.combined_stats), 1)), 3.0, np.float32)
    stats[::2, 0] = -1
    results = []
    for count in (1, 3):
        threads(count)
        w = np.ones((20_000, dim), np.float32)
        state = {k: np.full((20_000, *s), 0.1, np.float32) for k, s in r.state_shapes(dim).items()}
        for _ in range(3):
            if combined:
                row_kernels.combined_update(r, cfg, dim)(w, state, slots, grads, lr, stats)  # type: ignore[misc]
            else:
                row_kernels.row_update(r, cfg, dim)(w, state, slots, grads, lr)
        results.append((w, state))
    (w1, s1), (w3, s3) = results
    assert np.array_equal(w1.view(np.uint32), w3.view(np.uint32)) and not np.array_equal(w1, np.ones_like(w1))
    assert all(np.array_equal(s1[k].view(np.uint32), s3[k].view(np.uint32)) for k in s1)


def test_pulled_rows_are_gathered_as_index_select_gathers_them(threads) -> None:  # type: ignore[no-untyped-def]
    threads(3)
    source = torch.randn(50_000, 128)
    rows = torch.from_numpy(np.random.default_rng(1).choice(50_000, 8000, replace=False).astype(np.int64))
    out = torch.empty(8000, 128)
    gather_rows(source, rows, out)  # large: split across threads
    assert torch.equal(out, source[rows])
    small = torch.empty(5, 128)
    gather_rows(source, rows[:5], small)  # small: torch's gather
    assert torch.equal(small, source[rows[:5]])
    one_thread = torch.empty(600, 128)  # compiled, on this thread alone
    gather_rows(source, rows[:600], one_thread)
    assert torch.equal(one_thread, source[rows[:600]])
    wide = torch.randn(10, 3, dtype=torch.float64)  # not float32 rows: torch's gather
    gather_rows(wide, torch.tensor([2, 0]), got := torch.empty(2, 3, dtype=torch.float64))
    assert torch.equal(got, wide[[2, 0]])
    with pytest.raises(IndexError):  # a row outside the source: refused, as index_select refuses it
        gather_rows(source, torch.cat([rows, torch.tensor([50_000])]), torch.empty(8001, 128))


def test_kernel_threads_reads_its_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kernel_threads, "_threads", None)
    monkeypatch.setenv("TETHER_KERNEL_THREADS", "2")
    assert kernel_threads.kernel_threads() == 2
    monkeypatch.setattr(kernel_threads, "_threads", None)
    monkeypatch.setenv("TETHER_KERNEL_THREADS", "none")
    with pytest.raises(ValueError, match="TETHER_KERNEL_THREADS must be an integer >= 1, got 'none'"):
        kernel_threads.kernel_threads()
    monkeypatch.setattr(kernel_threads, "_threads", None)
    monkeypatch.delenv("TETHER_KERNEL_THREADS")
    assert 1 <= kernel_threads.kernel_threads() <= 4


def test_the_generators_compiled_zipf_ranks_are_searchsorted_exactly() -> None:
    from tether.worker.data.synthetic import SyntheticClickLog, SyntheticConfig, _zipf_ranks

    for kw in ({}, {"vocab_size": 2, "zipf_exponent": 0.5}, {"vocab_size": 1000, "zipf_exponent": 3.0}):
        gen = SyntheticClickLog(SyntheticConfig(**kw))  # type: ignore[arg-type]
        cdf = gen._cdf
        u = np.concatenate([np.random.default_rng(5).random(100_000), [0.0, 1 - 2**-53, 0.5, 2**-16, 1 - 2**-16], cdf[:50], cdf[-50:],
                            np.nextafter(cdf[:50], 0), np.nextafter(cdf[:50], 1)])
        u = u[u < 1]
        out = np.empty(len(u), np.int64)
        _zipf_ranks(u, cdf, gen._starts, out)
        assert np.array_equal(out, np.searchsorted(cdf, u))


def test_tables_rows_received_back_to_back_are_joined_without_a_copy() -> None:
    from tether.worker.client.router import JOIN_ELEMENTS
    from tether.worker.training.embedding import joined_rows

    buffer = torch.arange(float(JOIN_ELEMENTS)).view(-1, 128)  # a large pull's buffer
    n = len(buffer)
    parts = [buffer[0:300], buffer[300:300], buffer[300:n]]
    joined = joined_rows(parts)
    assert joined.data_ptr() == buffer.data_ptr() and torch.equal(joined, buffer)
    apart = joined_rows([buffer[300:n], buffer[0:300]])  # not in the buffer's order: copied
    assert apart.data_ptr() != buffer.data_ptr() and torch.equal(apart, torch.cat([buffer[300:n], buffer[0:300]]))
    other = torch.zeros(2, 128)
    assert torch.equal(joined_rows([buffer, other]), torch.cat([buffer, other]))
    assert joined_rows([buffer[2:4]]).data_ptr() == buffer[2:].data_ptr()
    small = torch.arange(40.0).view(10, 4)  # a small pull: a tensor per table, joined by a copy
    assert torch.equal(joined_rows([small[:3], small[3:]]), small) and joined_rows([small[:3], small[3:]]).data_ptr() != small.data_ptr()


def test_a_large_cpu_pull_is_received_into_one_buffer_per_width_and_a_small_one_per_table() -> None:
    from tether.worker.client.config import ClientConfig
    from tether.worker.client.router import JOIN_ELEMENTS, Router

    router = Router(ClientConfig(addresses=("127.0.0.1:1",), worker_id="w"), incarnation=1)
    router.dims = {"a": 128, "b": 128, "c": 16}
    big = {"a": np.arange(JOIN_ELEMENTS // 128), "b": np.arange(5), "c": np.arange(3)}
    rows = router._row_buffers(big)
    assert rows["b"].data_ptr() == rows["a"].data_ptr() + JOIN_ELEMENTS * 4  # back to back in one buffer
    assert [tuple(rows[t].shape) for t in "abc"] == [(JOIN_ELEMENTS // 128, 128), (5, 128), (3, 16)]
    small = router._row_buffers({"a": np.arange(10), "b": np.arange(5)})
    assert small["b"].untyped_storage().data_ptr() != small["a"].untyped_storage().data_ptr()
