"""Every shell command the README and docs/ show that can run on a laptop runs here, as a reader
would paste it, so the pages stay true to the code.

Each page's ```bash blocks run in order in one scratch folder (the repository's ``examples``,
``deploy`` and ``bench`` linked into it, so relative paths work), as ``bash -e`` scripts. To keep
the suite CI-sized a command is shrunk before it runs, never otherwise changed: ``--steps``,
``--num-workers``, ``--eval-samples``, ``--call-deadline`` and generated data sizes are capped, a
job (launch, compare, sweep) runs one shard (``--num-shards 1``, also where it names none),
``--repeats`` is 1, mode and bound lists keep their first two entries (a remedy sweep's strengths their first), and
every fixed port moves by one offset to free ones; a command that gives no ``--steps`` or
``--eval-samples`` gets ``TETHER_STEPS=20`` and ``TETHER_EVAL_SAMPLES=1000`` from the environment.
An install step before ``&&`` and the README's venv step are dropped (the suite runs installed). A command is skipped only
for a reason named in ``SKIP``: it needs Docker, Kubernetes or a GPU, is a long-running server
another test covers, or stands for the reader's own code.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

# A command holding one of these is not run here, for the reason given.
SKIP = {
    "docker ": "needs a Docker engine",
    "kubectl ": "needs a Kubernetes cluster",
    "deploy/k8s/*.yaml": "edits the Kubernetes manifests for a registry of your own",
    "--device cuda": "needs a GPU (tests/test_gpu.py runs it on GPU hosts)",
    "CUDA_VISIBLE_DEVICES": "needs a GPU (tests/test_gpu.py runs it on GPU hosts)",
    "--preset gpu": "a GPU-sized model (tests/test_gpu.py runs it on GPU hosts)",
    "python -m pytest": "the test suite itself",
    "prometheus --config.file": "a long-running server: tests/test_prometheus_scrape.py scrapes with this file",
    "mypackage.train:main": "stands for the reader's own module",
    "my_model.py:build": "stands for the reader's own model file",
    "/data/ckpt": "stands for the reader's own live cluster and checkpoint folder",
    "--mode sync --shards 127.0.0.1": "needs the shards of docs/running.md already serving",
}
# Lines dropped from a block that is run: long-running viewers of what the block wrote, and the
# README's venv step (the suite runs in its own environment, installed).
DROP = ("tensorboard --logdir", "python3 -m venv")
# Commands a page shows failing, with the exit code it says they end with.
EXPECTED_EXIT = {"--steps 10 --tls-ca ca.crt --auth-token-file token": 1, "--tls-key worker.key\n": 1}
FIXED_PORTS = re.compile(r"\b(50\d\d\d|9[12]\d\d)\b")


def _blocks(page: Path) -> list[str]:
    return re.findall(r"```bash\n(.*?)```", page.read_text(), re.S)


def _cap(pattern: str, limit: int, text: str) -> str:
    return re.sub(pattern, lambda m: m.group(0).replace(m.group(1), str(min(int(m.group(1)), limit))), text)


def _commands(block: str) -> list[str]:
    """The block's commands: lines with their backslash continuations joined."""
    return block.replace("\\\n", " ").splitlines()


def _runnable(block: str) -> str:
    """The block without the commands ``SKIP`` names and the lines ``DROP`` names."""
    return "\n".join(c for c in _commands(block) if not any(key in c for key in SKIP) and not c.strip().startswith(DROP)) + "\n"


def _shrink(block: str, port_offset: int) -> str:
    block = re.sub(r"python -m pip install [^&\n]*&& ", "", block)
    block = _cap(r"--steps (\d+)", 20, block)
    block = _cap(r"--num-workers (\d+)", 2, block)
    # A job's shards are processes (interpreter, torch, compiled kernels): much of a short run's
    # cost, so a job runs one (a job's default is 2). Only a whole job's count: ``tether server
    # --num-shards`` must match its shard indexes.
    block = "\n".join(_one_shard(line) if re.search(r"tether (launch|compare|sweep)\b", line) else line for line in block.split("\n"))
    block = _cap(r"--eval-samples (\d+)", 1000, block)
    # A command the page shows failing fails at its deadline: the reader's 5 s, 1 s here.
    block = _cap(r"--call-deadline (\d+)", 1, block)
    block = _cap(r"--generate (\d+)", 20000, block)
    block = _cap(r"write_criteo_sample\('[^']+', (\d+)\)", 20000, block)
    block = re.sub(r"--repeats \d+", "--repeats 1", block)
    block = re.sub(r"--(modes|bounds) ([\w:.]+,[\w:.]+)(,[\w:.,]+)?", r"--\1 \2", block)
    # A remedy sweep runs sync and plain async besides its strengths: one strength is enough.
    block = re.sub(r"--strengths ([\d.]+)(,[\d.,]+)?", r"--strengths \1", block)
    return FIXED_PORTS.sub(lambda m: str(int(m.group(1)) + port_offset), block)


