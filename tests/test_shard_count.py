"""``tether launch``'s shard count when ``--num-shards`` is not given (tether.deploy.shard_count):
2 where the workers train on the CPU; on a GPU host one shard per core the GPU workers leave (2
each), at least 2 and at most 16, the cores left over as the shards' kernel threads; an explicit
``--num-shards`` always wins. The rule is a pure function, tested here without a GPU; the
launcher's own path is tested with its GPU count and cores faked."""

from __future__ import annotations

from typing import Any

import pytest

from tether.deploy import cli
from tether.deploy.shard_count import MAX_SHARDS, ShardCount, choose_shards, gpu_workers


def _count(given: int | None = None, *, gpus: int = 1, cores: int = 16, workers: int = 1, device: str = "auto") -> ShardCount:
    return choose_shards(given, gpus=gpus, cores=cores, num_workers=workers, device=device)


def test_a_cpu_host_keeps_two_shards() -> None:
    for cores in (1, 2, 16, 128):
        c = _count(gpus=0, cores=cores, workers=4)
        assert (c.num_shards, c.kernel_threads, c.env({})) == (2, None, {})
        assert "CPU" in c.why
    # Workers put on the CPU of a GPU host are CPU workers.
    assert _count(gpus=8, device="cpu").num_shards == 2


def test_a_gpu_host_gives_its_cores_to_the_shards() -> None:
    # The H100/H200 hosts of bench/gpu_check.sh: 16 cores, one GPU worker (main + transfer threads).
    c = _count(gpus=1, cores=16, workers=1)
    assert (c.num_shards, c.kernel_threads) == (14, 1)
    assert c.env({}) == {"TETHER_KERNEL_THREADS": "1"}
    assert "1 GPU worker(s) leave of 16" in c.why and "--num-shards" in c.why
    assert c.line().startswith("tether: 14 shard(s): ")
    # Two workers on two GPUs: 12 cores left.
    assert _count(gpus=2, cores=16, workers=2).num_shards == 12
    # More workers than GPUs (round robin): every worker is a GPU worker, keeping its two cores.
    assert _count(gpus=2, cores=16, workers=4).num_shards == 8
    # An explicit cuda:N, and sync's ranks (cuda), are GPU workers too.
    assert _count(gpus=4, cores=16, workers=2, device="cuda:1").num_shards == 12
    assert _count(gpus=4, cores=16, workers=4, device="cuda").num_shards == 8


def test_the_count_is_clamped_and_spare_cores_become_kernel_threads() -> None:
    # Nothing left (8 GPUs on 16 cores): at least 2 shards, one kernel thread each.
    c = _count(gpus=8, cores=16, workers=8)
    assert (c.num_shards, c.kernel_threads) == (2, 1)
    assert _count(gpus=1, cores=2, workers=1).num_shards == 2
    # A big host: at most 16 shards, the cores past one each as kernel threads (at most 4).
    c = _count(gpus=1, cores=64, workers=1)
    assert (c.num_shards, c.kernel_threads) == (MAX_SHARDS, 3)
    assert _count(gpus=1, cores=256, workers=1).kernel_threads == 4


def test_num_shards_given_always_wins() -> None:
    for gpus, cores in ((0, 2), (1, 16), (8, 192)):
        c = _count(5, gpus=gpus, cores=cores)
        assert (c.num_shards, c.kernel_threads, c.env({})) == (5, None, {})


def test_the_users_kernel_threads_are_left_alone() -> None:
    assert _count(gpus=1, cores=16).env({"TETHER_KERNEL_THREADS": "3"}) == {}


def test_gpu_workers() -> None:
    assert [gpu_workers(d, 3, 2) for d in ("auto", "cuda", "cuda:1", "cpu")] == [3, 3, 3, 0]
    assert gpu_workers("auto", 3, 0) == 0


