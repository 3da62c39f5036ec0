"""What a ``tether`` command exits with, in one place: 0 done, 1 failed, 2 the user asked for
something it cannot do (argparse's code, ``tether.protos.errors.USAGE_EXIT_CODE``), 130
interrupted (the shell's code for SIGINT). ``run_command`` maps how a command's body ended to
that code and its one line on stderr; ``usage_checks`` marks the flag checks whose
``ValueError`` is the user's mistake; ``end_usage_errors_in_one_line`` does what ``tether worker``
does for a ``UsageError`` or ``TetherError`` left uncaught in a user's own program; ``interrupted`` reads a child's
code."""

from __future__ import annotations

import atexit
import io
import logging
import os
import signal
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import TracebackType

from tether.protos.errors import USAGE_EXIT_CODE, TetherError, UsageError, report_usage_error

__all__ = [
    "DONE", "FAILED", "INTERRUPTED", "USAGE", "end_usage_errors_in_one_line", "exit_process", "interrupted", "run_command",
    "usage_checks",
]

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


# The hook end_usage_errors_in_one_line installed last (it installs one only where it is not the hook).
_hook: Callable[[type[BaseException], BaseException, TracebackType | None], None] | None = None


def end_usage_errors_in_one_line(prog: str = "tether worker") -> None:
    """Have a ``UsageError`` that nothing caught end this program as ``tether worker`` ends on
    one: ``prog: error: <message>`` as one line on stderr and exit code ``USAGE``, not a
    traceback and 1; and a ``TetherError`` (a shard call that failed after its retries, such as
    ``Unavailable`` from shards that cannot be reached) as ``tether worker`` ends on one:
    ``prog: <kind>: <message>`` as one line and exit code ``FAILED``. Called where a user's
    program enters tether (``Trainer``, ``TrainingConfig.from_env``); ``prog`` is the name
    ``tether launch`` reads a worker's usage line by (``deploy/worker_exits.py``).

    It wraps ``sys.excepthook`` once per process and changes only how tether's own errors end
    an uncaught program: every other exception (the user's own) goes to the hook that was
    there before, with its traceback; an error caught by the program never reaches the
    hook. Only the main thread's: an exception ending another thread does not end the program
    (``threading.excepthook`` is left alone). The process ends after the exit handlers
    (``atexit``) ran and the streams were flushed, without waiting for non-daemon threads.
    """
    global _hook
    previous = sys.excepthook
    if previous is _hook:
        return

    def hook(kind: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
        if issubclass(kind, UsageError):
            report_usage_error(prog, exc)
            code = USAGE
        elif issubclass(kind, TetherError):
            # The line tether worker prints for a failed shard call (its exit code too).
            print(f"{prog}: {kind.__name__}: {' '.join(str(exc).split())}", file=sys.stderr, flush=True)
            code = FAILED
        else:
            previous(kind, exc, tb)
            return
        _print_captured(sys.stderr)
        atexit._run_exitfuncs()  # noqa: SLF001 - the interpreter's exit handlers, which os._exit skips
        exit_process(code)

    sys.excepthook = _hook = hook


def _print_captured(stream: object) -> None:
    """Write to the process's stderr what a hook wrapping ours collected in ``stream``: it would
    print it once ours returned, and ours ends the process instead. ``torch.distributed``'s
    ``init_process_group`` wraps the hook so (to prefix each line with the rank): without this a
    sync rank's usage error ended it with exit code 2 and no line at all."""
    if isinstance(stream, io.StringIO) and sys.__stderr__ is not None and stream is not sys.__stderr__:
        sys.__stderr__.write(stream.getvalue())
        sys.__stderr__.flush()


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
