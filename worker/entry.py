"""Run a user's ``module:function`` as a tether worker: ``python -m tether.worker.entry mod:fn [args...]``.

``tether launch --entry mod:fn`` (and ``torchrun -m tether.worker.entry mod:fn`` in sync mode)
start it; the function is called with no arguments and finds its place in the job with
``TrainingConfig.from_env()``; ``sys.argv`` holds the extra arguments.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable, Sequence

from tether.common.allocator import tune_malloc
from tether.common.exits import DONE, run_command
from tether.protos.errors import UsageError, report_usage_error

__all__ = ["main", "on_path", "resolve"]


def on_path() -> None:
    """Put the current folder first on ``sys.path``, as ``python -m`` does, so ``module`` may be
    a file beside where the job was launched (``tether launch`` itself runs from its script's folder)."""
    here = os.getcwd()
    if not sys.path or sys.path[0] not in ("", here):
        sys.path.insert(0, here)


def resolve(target: str) -> Callable[[], object]:
    """The function ``module:function`` names.

    Raises:
        UsageError: not ``module:function``, or it cannot be imported.
    """
    module, _, name = target.partition(":")
    if not module or not name.isidentifier():
        raise UsageError(f"{target!r}: expected module:function")
    try:
        fn = getattr(importlib.import_module(module), name)
    except ModuleNotFoundError as exc:
        raise UsageError(f"{target}: no module {exc.name!r}") from None
    except AttributeError:
        raise UsageError(f"{target}: module {module!r} has no {name!r}") from None
    if not callable(fn):
        raise UsageError(f"{target}: {name!r} is not callable")
    return fn


def main(argv: Sequence[str] | None = None) -> int:
    """Import and call the function; its return value (an int, or None for 0) is the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv:
        return report_usage_error("tether worker", UsageError("usage: python -m tether.worker.entry module:function [args...]"))
    # Steps free and allocate tensors of MiBs: keep them in the heap (tether.common.allocator).
    tune_malloc()

    def body() -> int:
        on_path()
        fn = resolve(argv[0])
        sys.argv = [argv[0], *argv[1:]]
        result = fn()
        return int(result) if isinstance(result, int) else DONE

    return run_command("tether worker", body)


if __name__ == "__main__":
    sys.exit(main())
