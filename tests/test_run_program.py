"""``tether.deploy.run_program``: the shim torchrun runs in sync mode instead of the user's program
(whose flags torchrun's parser would take: ``--n`` for ``--nnodes``). It runs the script or module
``TETHER_PROGRAM_ARGV`` names as ``python`` would, with its own traceback and exit code."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tether.deploy.run_program import program_env
from tether.deploy.worker_exits import root_cause

_SCRIPT = """import json, sys
import helper_beside
print(json.dumps({"argv": sys.argv, "name": __name__, "path0": sys.path[0], "helper": helper_beside.X}))
if "--fail" in sys.argv:
    raise RuntimeError("failed on purpose")
sys.exit(int(sys.argv[-1]) if sys.argv[-1].isdigit() else 0)
"""


def _program(tmp_path: Path) -> Path:
    folder = tmp_path / "prog"
    folder.mkdir()
    (folder / "helper_beside.py").write_text("X = 7\n")
    (folder / "user_script.py").write_text(_SCRIPT)
    return folder


def _run(argv: list[str], prefix: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, **program_env(argv)}
    return subprocess.run([sys.executable, *prefix, "-m", "tether.deploy.run_program"], capture_output=True, text=True,
                          timeout=120, env=env, cwd=cwd)


def test_a_script_runs_as_python_would_with_its_exit_code_and_traceback(tmp_path: Path) -> None:
    folder = _program(tmp_path)
    script = str(folder / "user_script.py")
    proc = _run([script, "--n", "5", "3"], [], tmp_path)
    assert proc.returncode == 3, proc.stderr
    # Its folder first on sys.path (helper_beside imported), __main__, the argv it was given.
    assert json.loads(proc.stdout) == {"argv": [script, "--n", "5", "3"], "name": "__main__", "path0": str(folder), "helper": 7}
    failed = _run([script, "--fail"], [], tmp_path)
    assert failed.returncode == 1 and failed.stderr.strip().splitlines()[-1] == "RuntimeError: failed on purpose"


def test_a_module_runs_as_python_m_would(tmp_path: Path) -> None:
    folder = _program(tmp_path)
    proc = _run(["-m", "user_script", "--n", "5", "--x"], [], folder)  # found in the current folder, as python -m finds it
    assert proc.returncode == 0, proc.stderr
    seen = json.loads(proc.stdout)
    assert seen["argv"] == [str(folder / "user_script.py"), "--n", "5", "--x"] and seen["name"] == "__main__"


def test_under_torchrun_the_scripts_flags_reach_it_and_its_exit_code_is_the_ranks(tmp_path: Path) -> None:
    folder = _program(tmp_path)
    script = str(folder / "user_script.py")
    torchrun = ["-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "1", "--log-dir", str(tmp_path / "ranks"), "--tee", "2"]
    proc = _run([script, "--n", "5", "3"], torchrun, tmp_path)
    (tmp_path / "torchrun.log").write_text(proc.stdout + proc.stderr)
    assert proc.returncode == 1 and "ambiguous option" not in proc.stderr, proc.stderr[-2000:]
    assert '"argv": [' + json.dumps(script) + ', "--n", "5", "3"]' in proc.stdout
    found = root_cause(tmp_path / "torchrun.log")
    assert found is not None and found[:2] == ("rank 0", 3)


_SUMMARY = """
[rank1]: RuntimeError: user error on purpose in rank 1
============================================================
failed
------------------------------------------------------------
Failures:
[1]:
  time      : 2026-12-06_15:38:48
  host      : box
  rank      : 1 (local_rank: 1)
  exitcode  : -15 (pid: 14149)
  error_file: <N/A>
  traceback : Signal 15 (SIGTERM) received by PID 14149
[2]:
  time      : 2026-12-06_15:38:48
  host      : box
  rank      : 2 (local_rank: 2)
  exitcode  : 1 (pid: 14150)
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-12-06_15:38:48
  host      : box
  rank      : 0 (local_rank: 0)
  exitcode  : 1 (pid: 14148)
============================================================
"""
_GONE = "[rank{r}]: RuntimeError: [pair.cc:553] Connection closed by peer [127.0.0.1]:13513. This is typically caused by a remote worker crashing."


@pytest.mark.parametrize(("rank1_last", "cause"), [
    ("[rank1]: RuntimeError: user error on purpose in rank 1", ("rank 1", -15)),  # the rank that raised, though torchrun saw it last
    (_GONE.format(r=1), ("rank 0", 1)),  # every rank only saw another go: torchrun's own choice stands
])
def test_the_root_cause_is_the_rank_whose_error_is_its_own(tmp_path: Path, rank1_last: str, cause: tuple[str, int]) -> None:
    """A rank that raised can exit after the ranks whose all-reduce then failed with 'connection
    closed by peer'; torchrun names the first to exit, the launcher the one that caused it."""
    (tmp_path / "torchrun.log").write_text(_SUMMARY)
    for rank, last in ((0, _GONE.format(r=0)), (1, rank1_last), (2, _GONE.format(r=2))):
        folder = tmp_path / "ranks" / "run" / "attempt_0" / str(rank)
        folder.mkdir(parents=True)
        (folder / "stderr.log").write_text(f"[rank{rank}]: Traceback (most recent call last):\n{last}\n")
    found = root_cause(tmp_path / "torchrun.log")
    assert found is not None and found[:2] == cause
    assert found[2] == tmp_path / "ranks" / "run" / "attempt_0" / cause[0].split()[1] / "stderr.log"
