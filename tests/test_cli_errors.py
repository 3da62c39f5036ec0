"""A user's mistake ends with one line naming the bad value and exit code 2, never a traceback,
and ``tether launch`` finds what it can up front, before any process starts. Ctrl-C stops a
launched job quietly. Every case runs the real command in a subprocess."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

SMALL = ["--batch-size", "64", "--vocab-size", "1000", "--eval-samples", "500"]


def _tether(args: list[str], timeout: float = 90, env: dict[str, str] | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "tether.deploy.cli", *args], capture_output=True, text=True, timeout=timeout, env=env, cwd=cwd
    )


def _assert_one_line(proc: subprocess.CompletedProcess, prog: str, *names: str) -> str:
    """Exit 2, no traceback anywhere, and stderr is one line ``prog: error: ...`` naming ``names``."""
    assert proc.returncode == 2, (proc.returncode, proc.stdout[-2000:], proc.stderr[-4000:])
    assert "Traceback" not in proc.stderr and "Traceback" not in proc.stdout, proc.stderr[-4000:]
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr[-4000:]
    assert lines[0].startswith(f"{prog}: error: "), lines[0]
    for name in names:
        assert name in lines[0], (name, lines[0])
    return lines[0]


@pytest.fixture
def busy_port() -> Iterator[int]:
    """A port with a listening socket on every address."""
    with socket.socket() as s:
        s.bind(("0.0.0.0", 0))
        s.listen()
        yield s.getsockname()[1]


def _broken_criteo(tmp_path: Path) -> Path:
    data = tmp_path / "broken.tsv"
    data.write_text("1\t2\t3\n")
    return data


def test_worker_missing_criteo_file(tmp_path: Path) -> None:
    proc = _tether(["worker", "--shards", "127.0.0.1:1", "--data", "criteo:missing.tsv", "--steps", "2"], cwd=tmp_path)
    line = _assert_one_line(proc, "tether worker", "--data criteo:missing.tsv")
    assert "no such file" in line


def test_launch_missing_criteo_file_starts_nothing(tmp_path: Path) -> None:
    out = tmp_path / "job"
    proc = _tether(["launch", "--data", "criteo:missing.tsv", "--steps", "5", "--out", str(out), *SMALL], cwd=tmp_path)
    _assert_one_line(proc, "tether launch", "criteo:missing.tsv", "no such file")
    # Refused before any shard started: no logs at all (a started shard writes its log there first).
    assert not (out / "logs").exists(), list(out.rglob("*"))


@pytest.mark.parametrize("command", ["compare", "sweep"])
def test_compare_and_sweep_check_the_data_file_up_front(tmp_path: Path, command: str) -> None:
    out = tmp_path / "cmp"
    proc = _tether([command, "--data", "criteo:missing.tsv", "--steps", "5", "--out", str(out), *SMALL], cwd=tmp_path)
    _assert_one_line(proc, f"tether {command}", "criteo:missing.tsv")
    assert not list(out.rglob("*.log")) if out.exists() else True


def test_worker_malformed_criteo_line(tmp_path: Path) -> None:
    data = _broken_criteo(tmp_path)
    proc = _tether(["worker", "--shards", "127.0.0.1:1", "--data", f"criteo:{data}", "--steps", "2", "--device", "cpu"])
    line = _assert_one_line(proc, "tether worker", f"{data}:1")
    assert "expected 40 tab-separated columns, got 3" in line


def test_launch_malformed_criteo_line_stops_with_the_workers_line(tmp_path: Path) -> None:
    data = _broken_criteo(tmp_path)
    out = tmp_path / "job"
    proc = _tether(
        ["launch", "--num-shards", "1", "--num-workers", "2", "--data", f"criteo:{data}", "--steps", "5", "--device", "cpu", "--out", str(out)],
        timeout=120,
    )
    line = _assert_one_line(proc, "tether launch", "broken.tsv:1", "expected 40 tab-separated columns")
    assert "worker-" in line
    for log in (out / "logs").glob("*.log"):
        assert "Traceback" not in log.read_text(), log


@pytest.mark.parametrize("command", ["server", "worker"])
def test_metrics_port_in_use(busy_port: int, command: str) -> None:
    args = ["--port", "0"] if command == "server" else ["--shards", "127.0.0.1:1", "--steps", "2"]
    proc = _tether([command, *args, "--metrics-port", str(busy_port)])
    line = _assert_one_line(proc, f"tether {command}", f"--metrics-port {busy_port}")
    assert "in use" in line


def test_worker_shard_address_without_port() -> None:
    proc = _tether(["worker", "--shards", "localhost", "--steps", "2"])
    _assert_one_line(proc, "tether worker", "--shards", "'localhost'")


def test_worker_sync_mode_outside_torchrun() -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    proc = _tether(["worker", "--shards", "127.0.0.1:1", "--mode", "sync", "--steps", "2", "--device", "cpu"], env=env)
    _assert_one_line(proc, "tether worker", "--mode sync", "torchrun", "tether launch --mode sync")


def _alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.timeout(240)
@pytest.mark.parametrize("target", ["group", "launcher"])
def test_ctrl_c_on_launch_stops_quietly(tmp_path: Path, target: str) -> None:
    """Ctrl-C in a terminal signals the whole process group; ``kill -INT`` only the launcher.
    Either way: no traceback from anyone, exit 130, one line, and no process left."""
    out = tmp_path / "job"
    stdout, stderr = tmp_path / "stdout.txt", tmp_path / "stderr.txt"
    argv = [sys.executable, "-m", "tether.deploy.cli", "launch", "--num-shards", "1", "--num-workers", "2", "--steps", "1000000",
            "--log-every", "5", "--device", "cpu", "--out", str(out), *SMALL]
    # As from a terminal: a pytest started in the background (`cmd &` in a script) ignores SIGINT,
    # and an ignored signal stays ignored across exec; a handler is reset to the default there.
    default = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with stdout.open("w") as so, stderr.open("w") as se:
            proc = subprocess.Popen(argv, stdout=so, stderr=se, start_new_session=True)
    finally:
        signal.signal(signal.SIGINT, default)
    try:
        deadline = time.monotonic() + 150
        while not all(f"[worker-{i}] worker {i}/2 step" in stdout.read_text() for i in range(2)):
            assert proc.poll() is None, stdout.read_text()[-3000:] + stderr.read_text()[-3000:]
            assert time.monotonic() < deadline, "workers did not start training: " + stdout.read_text()[-3000:]
            time.sleep(0.2)
        if target == "group":
            os.killpg(proc.pid, signal.SIGINT)
        else:
            proc.send_signal(signal.SIGINT)
        code = proc.wait(timeout=60)
        texts = {"stdout": stdout.read_text(), "stderr": stderr.read_text()}
        texts.update({log.name: log.read_text() for log in (out / "logs").glob("*.log")})
        for name, text in texts.items():
            assert "Traceback" not in text, (name, text[-4000:])
        assert code == 130, texts
        lines = [line for line in texts["stderr"].splitlines() if line.strip()]
        assert lines == ["tether launch: interrupted; stopped 3 processes"], texts["stderr"]
        deadline = time.monotonic() + 15
        while _alive(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(proc.pid), "a launched process outlived the launcher"
    finally:
        if _alive(proc.pid):
            os.killpg(proc.pid, signal.SIGKILL)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
