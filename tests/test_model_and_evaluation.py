import pytest
import torch
import torch.nn.functional as F

from tether.worker.data import SyntheticClickLog, SyntheticConfig
from tether.worker.evaluation import auc, constant_baseline_loss, log_loss
from tether.worker.model import CTRModel


def test_auc_matches_hand_computed_values() -> None:
    labels = torch.tensor([0.0, 0, 1, 1])
    assert auc(torch.tensor([0.1, 0.4, 0.35, 0.8]), labels) == 0.75
    assert auc(torch.tensor([0.0, 0.1, 0.2, 0.3]), labels) == 1.0
    assert auc(torch.tensor([0.3, 0.2, 0.1, 0.0]), labels) == 0.0
    # Ties count half: one positive tied with one negative.
    assert auc(torch.tensor([0.1, 0.5, 0.5, 0.9]), labels) == 0.875
    with pytest.raises(ValueError, match="needs both classes"):
        auc(torch.tensor([0.1, 0.2]), torch.tensor([1.0, 1.0]))


def test_log_loss_and_constant_baseline() -> None:
    labels = torch.tensor([1.0, 0.0, 0.0, 1.0])
    assert log_loss(torch.zeros(4), labels) == pytest.approx(0.693147, abs=1e-6)
    assert constant_baseline_loss(0.5, labels) == pytest.approx(0.693147, abs=1e-6)
    assert constant_baseline_loss(0.25, torch.tensor([1.0, 0, 0, 0])) == pytest.approx(0.562335, abs=1e-6)
    with pytest.raises(ValueError, match="must be non-empty and alike"):
        log_loss(torch.zeros(3), labels)


def test_model_shapes_and_tables() -> None:
    torch.manual_seed(0)
    model = CTRModel(num_dense=13, num_sparse=5, embedding_dim=8)
    assert model.table_names() == [f"cat_{j}" for j in range(5)]
    out = model(torch.randn(7, 13), torch.randint(0, 2**62, (7, 5)))
    assert out.shape == (7,)
    torch.manual_seed(0)
    again = CTRModel(num_dense=13, num_sparse=5, embedding_dim=8)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), again.parameters()))


def test_in_process_training_beats_the_constant_predictor() -> None:
    gen = SyntheticClickLog(SyntheticConfig(vocab_size=5000))
    held_out = gen.eval_set(5000)
    torch.manual_seed(0)
    model = CTRModel(13, 8)
    opt = torch.optim.Adagrad(model.parameters(), lr=0.05)
    rates = []
    for batch in gen.batches(256, 300):
        loss = F.binary_cross_entropy_with_logits(model(batch.dense, batch.sparse), batch.labels)
        opt.zero_grad()
        loss.backward()
        opt.step()
        rates.append(float(batch.labels.mean()))
    with torch.no_grad():
        logits = model(held_out.dense, held_out.sparse)
    baseline = constant_baseline_loss(sum(rates) / len(rates), held_out.labels)
    assert log_loss(logits, held_out.labels) < baseline - 0.05
    assert auc(logits, held_out.labels) > 0.75
