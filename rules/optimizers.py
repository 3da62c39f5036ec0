"""Update rules of the shards: one object per rule, in one registry (``rule(name)``), with the
hyper-parameters they take (``OptimizerConfig``).

A rule is the one home of everything about its optimizer:

- its state: the tensors it keeps per row or per dense element (``state_shapes``) and what a new
  row's state starts at (``initial_state``);
- its torch form (``apply``): the reference maths, on a dense chunk or on any rows. Dense chunks
  on a shard and every row and dense parameter of local mode (``tether.worker.client.local``) are
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
  (``tether.rules.push_hooks.combine_rows``).

The rules live in ``tether.rules.update_rules`` (the base class and the three with a
``torch.optim`` twin) and ``tether.rules.ctr_rules`` (row-wise Adagrad and FTRL-Proximal);
this module is the registry, and ``rule`` is its one name: import a rule's class from its module
(this module's old re-exports of them, of ``OptimizerConfig`` and of ``OPTIMIZERS`` still work until
tether 0.2, with a ``DeprecationWarning``). The hyper-parameters (``OptimizerConfig``, in
``tether.protos.specs``) and the rules' names (``OPTIMIZERS``, in ``tether.protos.names``) are
declared without torch, so a launcher makes and checks a job's config without importing the
rules. Adding a rule is one subclass, its entry in the registry and its name in
``tether.protos.names`` (plus, for a constant no rule took before, a field of ``OptimizerConfig``
and of its wire form); ``tests/test_optimizers.py`` checks every registered rule's kernel against
its torch form, and its torch form against its torch optimizer, and
``tests/test_rules_combined_kernels.py`` every registered rule's ``combined_rows`` (where it has
one) against its ``apply_combined``. Nothing else names a rule.

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
  ``tether.rules.ctr_rules``.

The row kernels compute in float32 as the torch form does, but the compiler may fuse a
multiply-add or divide by a reciprocal, so the two forms agree within float rounding (rows six
pushes on within 1e-6 in ``tests/test_optimizers.py``; a local table and a shard's 40 pushes
on within 1e-5 in ``tests/test_local_mode.py``).
"""

from __future__ import annotations

from tether.common.moved import old_names
from tether.protos import names
from tether.rules import ctr_rules, update_rules

__all__ = ["rule"]

# The names this module re-exported (the rules' classes, OptimizerConfig, OPTIMIZERS), from their
# modules, until tether 0.2 (with a DeprecationWarning): the registry uses the classes, it does not hold them.
__getattr__ = old_names(__name__)

_RULES: dict[str, update_rules.UpdateRule] = {
    r.name: r
    for r in (update_rules.SGD(), update_rules.Adagrad(), update_rules.Adam(), ctr_rules.RowwiseAdagrad(), ctr_rules.Ftrl())
}
# The names OptimizerConfig.name (and --optimizer) may take are declared without torch
# (tether.protos.names): a rule registered here is one of them, in their order.
if tuple(_RULES) != names.OPTIMIZERS:
    raise ImportError(f"the registered rules {tuple(_RULES)} are not tether.protos.names.OPTIMIZERS {names.OPTIMIZERS}")


def rule(name: str) -> update_rules.UpdateRule:
    """The update rule called ``name``.

    Raises:
        ValueError: no rule has that name.
    """
    names.check_optimizer(name)
    return _RULES[name]
