"""Update rules of the shards: one object per rule, in one registry (``rule(name)``), with the
hyper-parameters they take (``OptimizerConfig``).

A rule is the one home of everything about its optimizer:

- its state: the tensors it keeps per row or per dense element (``state_shapes``) and what a new
  row's state starts at (``initial_state``);
- its torch form (``apply``): the reference maths, on a dense chunk or on any rows. Dense chunks
  on a shard and every row and dense parameter of local mode (``tether.worker.local``) are
  stepped with it;
- its row kernel (``rows``): the same maths written as plain loops for numba, which updates the
  rows a push names in place. The shard compiles it (``tether.server.kernels``, lazily and
  cached on disk; this module never imports numba, so a worker does not pay for it) and applies
  it to its embedding tables;
- its ``torch_optimizer``: the ``torch.optim`` optimizer that takes the same steps, with which a
  sync worker steps its own dense parameters;
- its combined push (``combined_stats``, ``combine``, ``apply_combined``): what a worker's row cache
  sends beside a row's gradients of k steps summed, and the one update that stands for the k
  steps (torch form), with, where the rule has one, its kernel (``combined_rows``, compiled as
  ``rows`` is: ``tether.server.kernels.combined_update``); shards and local mode apply the
  combined rows of a push with the kernel where there is one, else the torch form
  (``tether.server.push_hooks.combine_rows``).

The rules live in ``tether.protos.update_rules`` (the base class and the three with a
``torch.optim`` twin) and ``tether.protos.ctr_rules`` (row-wise Adagrad and FTRL-Proximal);
this module is the registry and the hyper-parameters, and every name is importable from here.
Adding a rule is one subclass and its entry in the registry (plus, for a constant no rule
took before, a field of ``OptimizerConfig`` and of its wire form); ``tests/test_optimizers.py``
checks every registered rule's kernel against its torch form, and its torch form against its
torch optimizer, and ``tests/test_rules_combined_kernels.py`` every registered rule's
``combined_rows`` (where it has one) against its ``apply_combined``. Nothing else names a rule.

The rules, with ``g`` the gradient plus ``weight_decay * w`` (L2, added to the gradient as
``torch.optim`` does; not AdamW's decoupled decay) and ``lr`` the configured rate times the
push's factor (1, or less for an unusually stale push under ``--staleness-aware``):

- ``sgd``: ``w -= lr * g``. No state, no momentum.
- ``adagrad``: ``sum += g * g``, then ``w -= lr * g / (sqrt(sum) + eps)``: ``eps`` outside the
  square root, as in ``torch.optim.Adagrad``, but ``eps`` defaults to **1e-8** here where torch's
  default is 1e-10 (pass ``eps=1e-8`` to match); ``sum`` starts at ``initial_accumulator``
  (default 0, torch's ``initial_accumulator_value``); no learning-rate decay.
- ``adam``: ``m = beta1 * m + (1 - beta1) * g``, ``v = beta2 * v + (1 - beta2) * g * g``, ``t += 1``,
  then ``w -= lr * (m / (1 - beta1**t)) / (sqrt(v / (1 - beta2**t)) + eps)``, with ``beta1`` 0.9,
  ``beta2`` 0.999 and ``eps`` 1e-8 by default (torch's defaults; ``eps`` added after the bias
  correction, as torch does; the corrections are taken in float64, as torch takes them);
  ``m`` and ``v`` start at 0. An embedding row keeps its own ``t``: the number of pushes that
  named it, not the table's, so a rare row's first steps get the full bias correction. A dense
  chunk has one ``t``.
- ``rowwise_adagrad``: one accumulator per embedding row, ``sum += mean(g * g)`` over the row,
  then ``w -= lr * g / (sqrt(sum) + eps)`` (FBGEMM's ``EXACT_ROWWISE_ADAGRAD``; ``eps`` 1e-8,
  ``sum`` from ``initial_accumulator``, default 0): 1 float of state per row. A push names each
  id once and a worker sums the gradients of an id's lookups before pushing it, as FBGEMM sums
  duplicates before it applies the rule once. Dense values (no rows) are stepped with Adagrad,
  its per-element form (``UpdateRule.dense_rule``).
- ``ftrl``: FTRL-Proximal (McMahan et al. 2013, Algorithm 1) per element with ``alpha`` =
  ``lr``, ``beta`` (default 1), ``l1`` and ``l2`` (default 0) and ``lr_power`` (default -0.5, the
  paper's square root; TensorFlow's ``learning_rate_power``); state ``z`` and ``n`` per element,
  ``n`` from ``initial_accumulator`` (default 0, as in the paper; TensorFlow starts at 0.1).
  ``w = 0`` where ``|z| <= l1``. The formulas, and how to take TensorFlow's steps, are in
  ``tether.protos.ctr_rules``.

The row kernels compute in float32 as the torch form does, but the compiler may fuse a
multiply-add or divide by a reciprocal, so the two forms agree within float rounding (rows six
pushes on within 1e-6 in ``tests/test_optimizers.py``; a local table and a shard's 40 pushes
on within 1e-5 in ``tests/test_local_mode.py``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from tether.protos import tether_pb2 as pb
from tether.protos.ctr_rules import Ftrl, RowwiseAdagrad
from tether.protos.schedules import Schedule
from tether.protos.update_rules import SGD, Adagrad, Adam, RuleOptimizer, UpdateRule

__all__ = [
    "OPTIMIZERS", "Adagrad", "Adam", "Ftrl", "OptimizerConfig", "RowwiseAdagrad", "RuleOptimizer", "SGD", "UpdateRule", "rule",
]


_RULES: dict[str, UpdateRule] = {r.name: r for r in (SGD(), Adagrad(), Adam(), RowwiseAdagrad(), Ftrl())}
# The names ``OptimizerConfig.name`` (and ``--optimizer``) may take.
OPTIMIZERS: tuple[str, ...] = tuple(_RULES)


def rule(name: str) -> UpdateRule:
    """The update rule called ``name``.

    Raises:
        ValueError: no rule has that name.
    """
    try:
        return _RULES[name]
    except KeyError:
        raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {name!r}") from None


@dataclass(frozen=True)
class OptimizerConfig:
    """Hyper-parameters of one table's or dense chunk's update rule."""

    name: str = "adagrad"
    lr: float = 0.05
    # Adam's moment decays (torch's defaults).
    beta1: float = 0.9
    beta2: float = 0.999
    # Adagrad's and Adam's denominator term: 1e-8 for both (torch.optim.Adagrad's default is 1e-10).
    eps: float = 1e-8
    # L2 penalty, added to the gradient before the rule (as torch.optim does).
    weight_decay: float = 0.0
    # Adagrad's and row-wise Adagrad's starting sum of squares (torch's initial_accumulator_value),
    # FTRL's starting n (the paper's 0; TensorFlow's Ftrl starts at 0.1).
    initial_accumulator: float = 0.0
    # FTRL-Proximal (tether.protos.ctr_rules): the paper's beta, L1 and L2 (its lambda_1, lambda_2;
    # TensorFlow's l2_regularization_strength is half of l2), and the accumulator's power in the
    # per-coordinate rate (TensorFlow's learning_rate_power; -0.5 is the paper's square root).
    beta: float = 1.0
    l1: float = 0.0
    l2: float = 0.0
    lr_power: float = -0.5
    # The rate over time, by the pushing worker's clock (tether.protos.schedules; default constant).
    schedule: Schedule = Schedule()

    def __post_init__(self) -> None:
        rule(self.name)  # ValueError naming the rules there are
        # A checkpoint's JSON gives the schedule as a mapping (an old one gives none).
        object.__setattr__(self, "schedule", Schedule.coerce(self.schedule))
        if not (self.lr > 0 and self.lr < float("inf")):
            raise ValueError(f"lr must be a positive finite number, got {self.lr!r}")
        if not 0 <= self.beta1 < 1 or not 0 <= self.beta2 < 1:
            raise ValueError(f"betas must be in [0, 1), got ({self.beta1!r}, {self.beta2!r})")
        if not self.eps > 0:
            raise ValueError(f"eps must be > 0, got {self.eps!r}")
        if self.weight_decay < 0 or self.initial_accumulator < 0:
            raise ValueError(
                f"weight_decay and initial_accumulator must be >= 0, got {self.weight_decay!r}, {self.initial_accumulator!r}"
            )
        self._check_ftrl()

    def _check_ftrl(self) -> None:
        for key in ("beta", "l1", "l2"):
            value = getattr(self, key)
            if not (0 <= value < math.inf):
                raise ValueError(f"{key} must be a finite number >= 0, got {value!r}")
        if not (-math.inf < self.lr_power <= 0):
            raise ValueError(f"lr_power must be a finite number <= 0 (TensorFlow's learning_rate_power), got {self.lr_power!r}")
        if self.name == "ftrl" and self.lr_power != 0 and not (self.beta > 0 or self.l2 > 0 or self.initial_accumulator > 0):
            # Else a coordinate whose squared gradients are all 0 in float32 but whose z is not
            # would divide by zero.
            raise ValueError("ftrl needs beta > 0, l2 > 0 or initial_accumulator > 0 (all three are 0)")

    def to_proto(self) -> pb.OptimizerSpec:
        """Wire form."""
        return pb.OptimizerSpec(
            name=self.name, lr=self.lr, beta1=self.beta1, beta2=self.beta2, eps=self.eps,
            weight_decay=self.weight_decay, initial_accumulator=self.initial_accumulator,
            schedule=self.schedule.to_proto(), beta=self.beta, l1=self.l1, l2=self.l2, lr_power=self.lr_power,
        )

    @classmethod
    def from_proto(cls, spec: pb.OptimizerSpec) -> OptimizerConfig:
        """Validated config from the wire form (unset fields take the defaults).

        Raises:
            ValueError: a field out of range.
        """
        d = cls()
        return cls(
            name=spec.name or d.name, lr=spec.lr or d.lr, beta1=spec.beta1 or d.beta1, beta2=spec.beta2 or d.beta2,
            eps=spec.eps or d.eps, weight_decay=spec.weight_decay, initial_accumulator=spec.initial_accumulator,
            schedule=Schedule.from_proto(spec.schedule),
            # beta and lr_power are optional on the wire: 0 is a value, unset is the default.
            beta=spec.beta if spec.HasField("beta") else d.beta, l1=spec.l1, l2=spec.l2,
            lr_power=spec.lr_power if spec.HasField("lr_power") else d.lr_power,
        )
