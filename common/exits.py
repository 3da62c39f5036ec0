"""What a ``tether`` command exits with, in one place: 0 done, 1 failed, 2 the user asked for
something it cannot do (argparse's code, ``tether.protos.errors.USAGE_EXIT_CODE``), 130
interrupted (the shell's code for SIGINT). ``run_command`` maps how a command's body ended to
that code and its one line on stderr; ``usage_checks`` marks the flag checks whose
``ValueError`` is the user's mistake; ``interrupted`` reads a child's code."""

from __future__ import annotations

import logging
import os
import signal
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from tether.protos.errors import USAGE_EXIT_CODE, UsageError, report_usage_error

__all__ = ["DONE", "FAILED", "INTERRUPTED", "USAGE", "exit_process", "interrupted", "run_command", "usage_checks"]

DONE = 0
FAILED = 1
USAGE = USAGE_EXIT_CODE
INTERRUPTED = 130


def interrupted(code: int) -> bool:
    """Whether a child's exit ``code`` says Ctrl-C stopped it (it exited 130, or SIGINT killed it)."""
    return code in (INTERRUPTED, -signal.SIGINT)


def exit_process(code: int) -> None:
    """End a process whose work is done (its output written, its files closed) with ``code``,
    without the interpreter's teardown: collecting the torch and numba heap at exit takes about
    a second of CPU (3 s on a busy machine) after a shard has already stopped. Flushes the
    standard streams and the log handlers first; exit handlers (``atexit``) do not run."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    logging.shutdown()
    os._exit(code)


@contextmanager
def usage_checks() -> Iterator[None]:
    """Checks of what the user asked for (flags, before anything runs): a ``ValueError`` raised
    inside is a ``UsageError``, reported as one line with exit code ``USAGE``.

    Raises:
        UsageError: a check inside refused a value.
    """
    try:
        yield
    except UsageError:
        raise
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def run_command(
    prog: str, body: Callable[[], int], *, failures: tuple[type[Exception], ...] = (), say_interrupted: bool = False
) -> int:
    """Run a command's ``body`` and return its exit code: what it returns; ``USAGE`` after
    ``prog: error: ...`` for a ``UsageError``; ``FAILED`` after ``prog: <error>`` for one of
    ``failures`` (the command's own failures, such as a process of the job that died);
    ``INTERRUPTED`` for Ctrl-C, after ``prog: <its message or 'interrupted'>`` when
    ``say_interrupted`` (a launcher says what it stopped; a child of one stays quiet).
    Anything else propagates, with its traceback: a bug is not a usage error."""
    try:
        return body()
    except UsageError as exc:
        return report_usage_error(prog, exc)
    except failures as exc:
        print(f"{prog}: {exc}", file=sys.stderr, flush=True)
        return FAILED
    except KeyboardInterrupt as exc:
        if say_interrupted:
            print(f"{prog}: {str(exc) or 'interrupted'}", file=sys.stderr, flush=True)
        return INTERRUPTED
