"""The launcher's torch-free path: importing ``tether.deploy.cli`` and the job's config, the
commands' help (``tether worker --help`` too), argparse's errors and the flag checks that come
before a config holds its update rules and row cache never import torch, numba or matplotlib
(about 2.5 CPU-seconds of each command the tests start). The names and defaults those flags
declare are declared once, without torch: the contract's in ``tether.protos.names``, the
client's and the row cache's in ``tether.common.choices``; the modules with torch take them
from there.

Where torch comes in: ``WorkerConfig`` validation of per-table rules (``table_rules`` imports
torch; the row cache's configuration, ``tether.worker.cache.config``, does not, so a refused cache
flag answers without it), the built-in job's evaluation, ``--table-optimizer`` parsing and the
``server``, ``worker`` (past its flags), ``export`` and ``convert`` commands."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

from tether.common import choices
from tether.common.settings import default_of

HEAVY = ("torch", "numba", "matplotlib")

# Runs in a fresh interpreter: every command's exit code, then which heavy modules were imported.
_PROBE = textwrap.dedent("""
    import contextlib, io, sys
    import tether.deploy.cli as cli
    import tether.worker.config
    codes = []
    for argv in (["--help"], ["--version"], ["launch", "--help"], ["compare", "--help"], ["sweep", "--help"],
                 ["launch", "--bogus"], ["launch", "--optimizer", "nope"], ["launch", "--num-shards", "0"],
                 ["launch", "--lr", "-1"], ["compare", "--out", "x", "--mode", "async"],
                 ["worker", "--help"], ["worker", "--bogus"], ["worker", "--local", "--metrics-port", "70000"],
                 ["launch", "--cache-admission", "all"], ["launch", "--cache-rows", "-1"],
                 ["launch", "--mode", "sync", "--cache-rows", "5", "--cache-bound", "2"]):
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            try:
                codes.append(cli.main(argv))
            except SystemExit as exc:
                codes.append(exc.code)
    print(codes)
    print(sorted(m for m in {heavy!r} if m in sys.modules))
""").replace("{heavy!r}", repr(HEAVY))


def test_launcher_help_and_usage_errors_import_no_torch() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TETHER_")}
    out = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 0, out.stderr
    codes, imported = out.stdout.splitlines()[-2:]
    assert codes == "[0, 0, 0, 0, 0, 2, 2, 2, 2, 2, 0, 2, 2, 2, 2, 2]"
    assert imported == "[]", f"the launcher's torch-free path imported {imported}"


def test_worker_config_validation_still_reads_the_rules_and_the_cache() -> None:
    """What moved out of module level is still imported where a config is checked."""
    from tether.worker.config import TrainingConfig

    config = TrainingConfig(local=True, table_optimizers="a=sgd;b=adam:lr=0.01", cache_rows=4, cache_bound=1)
    assert config.table_optimizers == ("a=sgd", "b=adam:lr=0.01")
    assert config.row_cache.rows == 4 and config.row_cache.bound == 1
    assert {n: e.rule for n, e in config.table_rules.entries.items()} == {"a": "sgd", "b": "adam"}


def test_the_modules_with_torch_take_the_torch_free_declarations() -> None:
    """Each name and default is written once: the modules that use them beside torch hold the
    declared objects themselves, not copies (a tuple or float written again is another object)."""
    from tether.protos import codec, names, specs
    from tether.rules import optimizers
    from tether.worker.client.config import ClientConfig

    assert tuple(optimizers._RULES) == names.OPTIMIZERS
    assert default_of(specs.OptimizerConfig, "lr") is names.OPTIMIZER_LR
    assert default_of(specs.TableConfig, "init_scale") is names.INIT_SCALE
    assert tuple(codec.WIRE_DTYPES) == names.WIRE_DTYPE_NAMES
    assert [str(d) for d in codec.WIRE_DTYPES.values()] == [f"torch.{n}" for n in names.WIRE_DTYPE_NAMES]
    assert default_of(ClientConfig, "timeout_s") is choices.CLIENT_TIMEOUT_S
    assert default_of(ClientConfig, "call_deadline_s") is choices.CLIENT_CALL_DEADLINE_S
    assert default_of(ClientConfig, "wire_dtype") is codec.WIRE_DTYPES[choices.CLIENT_WIRE_DTYPE]


def test_the_row_cache_policies_are_the_declared_ones() -> None:
    from tether.worker.cache.config import POLICIES

    assert POLICIES is choices.CACHE_POLICIES
