"""Flags of ``tether worker``, made from the worker's config declarations (``tether.worker.config``,
``tether.common.settings``): each with a ``TETHER_*`` environment fallback, parsed into a
``WorkerConfig``; or a JSON file of the config's values (``--config``: what ``tether launch``
hands each worker), with the flags given beside it winning. The launching commands add the job's
flags (groups ``JOB`` and ``MODEL``) with ``settings.add_flags`` themselves."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from tether.common import settings as fields
from tether.common.cli_args import HelpFormatter, env
from tether.common.config_file import CONFIG_ENV, parse_with_config
from tether.worker.config import JOB, MODEL, PLACE, PROCESS, WorkerConfig

__all__ = ["build_parser", "config_from_args", "load_config"]


def build_parser() -> argparse.ArgumentParser:
    """Flags of ``tether worker``; each falls back to a ``TETHER_*`` environment variable."""
    p = argparse.ArgumentParser(
        prog="tether worker",
        description="Train with parameters held on tether shards. "
        "Every flag falls back to the TETHER_* environment variable its help names.",
        formatter_class=HelpFormatter,
    )
    fields.add_flags(p, WorkerConfig, groups=(PLACE, PROCESS, JOB, MODEL))
    p.add_argument("--config", metavar="FILE", default=env(CONFIG_ENV, None),
                   help="the job as a JSON object of field values, as tether launch writes each worker's "
                   "(OUT/logs/worker-<i>.config.json): they replace the flags' defaults and TETHER_* variables; "
                   f"a flag given beside it wins (env {CONFIG_ENV})")
    return p


def config_from_args(a: argparse.Namespace, **overrides: object) -> WorkerConfig:
    """``WorkerConfig`` from flags ``settings.add_flags`` made (``overrides`` win; a field whose
    flag the parser lacks keeps its default; ``--preset`` fills the sizes no flag gave); its data
    files are checked here, once (``WorkerConfig.check_data``).

    Raises:
        ValueError: a bad value or data file, named.
    """
    return WorkerConfig(**{**fields.values_from_args(WorkerConfig, a), **overrides}).check_data()


def load_config(argv: Sequence[str] | None = None) -> WorkerConfig:
    """Parse ``tether worker`` flags into a validated ``WorkerConfig``. With ``--config FILE`` the
    file's values (typed JSON, read as they are) replace the defaults and the ``TETHER_*``
    variables, and a flag given beside it wins (a launcher's ``--metrics-port``, a restart's ``--steps``).

    Raises:
        ValueError: a bad value, or a file that cannot be read or holds no config, named.
    """
    return config_from_args(parse_with_config(build_parser(), argv, WorkerConfig))