def _launched(argv: list[str], monkeypatch: pytest.MonkeyPatch, gpus: int, cores: int) -> dict[str, Any]:
    """What ``tether launch ARGV`` hands run_job on a host with ``gpus`` GPUs and ``cores`` cores (faked)."""
    import tether.deploy.children
    import tether.deploy.job
    import tether.deploy.shard_count

    for name in ("TETHER_KERNEL_THREADS", "TETHER_DEVICE", "TETHER_PRESET"):
        monkeypatch.delenv(name, raising=False)
    seen: dict[str, Any] = {}

    def run_job(template: Any, num_shards: int, **kw: Any) -> dict[str, Any]:
        seen.update(kw, num_shards=num_shards, template=template)
        raise KeyboardInterrupt  # stop here: no process is started

    monkeypatch.setattr(tether.deploy.job, "run_job", run_job)
    monkeypatch.setattr(tether.deploy.children, "gpu_count", lambda: gpus)
    monkeypatch.setattr(tether.deploy.shard_count, "host_cores", lambda: cores)
    cli.main(["launch", "--num-workers", "1", "--steps", "1", *argv])
    return seen


def test_launch_chooses_the_count_on_a_gpu_host_and_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    seen = _launched([], monkeypatch, gpus=1, cores=16)
    assert seen["num_shards"] == 14
    assert seen["shard_env"] == {"TETHER_KERNEL_THREADS": "1"}
    assert "1 GPU worker(s) leave of 16" in seen["shards_why"]
    seen = _launched(["--num-shards", "3"], monkeypatch, gpus=1, cores=16)
    assert (seen["num_shards"], seen["shard_env"], seen["shards_why"]) == (3, {}, None)
    # Without GPU workers: 2, and the start line is what it was.
    seen = _launched(["--device", "cpu"], monkeypatch, gpus=1, cores=16)
    assert (seen["num_shards"], seen["shard_env"], seen["shards_why"]) == (2, {}, None)
    seen = _launched([], monkeypatch, gpus=0, cores=16)
    assert (seen["num_shards"], seen["shards_why"]) == (2, None)


def test_launch_refuses_a_num_shards_below_one(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["launch", "--num-shards", "0", "--num-workers", "1", "--steps", "1"]) == 2
    assert "--num-shards must be >= 1, got 0" in capsys.readouterr().err


def test_run_job_starts_the_shards_with_their_kernel_threads_and_says_why(
        tmp_path: Any, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    import tether.deploy.job
    from tether.deploy.errors import ClusterError
    from tether.worker.config import WorkerConfig

    seen: dict[str, Any] = {}

    class _Cluster:
        log_dir = tmp_path
        stopped = 0

        def __init__(self, **kw: Any) -> None:
            pass

        def __enter__(self) -> _Cluster:
            return self

        def __exit__(self, *exc: object) -> None:
            pass

        def start_shards(self, num_shards: int, extra_args: Any = (), metrics: bool = False, env: Any = None,
                         config: Any = None) -> list[str]:
            seen.update(num_shards=num_shards, env=env)
            return [f"127.0.0.1:{1000 + i}" for i in range(num_shards)]

        def start_workers(self, *a: Any, **kw: Any) -> None:
            raise ClusterError("stop here")

    monkeypatch.setattr(tether.deploy.job, "LocalCluster", _Cluster)
    count = _count(gpus=1, cores=16)
    with pytest.raises(ClusterError):
        tether.deploy.job.run_job(WorkerConfig(shards=("pending:0",), steps=1), count.num_shards, out=tmp_path,
                                  shard_env=count.env({}), shards_why=count.why)
    assert seen == {"num_shards": 14, "env": {"TETHER_KERNEL_THREADS": "1"}}
    line = capsys.readouterr().out.strip().splitlines()[0]
    assert line.startswith("tether: 14 shard(s) (one per core that 1 GPU worker(s) leave of 16") and "starting 1 worker(s)" in line
