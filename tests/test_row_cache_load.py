"""Loading the row cache's compiled passes (tether.worker.cache.slots.warm_up): the example types
the warm-up compiles are the ones a real cache's steps call (no step compiles again), and the
background load's errors reach the first step."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch

from tether.worker.cache import slots as row_slots
from tether.worker.cache.config import RowCacheConfig
from tether.worker.cache.row_cache import RowCache

# In a fresh process (so that nothing an earlier test compiled hides a miss): the signatures every
# compiled function of the cache has after warm_up, and after a cached training of two tables of
# different widths with the local rule, eviction and combined pushes.
_SCRIPT = textwrap.dedent("""
    import json
    import numba
    import torch
    from torch import nn
    from tether.rules import index_kernels
    from tether.worker.cache import batch as cache_batch
    from tether.worker.cache import kernels as cache_kernels
    from tether.worker.cache import slots as row_slots
    from tether.worker.training.embedding_bag import ShardedEmbeddingBag
    from tether.worker.config import TrainingConfig
    from tether.worker.training.trainer import Trainer

    def signatures():
        out = {}
        for mod in (cache_batch, cache_kernels, index_kernels):
            for name, fn in vars(mod).items():
                if isinstance(fn, numba.core.registry.CPUDispatcher) and (mod is not index_kernels or name.startswith("index_")):
                    out[mod.__name__ + "." + name] = sorted(str(s) for s in fn.signatures)
        return out

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = ShardedEmbeddingBag("a", 8), ShardedEmbeddingBag("b", 3)
            self.out = nn.Linear(11, 1)

        def forward(self, batch):
            return self.out(torch.cat([self.a(batch["a"]), self.b(batch["b"])], 1)).squeeze(1)

    row_slots.warm_up()
    before = signatures()
    g = torch.Generator().manual_seed(1)
    batches = [{"a": torch.randint(0, 400, (64,), generator=g), "b": torch.randint(0, 50, (64,), generator=g),
                "y": torch.rand(64, generator=g)} for _ in range(12)]
    config = TrainingConfig(local=True, optimizer="adagrad", lr=0.05, log_every=1000, cache_rows=100, cache_bound=2)
    with Trainer(Model(), config, loss=lambda m, b: nn.functional.mse_loss(m(b), b["y"]),
                 sparse=lambda b: {"a": b["a"], "b": b["b"]}, batch_size=lambda b: 64, printer=lambda line: None) as trainer:
        trainer.fit(batches, background=False)
        evictions = sum(trainer.ps.rows.cache.evictions.values())
    print(json.dumps({"before": before, "after": signatures(), "evictions": evictions}))
""")


def test_a_real_cache_step_compiles_nothing_the_warm_up_did_not() -> None:
    run = subprocess.run([sys.executable, "-c", _SCRIPT], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert got["evictions"] > 0  # the run went through eviction and the index's rebuilds
    for name in ("tether.worker.cache.batch.plan_all", "tether.worker.cache.batch.store_all", "tether.worker.cache.batch.take_all",
                 "tether.worker.cache.kernels._append", "tether.rules.index_kernels.index_lookup"):
        assert got["before"][name], name  # the warm-up compiled (or loaded) it
    assert got["after"] == got["before"]


def test_a_failed_background_load_is_raised_at_the_first_step(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken() -> None:
        raise ValueError("no kernels here")

    monkeypatch.setattr(row_slots, "_warming", [])
    monkeypatch.setattr(row_slots, "_warm_errors", [])
    monkeypatch.setattr(row_slots, "warm_up", broken)
    cache = RowCache(RowCacheConfig(rows=10, bound=1), {"t": 4}, 1)  # starts the load: no error yet
    with pytest.raises(RuntimeError, match="row cache's compiled kernels failed to load: no kernels here"):
        cache.plan({"t": torch.tensor([1, 2])}, 0)
    assert cache.hits == {"t": 0}  # the step changed nothing
    with pytest.raises(RuntimeError, match="failed to load"):
        cache.use_tables([])  # where a Trainer waits for the load, before its steps' clock starts
