"""Server-side update rules: SGD, Adagrad (per-row state) and Adam (per-row state and step).

Each rule updates a block of parameters in place from its gradient. For embedding tables the
block is the gathered rows of one push (the table scatters them back); for dense chunks it
is the chunk itself.
"""

from __future__ import annotations

import torch

from tether.protos.specs import OPTIMIZERS, OptimizerConfig

__all__ = ["OPTIMIZERS", "OptimizerConfig", "state_shapes", "step"]

def state_shapes(cfg: OptimizerConfig, dim: int) -> dict[str, tuple[int, ...]]:
    """Per-row state tensors the rule keeps, as name -> trailing shape."""
    if cfg.name == "adagrad":
        return {"sum": (dim,)}
    if cfg.name == "adam":
        return {"m": (dim,), "v": (dim,), "t": ()}
    return {}


def step(
    cfg: OptimizerConfig,
    w: torch.Tensor,
    g: torch.Tensor,
    state: dict[str, torch.Tensor],
    lr_scale: float = 1.0,
) -> None:
    """Apply one update in place.

    Args:
        cfg: the rule.
        w: parameters, updated in place (rows x dim, or a flat chunk).
        g: gradient, same shape as ``w``.
        state: the rule's state for these parameters, updated in place; Adam's ``t`` holds
            one step count per row (a scalar for a dense chunk).
        lr_scale: multiplier on the learning rate (staleness-aware learning rates).
    """
    lr = cfg.lr * lr_scale
    if cfg.weight_decay:
        g = g + cfg.weight_decay * w
    if cfg.name == "sgd":
        w.add_(g, alpha=-lr)
    elif cfg.name == "adagrad":
        acc = state["sum"]
        acc.addcmul_(g, g)
        w.addcdiv_(g, acc.sqrt().add_(cfg.eps), value=-lr)
    else:
        m, v, t = state["m"], state["v"], state["t"]
        t.add_(1)
        m.mul_(cfg.beta1).add_(g, alpha=1 - cfg.beta1)
        v.mul_(cfg.beta2).addcmul_(g, g, value=1 - cfg.beta2)
        tt = t.unsqueeze(-1) if w.dim() > 1 else t
        bc1 = 1 - torch.pow(cfg.beta1, tt)
        bc2 = 1 - torch.pow(cfg.beta2, tt)
        denom = (v / bc2).sqrt_().add_(cfg.eps)
        w.addcdiv_(m / bc1, denom, value=-lr)
