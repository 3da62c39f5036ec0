"""Metrics: log loss, AUC (with ties), the constant predictor's loss, and ``evaluate``."""

import itertools
import math

import numpy as np
import pytest
import torch
from fake_cuda import FakeCuda, on_fake_cuda
from torch import nn

from tether.worker.data.synthetic import Batch
from tether.worker.training.evaluation import auc, constant_baseline_loss, evaluate, log_loss


def _pairwise_auc(scores: list[float], labels: list[int]) -> float:
    """AUC by definition: P(score of a positive > score of a negative), ties counting half."""
    pos = [s for s, y in zip(scores, labels, strict=False) if y]
    neg = [s for s, y in zip(scores, labels, strict=False) if not y]
    wins = sum(1.0 if p > n else 0.5 if p == n else 0.0 for p, n in itertools.product(pos, neg))
    return wins / (len(pos) * len(neg))


def test_auc_with_tied_groups_by_hand() -> None:
    scores = torch.tensor([0.1, 0.4, 0.4, 0.4, 0.8, 0.8])
    labels = torch.tensor([0.0, 0, 1, 1, 0, 1])
    # Positives 0.4, 0.4 score 1 + 0.5 + 0 each; positive 0.8 scores 1 + 1 + 0.5: 5.5 of 9 pairs.
    assert auc(scores, labels) == pytest.approx(5.5 / 9, abs=1e-12)
    assert auc(torch.full((6,), 0.3), labels) == 0.5  # all tied: no information


def test_auc_matches_the_pairwise_definition_on_random_ties() -> None:
    rng = np.random.default_rng(0)
    for _ in range(5):
        scores = rng.integers(0, 6, 200).astype(float)  # heavy ties
        labels = (rng.random(200) < 0.3).astype(int)
        got = auc(torch.tensor(scores), torch.tensor(labels, dtype=torch.float32))
        assert got == pytest.approx(_pairwise_auc(scores.tolist(), labels.tolist()), abs=1e-12)


def test_auc_perfect_inverted_and_invariant_to_monotone_maps() -> None:
    labels = torch.tensor([0.0, 1, 0, 1, 1, 0])
    perfect = labels * 2 - 1 + torch.linspace(0, 0.1, 6)
    assert auc(perfect, labels) == 1.0
    assert auc(-perfect, labels) == 0.0
    logits = torch.tensor([0.3, -1.2, 2.0, 0.1, 0.3, -0.5])
    assert auc(torch.sigmoid(logits), labels) == auc(logits, labels)


def test_auc_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="needs both classes; got 0 positives and 3 negatives"):
        auc(torch.tensor([0.1, 0.2, 0.3]), torch.zeros(3))
    with pytest.raises(ValueError, match="scores must be finite, got 1 non-finite"):
        auc(torch.tensor([0.1, float("nan"), 0.3]), torch.tensor([0.0, 1, 1]))
    with pytest.raises(ValueError, match=r"scores \(3,\) and labels \(2,\) differ in shape"):
        auc(torch.zeros(3), torch.zeros(2))


def test_log_loss_by_hand_and_stable_at_extremes() -> None:
    logits = torch.tensor([2.0, -1.0, 0.5])
    labels = torch.tensor([1.0, 0.0, 0.0])
    p = [1 / (1 + math.exp(-x)) for x in logits.tolist()]
    want = -(math.log(p[0]) + math.log(1 - p[1]) + math.log(1 - p[2])) / 3
    assert log_loss(logits, labels) == pytest.approx(want, abs=1e-12)
    # A confident wrong logit costs its size; sigmoid-then-log would give inf here.
    assert log_loss(torch.tensor([1000.0]), torch.tensor([0.0])) == pytest.approx(1000.0)
    assert log_loss(torch.tensor([-1000.0]), torch.tensor([0.0])) == 0.0


