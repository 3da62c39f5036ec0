"""Held-out metrics: log loss, AUC, and the constant predictor's loss.

The metrics take tensors on any device (scores and labels may even be on different ones) and
compute on the CPU in float64: held-out scores are small next to a step's traffic, and float64
is slow or missing on accelerators.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

from tether.worker.data.synthetic import Batch

__all__ = ["auc", "constant_baseline_loss", "evaluate", "log_loss"]


def _host(t: torch.Tensor) -> torch.Tensor:
    """``t`` as float64 on the CPU, where every metric here computes."""
    return t.detach().to("cpu", torch.float64)


def log_loss(logits: torch.Tensor, labels: torch.Tensor) -> float:
    """Mean binary cross-entropy of ``logits`` against 0/1 ``labels`` (numerically stable).

    Raises:
        ValueError: shapes differ or there are no samples.
    """
    if logits.shape != labels.shape or logits.numel() == 0:
        raise ValueError(f"logits {tuple(logits.shape)} and labels {tuple(labels.shape)} must be non-empty and alike")
    return float(F.binary_cross_entropy_with_logits(_host(logits), _host(labels)))


def auc(scores: torch.Tensor, labels: torch.Tensor) -> float:
    """Area under the ROC curve (Mann-Whitney U with average ranks for ties).

    Raises:
        ValueError: shapes differ, or the labels hold only one class.
    """
    if scores.shape != labels.shape:
        raise ValueError(f"scores {tuple(scores.shape)} and labels {tuple(labels.shape)} differ in shape")
    s = _host(scores).reshape(-1)
    if not bool(torch.isfinite(s).all()):
        # A NaN would sort arbitrarily and give a meaningless number instead of an error.
        raise ValueError(f"scores must be finite, got {int((~torch.isfinite(s)).sum())} non-finite values")
    y = _host(labels).reshape(-1) > 0.5
    pos, neg = int(y.sum()), int((~y).sum())
    if pos == 0 or neg == 0:
        raise ValueError(f"AUC needs both classes; got {pos} positives and {neg} negatives")
    order = torch.argsort(s)
    sorted_s = s[order]
    ranks = torch.empty_like(s)
    ranks[order] = torch.arange(1, s.numel() + 1, dtype=torch.float64)
    # Average the ranks within each group of tied scores.
    _, inverse, counts = torch.unique_consecutive(sorted_s, return_inverse=True, return_counts=True)
    ends = torch.cumsum(counts, 0).double()
    avg = ends - (counts.double() - 1) / 2
    ranks[order] = avg[inverse]
    return float((ranks[y].sum() - pos * (pos + 1) / 2) / (pos * neg))


def constant_baseline_loss(p: float, labels: torch.Tensor) -> float:
    """Log loss of always predicting probability ``p`` (clamped away from 0 and 1)."""
    if not 0 <= p <= 1:
        raise ValueError(f"p must be a probability, got {p!r}")
    if labels.numel() == 0:
        raise ValueError("labels must be non-empty")
    p = min(max(p, 1e-7), 1 - 1e-7)
    y = _host(labels)
    return float(-(y * math.log(p) + (1 - y) * math.log(1 - p)).mean())


def evaluate(model: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], batch: Batch, batch_size: int = 4096) -> dict[str, float]:
    """Held-out log loss and AUC of an in-process ``model(dense, sparse) -> logits``.

    Runs in eval mode without gradients, in chunks of ``batch_size`` on the model's device,
    and puts the model back in the mode it was in.

    Returns:
        ``{"eval_loss": ..., "eval_auc": ...}``.

    Raises:
        ValueError: ``batch_size < 1``, an empty batch, or labels of one class only.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size!r}")
    n = batch.labels.numel()
    if n == 0:
        raise ValueError("cannot evaluate on an empty batch")
    module = model if isinstance(model, torch.nn.Module) else None
    param = next(module.parameters(), None) if module is not None else None
    device = param.device if param is not None else torch.device("cpu")
    was_training = module.training if module is not None else False
    if module is not None:
        module.eval()
    logits = []
    try:
        with torch.no_grad():
            for start in range(0, n, batch_size):
                part = Batch(*(t[start : start + batch_size] for t in batch))
                logits.append(model(part.dense.to(device), part.sparse.to(device)).float())
    finally:
        if module is not None:
            module.train(was_training)
    # One copy to the host for all the chunks, not one (and a wait for the device) per chunk.
    scores = torch.cat(logits).cpu()
    return {"eval_loss": log_loss(scores, batch.labels), "eval_auc": auc(scores, batch.labels)}
