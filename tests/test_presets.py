"""``--preset`` sizes the built-in model; a flag or its TETHER_* variable for one field wins."""

from __future__ import annotations

import pytest

from tether.worker.config import MODEL_PRESETS
from tether.worker.flags import load_config


def _size(argv: list[str]) -> tuple[int, int, int]:
    c = load_config(["--shards", "127.0.0.1:1", *argv])
    return c.batch_size, c.num_sparse, c.embedding_dim


def test_presets_size_the_model(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("TETHER_PRESET", "TETHER_BATCH_SIZE", "TETHER_NUM_SPARSE", "TETHER_EMBEDDING_DIM"):
        monkeypatch.delenv(name, raising=False)
    assert _size([]) == (256, 8, 16)
    assert _size(["--preset", "gpu"]) == (8192, 26, 128)
    assert MODEL_PRESETS["gpu"] == {"batch_size": 8192, "num_sparse": 26, "embedding_dim": 128}
    # A flag given wins over the preset, field by field, also when it equals the default's value.
    assert _size(["--preset", "gpu", "--batch-size", "256"]) == (256, 26, 128)
    assert _size(["--embedding-dim", "32"]) == (256, 8, 32)
    monkeypatch.setenv("TETHER_PRESET", "gpu")
    monkeypatch.setenv("TETHER_NUM_SPARSE", "4")
    assert _size([]) == (8192, 4, 128)


def test_an_unknown_preset_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        load_config(["--shards", "127.0.0.1:1", "--preset", "huge"])
    assert exc.value.code == 2
    assert "invalid choice: 'huge'" in capsys.readouterr().err
