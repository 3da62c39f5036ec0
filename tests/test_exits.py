"""The one exit-code mapping every ``tether`` command uses (``tether.common.exits``): 0 done, 1 a
command's own failure, 2 a usage error (one line), 130 Ctrl-C; a bug keeps its traceback."""

from __future__ import annotations

import signal

import pytest

from tether.common.exits import DONE, FAILED, INTERRUPTED, USAGE, interrupted, run_command, usage_checks
from tether.deploy.errors import ClusterError, Interrupted
from tether.protos.errors import USAGE_EXIT_CODE, UsageError


def _raise(exc: BaseException) -> int:
    raise exc


def test_codes() -> None:
    assert (DONE, FAILED, USAGE, INTERRUPTED) == (0, 1, 2, 130)
    assert USAGE == USAGE_EXIT_CODE
    assert interrupted(130) and interrupted(-signal.SIGINT)
    assert not any(interrupted(code) for code in (0, 1, 2, -signal.SIGKILL, -signal.SIGTERM))


def test_body_return_value_is_the_exit_code(capsys: pytest.CaptureFixture[str]) -> None:
    assert run_command("tether x", lambda: 0) == 0
    assert run_command("tether x", lambda: 7) == 7
    assert capsys.readouterr().err == ""


def test_usage_error_is_one_line_and_code_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert run_command("tether x", lambda: _raise(UsageError("--lr must be\n  > 0, got -1"))) == 2
    assert capsys.readouterr().err.splitlines() == ["tether x: error: --lr must be > 0, got -1"]


def test_usage_checks_turn_value_errors_into_usage_errors(capsys: pytest.CaptureFixture[str]) -> None:
    def body() -> int:
        with usage_checks():
            raise ValueError("--steps must be >= 1, got 0")

    assert run_command("tether x", body) == 2
    assert capsys.readouterr().err == "tether x: error: --steps must be >= 1, got 0\n"


def test_a_value_error_outside_the_checks_is_a_bug_and_keeps_its_traceback() -> None:
    with pytest.raises(ValueError, match="bug"):
        run_command("tether x", lambda: _raise(ValueError("bug")), failures=(ClusterError,))


def test_named_failures_are_code_1_with_their_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert run_command("tether launch", lambda: _raise(ClusterError("worker-1 exited with code 3")), failures=(ClusterError,)) == 1
    assert capsys.readouterr().err == "tether launch: worker-1 exited with code 3\n"
    with pytest.raises(ClusterError):
        run_command("tether launch", lambda: _raise(ClusterError("not named: propagates")))


def test_ctrl_c_is_130_quiet_or_said(capsys: pytest.CaptureFixture[str]) -> None:
    assert run_command("tether worker", lambda: _raise(KeyboardInterrupt())) == 130
    assert capsys.readouterr().err == ""
    assert run_command("tether launch", lambda: _raise(KeyboardInterrupt()), say_interrupted=True) == 130
    assert capsys.readouterr().err == "tether launch: interrupted\n"
    assert run_command("tether launch", lambda: _raise(Interrupted(3)), failures=(ClusterError,), say_interrupted=True) == 130
    assert capsys.readouterr().err == "tether launch: interrupted; stopped 3 processes\n"
