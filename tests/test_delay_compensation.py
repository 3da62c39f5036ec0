"""DC-ASGD (issue 28 item 4): a push that carries the values its gradient was computed on is
stepped with ``g + lambda * g * g * (w_now - w_read)`` (Zheng et al. 2017), checked against a
direct NumPy transcription, for rows and dense chunks, on a shard and through a real client;
bad input is refused with nothing applied; sync and local mode refuse the option."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import make_client

from tether.protos.errors import InvalidArgument
from tether.protos.specs import OptimizerConfig, TableConfig
from tether.server.serving.serve import RunningShard
from tether.server.storage.shard import Shard
from tether.server.storage.shard_records import DenseDecl, DenseUpdate, SparseUpdate
from tether.worker.config import TrainingConfig

LR, LAM = 0.5, 0.7


def _dc_step(w_now: np.ndarray, w_read: np.ndarray, g: np.ndarray, lr: float, lam: float) -> np.ndarray:
    """SGD on the compensated gradient, element by element as the paper writes it."""
    out = np.empty_like(w_now, dtype=np.float64)
    for i in np.ndindex(w_now.shape):
        gc = g[i] + lam * g[i] * g[i] * (w_now[i] - w_read[i])
        out[i] = w_now[i] - lr * gc
    return out


def _shard(rule: str = "sgd") -> Shard:
    shard = Shard()
    opt = OptimizerConfig(rule, LR)
    shard.declare([TableConfig("t", 3, optimizer=opt, init_scale=0.5, seed=1)], [DenseDecl("d", 0, torch.linspace(-1, 1, 4), opt)])
    return shard


def test_a_stale_push_is_compensated_by_the_formula_rows_and_dense() -> None:
    shard = _shard()
    ids = np.array([3, 8, 11])
    w_read, _ = shard.tables["t"].pull(ids)
    d_read = shard.dense[("d", 0)].value.clone()
    # Another worker's push lands between this worker's read and its push.
    shard.push("b", 1, [SparseUpdate("t", ids, torch.full((3, 3), 0.4))], [DenseUpdate("d", 0, torch.full((4,), -0.3))],
               incarnation=2)
    w_now, d_now = shard.tables["t"].pull(ids)[0].numpy().copy(), shard.dense[("d", 0)].value.numpy().copy()
    g = torch.linspace(-2, 2, 9).reshape(3, 3)
    dg = torch.tensor([1.5, -0.5, 2.0, 0.25])
    shard.push("a", 1, [SparseUpdate("t", ids, g, 0, w_read)], [DenseUpdate("d", 0, dg, 0, d_read)], incarnation=1,
               delay_compensation=LAM)
    want = _dc_step(w_now, w_read.numpy(), g.numpy(), LR, LAM)
    np.testing.assert_allclose(shard.tables["t"].pull(ids)[0].numpy(), want, rtol=0, atol=1e-6)
    np.testing.assert_allclose(shard.dense[("d", 0)].value.numpy(), _dc_step(d_now, d_read.numpy(), dg.numpy(), LR, LAM), atol=1e-6)
    # The compensation is not nothing: plain SGD would have ended elsewhere.
    assert np.abs(want - (w_now - LR * g.numpy())).max() > 0.05


def test_the_rule_steps_on_the_compensated_gradient() -> None:
    shard, ref = _shard("adagrad"), _shard("adagrad")
    ids = np.array([2, 5])
    w_read = shard.tables["t"].pull(ids)[0]
    for s in (shard, ref):
        s.push("b", 1, [SparseUpdate("t", ids, torch.full((2, 3), 0.9))], [], incarnation=2)
    w_now = shard.tables["t"].pull(ids)[0]
    g = torch.tensor([[1.0, -2.0, 0.5], [0.3, 0.7, -1.1]])
    shard.push("a", 1, [SparseUpdate("t", ids, g, 0, w_read)], [], incarnation=1, delay_compensation=LAM)
    compensated = torch.from_numpy(g.numpy() + LAM * g.numpy() ** 2 * (w_now.numpy() - w_read.numpy()))
    ref.push("a", 1, [SparseUpdate("t", ids, compensated)], [], incarnation=1)
    assert torch.allclose(shard.tables["t"].pull(ids)[0], ref.tables["t"].pull(ids)[0], atol=1e-6)


def test_no_lambda_or_no_read_values_is_plain_and_bad_input_changes_nothing() -> None:
    shard, plain = _shard(), _shard()
    ids = np.array([1, 4])
    w_read = shard.tables["t"].pull(ids)[0]
    g = torch.ones(2, 3)
    for s in (shard, plain):
        s.push("b", 1, [SparseUpdate("t", ids, g)], [], incarnation=2)
    shard.push("a", 1, [SparseUpdate("t", ids, g, 0, w_read)], [], incarnation=1)  # lambda 0
    shard.push("a", 2, [SparseUpdate("t", ids, g)], [], incarnation=1, delay_compensation=LAM)  # nothing read sent
    for seq in (1, 2):
        plain.push("a", seq, [SparseUpdate("t", ids, g)], [], incarnation=1)
    assert torch.equal(shard.tables["t"].pull(ids)[0], plain.tables["t"].pull(ids)[0])
    before = shard.export_state()
    for bad, match in [(SparseUpdate("t", ids, g, 0, torch.zeros(3, 3)), "read values of shape"),
                       (SparseUpdate("t", ids, g, 0, torch.full((2, 3), float("nan"))), "finite")]:
        with pytest.raises(InvalidArgument, match=match):
            shard.push("a", 9, [bad], [], incarnation=1, delay_compensation=LAM)
    for lam in (-0.1, float("inf")):
        with pytest.raises(InvalidArgument, match="delay_compensation must be a finite number >= 0"):
            shard.push("a", 9, [SparseUpdate("t", ids, g, 0, w_read)], [], incarnation=1, delay_compensation=lam)
    after = shard.export_state()
    assert torch.equal(before.tables[0].weights, after.tables[0].weights) and shard.rejected_pushes == 4


@pytest.mark.parametrize("transport", ["grpc", "auto"])
def test_a_client_sends_what_it_read_and_the_shard_compensates(inproc_shard: RunningShard, transport: str) -> None:
    address = [f"127.0.0.1:{inproc_shard.port}"]
    a = make_client(address, "a", delay_compensation=LAM, transport=transport)
    b = make_client(address, "b", transport=transport)
    try:
        opt = OptimizerConfig("sgd", LR)
        for c in (a, b):
            c.declare([TableConfig("t", 4, optimizer=opt, init_scale=0.5)], {"d": torch.linspace(-1, 1, 6)}, opt)
        ids = torch.tensor([7, 70, 700])
        read = a.pull({"t": ids}, ["d"]).result(10)
        b.push({"t": (ids, torch.full((3, 4), 0.6))}, {"d": torch.full((6,), 0.2)}).result(10)
        now = b.pull({"t": ids}, ["d"]).result(10)
        g, dg = torch.linspace(-1.5, 1.5, 12).reshape(3, 4), torch.linspace(2, -2, 6)
        a.push({"t": (ids, g)}, {"d": dg}, clock=1, versions=read).result(10)
        final = a.pull({"t": ids}, ["d"]).result(10)
    finally:
        a.close()
        b.close()
    want = _dc_step(now.rows["t"].numpy(), read.rows["t"].numpy(), g.numpy(), LR, LAM)
    np.testing.assert_allclose(final.rows["t"].numpy(), want, atol=1e-6)
    d_want = _dc_step(now.dense["d"].numpy(), read.dense["d"].numpy(), dg.numpy(), LR, LAM)
    np.testing.assert_allclose(final.dense["d"].numpy(), d_want, atol=1e-6)
    assert np.abs(want - (now.rows["t"].numpy() - LR * g.numpy())).max() > 0.05


def test_sync_and_local_mode_refuse_it_in_one_line() -> None:
    for kw, where in [({"local": True}, "local mode"), ({"shards": ("127.0.0.1:1",), "mode": "sync"}, "sync")]:
        with pytest.raises(ValueError, match=f"--delay-compensation is for async and ssp:S: {where}") as err:
            TrainingConfig(delay_compensation=0.1, **kw)
        assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match="finite number >= 0"):
        TrainingConfig(shards=("127.0.0.1:1",), delay_compensation=-1.0)
    assert TrainingConfig(shards=("127.0.0.1:1",), mode="ssp:2", delay_compensation=0.1).delay_compensation == 0.1
