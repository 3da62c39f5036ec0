"""``--preset`` sizes the built-in model; a flag or its TETHER_* variable for one field wins."""

from __future__ import annotations

import pytest

from tether.protos.errors import UsageError
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


def _window(argv: list[str]) -> int:
    return load_config(["--shards", "127.0.0.1:1", *argv]).push_window


def test_the_gpu_preset_hides_a_round_trip_behind_two_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    """``--preset gpu`` in async (with prefetching) keeps 2 pushes in flight: a step's push carries
    the pull of the batch two steps on. ssp, sync and --no-prefetch land every push before the next
    pull (K > 1 is refused there), so the preset leaves them at 1; a flag or variable given wins."""
    for name in ("TETHER_PRESET", "TETHER_PUSH_WINDOW", "TETHER_MODE", "TETHER_PREFETCH", "TETHER_NO_PREFETCH"):
        monkeypatch.delenv(name, raising=False)
    assert _window([]) == 1
    assert _window(["--preset", "gpu"]) == 2
    assert _window(["--preset", "gpu", "--mode", "async"]) == 2
    for refused in (["--mode", "ssp:2"], ["--mode", "ssp:0"], ["--mode", "sync"], ["--no-prefetch"]):
        assert _window(["--preset", "gpu", *refused]) == 1, refused
    # A flag given wins, also when it equals the default's value.
    assert _window(["--preset", "gpu", "--push-window", "1"]) == 1
    assert _window(["--preset", "gpu", "--push-window", "3"]) == 3
    assert _window(["--push-window", "2"]) == 2
    monkeypatch.setenv("TETHER_PUSH_WINDOW", "1")
    assert _window(["--preset", "gpu"]) == 1
    monkeypatch.delenv("TETHER_PUSH_WINDOW")
    monkeypatch.setenv("TETHER_PRESET", "gpu")
    assert _window([]) == 2
    # The preset's window is still checked as a flag's is: K > 1 given outright in ssp is refused.
    with pytest.raises(UsageError, match="--push-window 2: pushes in flight are for async"):
        _window(["--mode", "ssp:1", "--push-window", "2"])


def test_the_gpu_preset_window_reaches_a_launched_worker(monkeypatch: pytest.MonkeyPatch) -> None:
    """``tether launch --preset gpu``'s template, which every worker's config file is written
    from, holds the window; the sizes stay MODEL_PRESETS' alone."""
    import tether.deploy.job
    from tether.deploy import cli

    for name in ("TETHER_PRESET", "TETHER_PUSH_WINDOW", "TETHER_MODE"):
        monkeypatch.delenv(name, raising=False)
    seen = {}

    def run_job(template: object, num_shards: int, **kw: object) -> dict:
        seen["template"] = template
        raise KeyboardInterrupt

    monkeypatch.setattr(tether.deploy.job, "run_job", run_job)
    cli.main(["launch", "--preset", "gpu", "--num-shards", "1", "--num-workers", "1", "--steps", "1", "--device", "cpu"])
    t = seen["template"]
    assert (t.push_window, t.batch_size, t.num_sparse, t.embedding_dim) == (2, 8192, 26, 128)
    assert set(MODEL_PRESETS["gpu"]) == {"batch_size", "num_sparse", "embedding_dim"}


def test_compare_runs_the_presets_window_in_async_only(monkeypatch: pytest.MonkeyPatch, tmp_path: object) -> None:
    """``tether compare --preset gpu`` (or ``--push-window 2``) builds one template for every mode:
    its async runs keep the window, its ssp:S and sync runs push one at a time (a window above 1
    is refused there) and their line says so."""
    from pathlib import Path

    import tether.deploy.compare as compare
    from tether.worker.config import WorkerConfig
    from tether.worker.training.mode import Mode

    seen: list[object] = []

    def run_job(cfg: object, num_shards: int, **kw: object) -> dict:
        seen.append(cfg)
        raise KeyboardInterrupt

    monkeypatch.setattr(compare, "run_job", run_job)
    template = WorkerConfig(shards=("pending:0",), steps=1, push_window=2)
    lines: list[str] = []
    for mode in ("async", "ssp:1", "sync"):
        with pytest.raises(KeyboardInterrupt):
            compare._run_one(template, Mode(mode), 0, 1, 1, Path(str(tmp_path)), "none", 60.0, False, lines.append)
    assert [(c.mode, c.push_window) for c in seen] == [("async", 2), ("ssp:1", 1), ("sync", 1)]  # type: ignore[attr-defined]
    assert "push window" not in lines[0] and "push window 1, not 2: ssp:1 lands every push" in lines[1]
