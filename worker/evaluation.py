"""Held-out metrics: log loss, AUC, and the constant predictor's loss."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

__all__ = ["auc", "constant_baseline_loss", "log_loss"]


def log_loss(logits: torch.Tensor, labels: torch.Tensor) -> float:
    """Mean binary cross-entropy of ``logits`` against 0/1 ``labels`` (numerically stable).

    Raises:
        ValueError: shapes differ or there are no samples.
    """
    if logits.shape != labels.shape or logits.numel() == 0:
        raise ValueError(f"logits {tuple(logits.shape)} and labels {tuple(labels.shape)} must be non-empty and alike")
    return float(F.binary_cross_entropy_with_logits(logits.double(), labels.double()))


def auc(scores: torch.Tensor, labels: torch.Tensor) -> float:
    """Area under the ROC curve (Mann-Whitney U with average ranks for ties).

    Raises:
        ValueError: shapes differ, or the labels hold only one class.
    """
    if scores.shape != labels.shape:
        raise ValueError(f"scores {tuple(scores.shape)} and labels {tuple(labels.shape)} differ in shape")
    s = scores.double().reshape(-1)
    y = labels.reshape(-1) > 0.5
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
    p = min(max(p, 1e-7), 1 - 1e-7)
    y = labels.double()
    return float(-(y * math.log(p) + (1 - y) * math.log(1 - p)).mean())