def test_constant_baseline_matches_log_loss_of_a_constant_logit() -> None:
    labels = torch.tensor([1.0, 0, 0, 1, 0, 0, 0, 1])
    p = 0.3
    assert constant_baseline_loss(p, labels) == pytest.approx(log_loss(torch.full((8,), math.log(p / (1 - p)), dtype=torch.float64), labels), abs=1e-12)
    # p = 0 with a positive label is clamped: large and finite, not inf.
    assert constant_baseline_loss(0.0, labels) == pytest.approx(-math.log(1e-7) * 3 / 8, rel=1e-6)
    with pytest.raises(ValueError, match=r"p must be a probability, got 1.5"):
        constant_baseline_loss(1.5, labels)
    with pytest.raises(ValueError, match="labels must be non-empty"):
        constant_baseline_loss(0.5, torch.zeros(0))


class _Probe(nn.Module):
    """Logit = first dense feature; records the mode and grad state of each call."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(1))
        self.calls: list[tuple[bool, bool, int]] = []

    def forward(self, dense: torch.Tensor, sparse: torch.Tensor) -> torch.Tensor:
        self.calls.append((self.training, torch.is_grad_enabled(), dense.shape[0]))
        return dense[:, 0] * self.w


def test_evaluate_chunks_without_grad_in_eval_mode_and_restores_mode() -> None:
    dense = torch.tensor([[0.1], [2.0], [-1.0], [0.5], [-0.3], [1.5], [0.0], [-2.0], [0.7], [0.2]])
    labels = torch.tensor([0.0, 1, 0, 1, 0, 1, 1, 0, 0, 1])
    batch = Batch(dense, torch.zeros(10, 1, dtype=torch.int64), labels)
    probe = _Probe()
    result = evaluate(probe, batch, batch_size=4)
    assert [c[2] for c in probe.calls] == [4, 4, 2]
    assert all(not training and not grad for training, grad, _ in probe.calls)
    assert probe.training
    assert result["eval_loss"] == pytest.approx(log_loss(dense[:, 0], labels), abs=1e-12)
    assert result["eval_auc"] == pytest.approx(_pairwise_auc(dense[:, 0].tolist(), labels.int().tolist()), abs=1e-12)
    probe.eval()
    evaluate(probe, batch)
    assert not probe.training  # a model that was in eval mode stays there
    with pytest.raises(ValueError, match="batch_size must be >= 1, got 0"):
        evaluate(probe, batch, batch_size=0)


def test_metrics_take_gpu_tensors_and_labels_left_on_another_device() -> None:
    scores = torch.tensor([0.1, 0.4, 0.4, 0.4, 0.8, 0.8, -2.0, 3.0])
    labels = torch.tensor([0.0, 0, 1, 1, 0, 1, 0, 1])
    want = (log_loss(scores, labels), auc(scores, labels), constant_baseline_loss(0.4, labels))
    with FakeCuda():
        # Both on the GPU (a user's per-batch metric); scores brought back, labels not (B1).
        for s, y in ((scores.cuda(), labels.cuda()), (scores, labels.cuda()), (scores.cuda(), labels)):
            assert (log_loss(s, y), auc(s, y), constant_baseline_loss(0.4, y)) == want


def test_evaluate_a_gpu_model_on_a_batch_on_the_gpu_or_the_host() -> None:
    dense = torch.tensor([[0.1], [2.0], [-1.0], [0.5], [-0.3], [1.5], [0.0], [-2.0], [0.7], [0.2]])
    labels = torch.tensor([0.0, 1, 0, 1, 0, 1, 1, 0, 0, 1])
    batch = Batch(dense, torch.zeros(10, 1, dtype=torch.int64), labels)
    want = evaluate(_Probe(), batch, batch_size=4)
    with FakeCuda():
        probe = on_fake_cuda(_Probe())
        # Trainer.evaluate moves the batch to the model's device first; a user may not.
        assert evaluate(probe, Batch(*(t.cuda() for t in batch)), batch_size=4) == want
        assert evaluate(probe, batch, batch_size=4) == want
