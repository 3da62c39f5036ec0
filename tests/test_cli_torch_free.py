"""The launcher's torch-free path: importing ``tether.deploy.cli`` and the job's config, the
commands' help, argparse's errors and the flag checks that come before a config holds its
update rules and row cache never import torch, numba or matplotlib (about 2.5 CPU-seconds of
each command the tests start); and the torch-free copies of the choices those flags declare
(``tether.common.choices``) agree with the modules that use them.

Where torch comes in: ``WorkerConfig`` validation (its per-table rules, ``table_rules``, and its
row cache, ``cache_parts``, both import torch), the built-in job's evaluation, ``--table-optimizer``
parsing and the ``server``, ``worker``, ``export`` and ``convert`` commands."""

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
                 ["launch", "--lr", "-1"], ["compare", "--out", "x", "--mode", "async"]):
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
    assert codes == "[0, 0, 0, 0, 0, 2, 2, 2, 2, 2]"
    assert imported == "[]", f"the launcher's torch-free path imported {imported}"


def test_worker_config_validation_still_reads_the_rules_and_the_cache() -> None:
    """What moved out of module level is still imported where a config is checked."""
    from tether.worker.config import ClientConfig, TrainingConfig
    from tether.worker.client_config import ClientConfig as Client

    assert ClientConfig is Client
    config = TrainingConfig(local=True, table_optimizers="a=sgd;b=adam:lr=0.01", cache_rows=4, cache_bound=1)
    assert config.table_optimizers == ("a=sgd", "b=adam:lr=0.01")
    assert config.row_cache.rows == 4 and config.row_cache.bound == 1
    assert {n: e.rule for n, e in config.table_rules.entries.items()} == {"a": "sgd", "b": "adam"}


def test_torch_free_choices_agree_with_their_sources() -> None:
    from tether.protos.codec import WIRE_DTYPES
    from tether.protos.framing import TRANSPORTS
    from tether.protos.optimizers import OPTIMIZERS, OptimizerConfig
    from tether.protos.specs import TableConfig
    from tether.worker.cache_parts import POLICIES
    from tether.worker.client_config import ClientConfig

    assert choices.OPTIMIZERS == OPTIMIZERS
    assert (choices.OPTIMIZER, choices.OPTIMIZER_LR) == (default_of(OptimizerConfig, "name"), default_of(OptimizerConfig, "lr"))
    assert choices.INIT_SCALE == default_of(TableConfig, "init_scale")
    assert choices.WIRE_DTYPES == tuple(WIRE_DTYPES)
    assert choices.TRANSPORTS == TRANSPORTS
    assert choices.CACHE_POLICIES == POLICIES
    client = {n: default_of(ClientConfig, n) for n in ("timeout_s", "call_deadline_s", "staleness_aware", "transport")}
    assert client == {"timeout_s": choices.CLIENT_TIMEOUT_S, "call_deadline_s": choices.CLIENT_CALL_DEADLINE_S,
                      "staleness_aware": choices.CLIENT_STALENESS_AWARE, "transport": choices.CLIENT_TRANSPORT}
    assert WIRE_DTYPES[choices.CLIENT_WIRE_DTYPE] == default_of(ClientConfig, "wire_dtype")
