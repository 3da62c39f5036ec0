"""Run a user's program as a ``torchrun`` rank: ``torchrun ... -m tether.deploy.run_program``.

torchrun's parser classifies every argument after the program too, so a script's own flag that
is a prefix of one of torchrun's (``--n``: ``--nnodes``, ``--nproc-per-node``) is taken as one.
So torchrun gets no user arguments: the program's argv comes in ``TETHER_PROGRAM_ARGV`` (a JSON
list: ``script.py args...`` or ``-m module args...``), and this runs it as ``python`` would:
``sys.argv`` restored, a script with its folder first on ``sys.path`` and ``__name__ ==
"__main__"``, a module with ``alter_sys`` (as ``-m``). Its exceptions and ``SystemExit`` pass
through unchanged, so the rank's traceback and exit code are the program's own.
"""

from __future__ import annotations

import json
import os
import runpy
import sys
from collections.abc import Sequence

__all__ = ["ENV", "main", "program_env"]

ENV = "TETHER_PROGRAM_ARGV"


def program_env(argv: Sequence[str]) -> dict[str, str]:
    """The environment that hands ``argv`` (what comes after ``python``) to ``main``."""
    return {ENV: json.dumps(list(argv))}


def main() -> None:
    """Run the program ``TETHER_PROGRAM_ARGV`` names in this process."""
    try:
        argv = json.loads(os.environ[ENV])
    except (KeyError, ValueError):
        sys.exit(f"tether: {ENV} must hold the program's argv as a JSON list (set by tether launch)")
    if not isinstance(argv, list) or not argv or not all(isinstance(a, str) for a in argv):
        sys.exit(f"tether: {ENV} must hold the program's argv as a non-empty JSON list of strings")
    if argv[0] == "-m":
        if len(argv) < 2:
            sys.exit(f"tether: {ENV}: -m needs a module")
        # python -m puts the current folder first on sys.path: so does ``python -m`` of this shim.
        sys.argv = argv[1:]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        return
    script = os.path.abspath(argv[0])
    sys.argv = [argv[0], *argv[1:]]
    sys.path[0] = os.path.dirname(script)  # python script.py: the script's folder, not the current one
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