def _one_shard(line: str) -> str:
    """A job's command line with ``--num-shards`` capped at 1, or given as 1 where it names none."""
    if "--num-shards" in line:
        return _cap(r"--num-shards (\d+)", 1, line)
    return re.sub(r"(tether (launch|compare|sweep)\b)", r"\1 --num-shards 1", line)


def _port_offset(text: str) -> int:
    """An offset that moves every fixed port the text names (and the next one) to a free port."""
    ports = {int(p) for p in FIXED_PORTS.findall(text)}
    for offset in range(1000, 15000, 97):
        if all(_free(p + offset) and _free(p + offset + 1) for p in ports):
            return offset
    pytest.fail(f"no free ports for {sorted(ports)}")


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _scratch(tmp_path: Path) -> dict[str, str]:
    """Link the repository's folders in and put ``python`` and ``tether`` first on PATH."""
    for name in ("examples", "deploy", "bench"):
        (tmp_path / name).symlink_to(ROOT / name)
    bin_dir = tmp_path / ".bin"
    bin_dir.mkdir()
    # A script, not a symlink: a venv's interpreter started through a link outside the venv does
    # not find its pyvenv.cfg and runs without the venv's packages (tether, torch, grpc).
    python = bin_dir / "python"
    python.write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    python.chmod(0o755)
    tether = bin_dir / "tether"
    tether.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m tether.deploy.cli "$@"\n')
    tether.chmod(0o755)
    return {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "PYTHONUNBUFFERED": "1", "TETHER_STEPS": "20",
            "TETHER_EVAL_SAMPLES": "1000"}


def _pages_with_commands() -> list[Path]:
    return [p for p in PAGES if any(_runnable(b).strip() for b in _blocks(p))]


@pytest.mark.parametrize("page", _pages_with_commands(), ids=lambda p: str(p.relative_to(ROOT)))
def test_the_page_commands_run(page: Path, tmp_path: Path) -> None:
    env = _scratch(tmp_path)
    blocks = _blocks(page)
    offset = _port_offset("\n".join(blocks))
    groups: list[int] = []
    try:
        _run_blocks(page, blocks, offset, env, tmp_path, groups)
    finally:
        # Background processes the blocks started (shards with '&') go with the page.
        _stop_leftovers(set(groups), f"TETHER_DOCS_CWD={tmp_path / '.cwd'}")


def _stop_leftovers(groups: set[int], marker: str) -> None:
    """SIGTERM every process still in one of the blocks' process groups that carries ``marker``
    in its environment. Not ``killpg``: a block's group whose processes have all exited frees its
    number, and on a busy machine (pids wrap within minutes) a later session leader can get it:
    another test's block, whose bash then died of this page's cleanup (exit -15, no output)."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            pgid = int(stat.rpartition(")")[2].split()[2])  # after the command name: state, ppid, pgrp
            if pgid in groups and marker.encode() in Path(f"/proc/{entry}/environ").read_bytes().split(b"\0"):
                os.kill(int(entry), signal.SIGTERM)
        except (OSError, ValueError, IndexError):
            continue


def _run_blocks(page: Path, blocks: list[str], offset: int, env: dict[str, str], tmp_path: Path, groups: list[int]) -> None:
    """Run a page's blocks in order."""
    cwd = tmp_path
    for block in blocks:
        runnable = _runnable(block)
        if not runnable.strip():
            continue
        script = _shrink(runnable, offset)
        expected = next((code for key, code in EXPECTED_EXIT.items() if key in block), 0)
        # A block may cd (the worked example of docs/security-and-faults.md): the next one goes on there.
        # Output goes to a file, not a pipe: processes a block leaves in the background ('&')
        # keep their copy of it open, and a pipe would not end until they do.
        log = tmp_path / f".block-{len(groups)}.log"
        with log.open("w") as sink:
            proc = subprocess.Popen(["bash", "-ec", script + '\npwd > "$TETHER_DOCS_CWD"\n'], cwd=cwd, env={**env, "TETHER_DOCS_CWD": str(tmp_path / ".cwd")},
                                    stdout=sink, stderr=subprocess.STDOUT, start_new_session=True)
        groups.append(proc.pid)
        try:
            proc.wait(timeout=240)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        out = log.read_text(errors="replace")
        assert proc.returncode == expected, f"{page.name}: exit {proc.returncode} (expected {expected}) for\n{script}\n--- output ---\n{out[-3000:]}"
        if expected == 0:
            cwd = Path((tmp_path / ".cwd").read_text().strip())


