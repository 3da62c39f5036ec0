"""Server-side rules agree with torch.optim on dense tensors and apply per row on tables; every
registered rule's compiled row kernel takes the steps of its torch form."""

import numpy as np
import pytest
import torch

from tether.protos.names import OPTIMIZERS
from tether.protos.specs import OptimizerConfig, TableConfig
from tether.rules import row_kernels
from tether.rules.optimizers import rule
from tether.rules.update_rules import SGD, RuleOptimizer, UpdateRule
from tether.server.storage.tables import EmbeddingTable

# Rules whose dense form is the rule itself (row-wise Adagrad steps dense values as Adagrad).
_SAME_ON_DENSE = tuple(n for n in OPTIMIZERS if rule(n).dense_rule() is rule(n))


def _torch_reference(name: str, w0: torch.Tensor, grads: list[torch.Tensor]) -> torch.Tensor:
    p = torch.nn.Parameter(w0.clone())
    opt = {
        "sgd": lambda: torch.optim.SGD([p], lr=0.1),
        "adagrad": lambda: torch.optim.Adagrad([p], lr=0.1, eps=1e-8),
        "adam": lambda: torch.optim.Adam([p], lr=0.1, betas=(0.9, 0.999), eps=1e-8),
    }[name]()
    for g in grads:
        p.grad = g.clone()
        opt.step()
    return p.detach()


@pytest.mark.parametrize("name", ["sgd", "adagrad", "adam"])
def test_dense_matches_torch_optim(name: str) -> None:
    torch.manual_seed(0)
    w0 = torch.randn(50)
    grads = [torch.randn(50) for _ in range(5)]
    cfg = OptimizerConfig(name=name, lr=0.1, eps=1e-8)
    w = w0.clone()
    state = {k: torch.zeros(s) for k, s in rule(name).state_shapes(50).items()}
    for g in grads:
        rule(name).apply(cfg, w, g, state)
    # Adagrad adds eps outside the sqrt, like torch.optim.Adagrad.
    assert torch.allclose(w, _torch_reference(name, w0, grads), atol=1e-5)


def test_sparse_adam_keeps_a_step_count_per_row() -> None:
    cfg = OptimizerConfig(name="adam", lr=0.1)
    table = EmbeddingTable(TableConfig("t", 3, cfg, init_scale=0.0))
    table.push(np.array([1]), torch.ones(1, 3))
    table.push(np.array([1, 2]), torch.ones(2, 3))
    snap = table.snapshot()
    assert snap["ids"].tolist() == [1, 2]
    assert snap["state"]["t"].tolist() == [2.0, 1.0]
    # The first Adam step moves every coordinate by lr regardless of the gradient's scale.
    assert torch.allclose(snap["weights"][1], torch.full((3,), -0.1), atol=1e-6)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"name": "rmsprop"}, "optimizer must be one of"),
        ({"lr": 0.0}, "lr must be a positive finite number, got 0.0"),
        ({"lr": float("nan")}, "lr must be a positive finite number"),
        ({"beta1": 1.0}, "betas must be in"),
        ({"eps": 0.0}, "eps must be > 0"),
        ({"weight_decay": -1.0}, "must be >= 0"),
    ],
)
def test_config_validation(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        OptimizerConfig(**kwargs)


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_each_rule_names_the_torch_optimizer_that_takes_its_steps(name: str) -> None:
    torch.manual_seed(1)
    w0 = torch.randn(20)
    grads = [torch.randn(20) for _ in range(4)]
    cfg = OptimizerConfig(name=name, lr=0.05, weight_decay=0.01)
    p = torch.nn.Parameter(w0.clone())
    opt = rule(name).torch_optimizer(cfg, [p])
    w = w0.clone()
    dense = rule(name).dense_rule()
    state = {k: torch.full(s, dense.initial_state(cfg).get(k, 0.0)) for k, s in dense.state_shapes(20).items()}
    for g in grads:
        p.grad = g.clone()
        opt.step()
        dense.apply(cfg, w, g, state)
    assert torch.allclose(w, p.detach(), atol=1e-5)


_EVERY_CONSTANT = {"eps": 1e-3, "weight_decay": 0.1, "initial_accumulator": 0.5, "beta1": 0.5, "beta2": 0.8}


@pytest.mark.parametrize("constants", [{}, _EVERY_CONSTANT], ids=["defaults", "every-constant-set"])
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_one_step_of_a_rule_is_one_step_of_its_torch_optimizer(name: str, constants: dict) -> None:
    """``rule(name).torch_optimizer`` is the torch optimizer that matches the shard's rule: it is
    built with every constant (Adagrad's eps 1e-8, not torch's 1e-10, and its initial sum; Adam's
    betas and eps; weight decay), and its first step moves the parameters as the rule's does, to
    1e-6 of the step, for gradients from 1e-6 (where eps matters) to 1. (Adam's bias corrections
    in float32 were 7e-6 off here: 1 - 0.999**t loses digits to cancellation.)"""
    g = torch.Generator().manual_seed(0)
    w0 = torch.randn(4096, generator=g) * 1e-3
    grad = torch.randn(4096, generator=g) * torch.logspace(-6, 0, 4096)
    cfg = OptimizerConfig(name=name, lr=0.1, **constants)
    r = rule(name).dense_rule()
    w = w0.clone()
    state = {k: torch.full(s, r.initial_state(cfg).get(k, 0.0)) for k, s in r.state_shapes(4096).items()}
    r.apply(cfg, w, grad, state)
    p = torch.nn.Parameter(w0.clone())
    p.grad = grad.clone()
    r.torch_optimizer(cfg, [p]).step()
    ours, theirs = w - w0, p.detach() - w0
    assert (ours - theirs).abs().max() <= 1e-6 * theirs.abs().max()


def test_torch_adagrad_with_its_own_eps_is_not_the_shards_rule() -> None:
    """Why the eps is passed: torch.optim.Adagrad's default (1e-10) steps a row whose gradients
    are around 1e-8 twice as far as the shards' rule (1e-8)."""
    cfg = OptimizerConfig("adagrad", lr=0.1)
    grad = torch.full((4,), 1e-8)
    w = torch.zeros(4)
    rule("adagrad").apply(cfg, w, grad, {"sum": torch.zeros(4)})
    assert torch.allclose(w, torch.full((4,), -0.05))
    p = torch.nn.Parameter(torch.zeros(4))
    p.grad = grad.clone()
    torch.optim.Adagrad([p], lr=0.1).step()
    assert torch.allclose(p.detach(), torch.full((4,), -0.099), atol=1e-3)


def test_an_unknown_rule_is_named() -> None:
    with pytest.raises(ValueError, match="'rmsprop'"):
        rule("rmsprop")


@pytest.mark.parametrize("weight_decay", [0.0, 0.01])
@pytest.mark.parametrize("name", _SAME_ON_DENSE)
def test_a_tables_compiled_row_update_is_its_torch_optimizer_row_by_row(name: str, weight_decay: float) -> None:
    """The shard's compiled row kernels (rules/row_kernels.py) take the steps torch.optim takes on
    each row, each row with its own learning-rate factor (staleness-aware pushes)."""
    torch.manual_seed(2)
    cfg = OptimizerConfig(name=name, lr=0.05, eps=1e-8, weight_decay=weight_decay)
    table = EmbeddingTable(TableConfig("t", 8, cfg, init_scale=0.5))
    ids = np.array([5, 900, 3, 77])
    w0 = table.pull(ids)[0].clone()
    params = [torch.nn.Parameter(w0[i].clone()) for i in range(len(ids))]
    scales = np.array([1.0, 0.5, 0.25, 1.0])
    opts = [rule(name).torch_optimizer(OptimizerConfig(name=name, lr=0.05 * s, eps=1e-8, weight_decay=weight_decay), [p])
            for p, s in zip(params, scales, strict=False)]
    for step in range(4):
        grads = torch.randn(len(ids), 8)
        # Row 77 sits out the second step: its own step count (Adam) and state stay behind.
        rows = [0, 1, 2] if step == 1 else [0, 1, 2, 3]
        table.push(ids[rows], grads[rows], scales[rows])
        for i in rows:
            params[i].grad = grads[i].clone()
            opts[i].step()
    assert torch.allclose(table.pull(ids)[0], torch.stack([p.detach() for p in params]), atol=1e-5)


def test_the_kernels_still_run_where_no_cache_directory_is_writable() -> None:
    """A read-only package directory and no writable NUMBA_CACHE_DIR or home: the shard still
    starts (the kernels are compiled in memory) and says how to cache them."""
    import json
    import subprocess
    import sys

    code = (
        "import logging; logging.basicConfig()\n"
        "import numba.core.caching as c; c.CacheImpl._locator_classes = []\n"
        "import numpy as np, torch\n"
        "from tether.rules.optimizers import OptimizerConfig\n"
        "from tether.server.storage.tables import EmbeddingTable, TableConfig\n"
        "t = EmbeddingTable(TableConfig('t', 4, OptimizerConfig('adagrad', lr=0.1), init_scale=0.0))\n"
        "t.push(np.array([1, 2]), torch.ones(2, 4))\n"
        "print(t.pull(np.array([1]))[0].tolist())\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    # Adagrad's first step from zero with a gradient of one: -lr * 1 / (sqrt(1) + eps).
    assert np.allclose(json.loads(out.stdout), [[-0.1] * 4], atol=1e-6), out.stdout
    assert "not cached on disk" in out.stderr and "NUMBA_CACHE_DIR" in out.stderr


def test_a_dense_chunk_starts_adagrad_from_the_initial_accumulator() -> None:
    from tether.server.storage.dense import DenseChunk

    cfg = OptimizerConfig("adagrad", lr=0.1, initial_accumulator=0.5)
    w0 = torch.linspace(-1, 1, 6)
    grad = torch.linspace(0.3, -0.2, 6)
    chunk = DenseChunk("w", 0, w0, cfg)
    chunk.push(grad)
    p = torch.nn.Parameter(w0.clone())
    opt = torch.optim.Adagrad([p], lr=0.1, eps=cfg.eps, initial_accumulator_value=0.5)
    p.grad = grad.clone()
    opt.step()
    assert torch.allclose(chunk.value, p.detach(), atol=1e-7)


_KERNEL_CONSTANTS = {"eps": 1e-3, "initial_accumulator": 0.1, "beta1": 0.8, "beta2": 0.99}


@pytest.mark.parametrize("weight_decay", [0.0, 0.05])
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_each_rules_compiled_row_kernel_takes_the_steps_of_its_torch_form(name: str, weight_decay: float) -> None:
    """For every rule in the registry, its row kernel (compiled as the shard compiles it) and its
    torch form (``apply``, the reference) agree row by row to 1e-6: weights absolutely (relative to
    the largest where that is over 1), each state tensor relative to its largest value. Unique ids in any order, rows that sit out a push,
    each row with its own learning-rate factor, gradients from 1e-6 to 1, weight decay."""
    r = rule(name)
    cfg = OptimizerConfig(name, lr=0.05, weight_decay=weight_decay, **_KERNEL_CONSTANTS)
    rows, dim, per_push = 64, 24, 40
    gen = torch.Generator().manual_seed(4)
    w0 = torch.randn(rows, dim, generator=gen)
    state0 = {k: torch.full((rows, *s), r.initial_state(cfg).get(k, 0.0)) for k, s in r.state_shapes(dim).items()}
    w_kernel, state_kernel = w0.clone(), {k: t.clone() for k, t in state0.items()}
    w_torch, state_torch = w0.clone(), {k: t.clone() for k, t in state0.items()}
    update = row_kernels.row_update(r, cfg, dim)
    for _ in range(6):
        slots = torch.randperm(rows, generator=gen)[:per_push].numpy().astype(np.int64)
        grads = torch.randn(per_push, dim, generator=gen) * torch.logspace(-6, 0, per_push)[:, None]
        scales = torch.rand(per_push, generator=gen, dtype=torch.float64).numpy()
        update(w_kernel.numpy(), {k: t.numpy() for k, t in state_kernel.items()}, slots, grads.numpy(),
               (cfg.lr * scales).astype(np.float32))
        for i, s in enumerate(slots):
            r.apply(cfg, w_torch[s:s + 1], grads[i:i + 1], {k: t[s:s + 1] for k, t in state_torch.items()}, float(scales[i]))
        # FTRL's weights leave [-1, 1] with these random rates: float rounding is relative to them.
        assert (w_kernel - w_torch).abs().max() <= 1e-6 * max(1.0, float(w_torch.abs().max()))
        for k, t in state_torch.items():
            assert (state_kernel[k] - t).abs().max() <= 1e-6 * t.abs().max(), k
    assert not torch.equal(w_kernel, w0)


class _SignSGD(UpdateRule):
    """A rule no registry knows: ``w -= lr * sign(g)``."""

    name = "sign_sgd"

    def step(self, cfg: OptimizerConfig, w: torch.Tensor, g: torch.Tensor, state: dict, lr: float) -> None:
        w.add_(torch.sign(g), alpha=-lr)

    def kernel_constants(self, cfg: OptimizerConfig) -> tuple:
        return ()

    @staticmethod
    def rows(w: np.ndarray, slots: np.ndarray, g: np.ndarray, lr: np.ndarray, scratch: np.ndarray) -> None:
        for i in range(len(slots)):
            row = w[slots[i]]
            for j in range(g.shape[1]):
                row[j] -= lr[i] * np.sign(g[i, j])


def test_the_kernel_machinery_takes_any_rule_object() -> None:
    """rules/row_kernels.py compiles and calls whatever kernel a rule object holds, by no name: a
    new rule needs no line there."""
    w = np.zeros((3, 2), np.float32)
    update = row_kernels.row_update(_SignSGD(), OptimizerConfig("sgd"), 2)
    update(w, {}, np.array([2, 0], np.int64), np.array([[1.0, -2.0], [0.0, 3.0]], np.float32), np.array([0.5, 0.25], np.float32))
    assert w.tolist() == [[0.0, -0.25], [0.0, 0.0], [-0.5, 0.5]]
    assert row_kernels.row_kernel(SGD()) is row_kernels.row_kernel(rule("sgd"))


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_a_rule_torch_lacks_still_has_a_torch_optimizer(name: str) -> None:
    """``RuleOptimizer`` (the default ``torch_optimizer`` of a rule with no ``torch.optim`` twin)
    steps parameters of any shape, a transposed one included, as the rule's own torch optimizer
    does, and a group's lr (a scheduler's) scales its steps."""
    gen = torch.Generator().manual_seed(5)
    cfg = OptimizerConfig(name, lr=0.05, weight_decay=0.01, initial_accumulator=0.1)
    shapes = [(6, 4), (7,)]
    ours = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in shapes]
    ours.append(torch.nn.Parameter(torch.randn(4, 3, generator=gen).t()))  # not contiguous
    theirs = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    opt_ours, opt_theirs = RuleOptimizer(rule(name), cfg, ours), rule(name).torch_optimizer(cfg, theirs)
    for step in range(5):
        for a, b in zip(ours, theirs, strict=False):
            a.grad = torch.randn(a.shape, generator=gen)
            b.grad = a.grad.clone()
        if step == 3:
            for o in (opt_ours, opt_theirs):
                o.param_groups[0]["lr"] = 0.02
        opt_ours.step()
        opt_theirs.step()
    for a, b in zip(ours, theirs, strict=False):
        assert torch.allclose(a.detach(), b.detach(), atol=1e-6)