def test_the_skip_list_names_commands_that_exist() -> None:
    """Every ``SKIP`` entry matches a command of the docs (a stale entry is a reason for nothing)
    and leaves the pages with commands to run."""
    commands = [c for p in PAGES for b in _blocks(p) for c in _commands(b)]
    unused = [key for key in SKIP if not any(key in c for c in commands)]
    assert not unused, f"SKIP entries that match no command in the docs: {unused}"
    assert len(_pages_with_commands()) >= 8


def test_ci_runs_the_readme_test_command_in_the_readme_venv() -> None:
    """The README's test block makes a virtual environment first (a stock Debian/Ubuntu Python
    refuses pip outside one), and ``.ci/run`` makes that environment, installs into it and runs
    the README's test command there, as a reader would."""
    readme = (ROOT / "README.md").read_text()
    (test_block,) = [b for b in _blocks(ROOT / "README.md") if "python -m pytest" in b]
    venv_line, command = [c.strip() for c in _commands(test_block) if c.strip()]
    assert venv_line == "python3 -m venv .venv && . .venv/bin/activate", test_block
    assert readme.count(venv_line) >= 2, "the quick start makes the environment too"
    ci = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert venv_line in ci, "CI makes the README's virtual environment"
    installs = [n for n, line in enumerate(ci) if "pip install" in line]
    assert installs and ci.index(venv_line) < min(installs), "CI installs into the environment, not beside it"
    assert all(line.startswith("python -m pip") for line in ci if "pip install" in line), "the environment's python installs"
    run_tests = command.split("&& ")[-1]
    assert ci[-1] == run_tests, f"CI ends with the README's test command {run_tests!r}, not {ci[-1]!r}"


def test_the_docs_python_is_the_suites_interpreter(tmp_path: Path) -> None:
    """``python`` on the pages' PATH imports what the suite's interpreter imports: tether from this
    checkout, also when the suite runs in a virtual environment (a symlink to a venv's
    interpreter from outside the venv loses its ``pyvenv.cfg`` and its packages)."""
    env = _scratch(tmp_path)
    out = subprocess.run(["python", "-c", "import sys, tether.worker; print(sys.prefix); print(tether.worker.__path__[0])"],
                         env=env, capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    import tether.worker

    assert out.stdout.split("\n")[:2] == [sys.prefix, tether.worker.__path__[0]], out.stdout


def test_the_readme_sample_progress_line_names_the_metrics_the_job_prints() -> None:
    """The README's sample final line shows the held-out metrics under the names a worker prints
    (``tether.worker.training.evaluation.evaluate``'s keys), not shortened ones."""
    import torch

    from tether.worker.data.synthetic import Batch
    from tether.worker.training.evaluation import evaluate

    (line,) = [ln for ln in (ROOT / "README.md").read_text().splitlines() if ln.startswith("[worker-0]") and "eval_loss" in ln]
    shown = re.findall(r" ([a-z_]+) \d\.\d{4}", line.split(" elapsed ", 1)[1])
    printed = evaluate(lambda dense, sparse: dense[:, 0], Batch(torch.tensor([[0.1], [0.9]]), torch.zeros(2, 1, dtype=torch.int64),
                                                                 torch.tensor([0.0, 1.0])))
    assert shown == list(printed), (shown, list(printed))
