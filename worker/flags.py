"""Flags of ``tether worker`` and of training jobs, made from the worker's config declarations
(``tether.worker.config``, ``tether.common.settings``): each with a ``TETHER_*`` environment
fallback, parsed into a ``WorkerConfig``; or a JSON file of the config's values (``--config``:
what ``tether launch`` hands each worker), with the flags given beside it winning."""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence
from pathlib import Path

from tether.common import settings as fields
from tether.common.cli_args import DeprecatedAlias, HelpFormatter, env
from tether.worker.config import JOB, MODEL, MODEL_PRESETS, PLACE, PROCESS, WorkerConfig

__all__ = ["add_training_flags", "build_parser", "config_from_args", "load_config"]


def add_training_flags(p: argparse.ArgumentParser, mode: bool = True) -> None:
    """Flags that describe a job of the built-in model (shared by ``tether worker``, ``launch``,
    ``compare`` and ``sweep``; ``mode=False`` leaves ``--mode`` out). ``--steps`` comes first:
    the launching commands' help says their own flags are those before it."""
    fields.add_flags(p, WorkerConfig, groups=(JOB,), exclude=("table_optimizers",) if mode else ("mode", "table_optimizers"))
    p.add_argument("--ssp-timeout", dest="wait_timeout", type=float, action=DeprecatedAlias, new="--wait-timeout",
                   default=argparse.SUPPRESS, metavar="SECONDS",
                   help="deprecated spelling of --wait-timeout, removed in the next release (env TETHER_SSP_TIMEOUT)")
    _add_table_optimizer(p)
    p.add_argument("--preset", choices=tuple(MODEL_PRESETS), default=env("TETHER_PRESET", "default"),
                   help="model and batch size: default (batch 256, 8 fields, 16-wide rows: CPU-sized) or gpu (batch 8,192, "
                   "26 fields as in Criteo, 128-wide rows: a CUDA step not bound by kernel launches); --batch-size, "
                   "--num-sparse and --embedding-dim override it (env TETHER_PRESET)")
    fields.add_flags(p, WorkerConfig, groups=(MODEL,))


# Set on the parsed namespace once a --table-optimizer flag was read.
_GIVEN = "table_optimizer_given"


class _Entries(argparse.Action):
    """``--table-optimizer``: repeatable; the flags given replace the variable's entries, each
    adding its own (a flag's text may hold several, separated by ``;``)."""

    def __call__(
        self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: object, option_string: str | None = None
    ) -> None:
        given = getattr(namespace, _GIVEN, False)
        before = getattr(namespace, self.dest) if given else ()
        setattr(namespace, self.dest, (*before, *values))  # type: ignore[misc]
        setattr(namespace, _GIVEN, True)


def _add_table_optimizer(p: argparse.ArgumentParser) -> None:
    """``TrainingConfig.table_optimizers``'s flag, made repeatable (its help, variable and text
    form are the field's declaration)."""
    f, decl = next((f, d) for f, d in fields.declared(WorkerConfig) if f.name == "table_optimizers")
    text = decl.text_from(os.environ)
    p.add_argument(str(decl.flag), dest=decl.dest, action=_Entries, type=_entries, metavar=decl.metavar,
                   default=text if text is not None else decl.show(f.default),
                   help=f"{decl.help} {decl.env_note()}".replace("%", "%%"))


def _entries(text: str) -> tuple[str, ...]:
    """A flag's entries, split; the config checks them (one line, as for every other value)."""
    return tuple(part.strip() for part in text.split(";") if part.strip())


def build_parser() -> argparse.ArgumentParser:
    """Flags of ``tether worker``; each falls back to a ``TETHER_*`` environment variable."""
    p = argparse.ArgumentParser(
        prog="tether worker",
        description="Train with parameters held on tether shards. "
        "Every flag falls back to the TETHER_* environment variable its help names.",
        formatter_class=HelpFormatter,
    )
    fields.add_flags(p, WorkerConfig, groups=(PLACE, PROCESS))
    add_training_flags(p)
    p.add_argument("--config", metavar="FILE", default=env("TETHER_CONFIG", None),
                   help="the job as a JSON object of field values, as tether launch writes each worker's "
                   "(OUT/logs/worker-<i>.config.json): they replace the flags' defaults and TETHER_* variables; "
                   "a flag given beside it wins (env TETHER_CONFIG)")
    return p


def config_from_args(a: argparse.Namespace, **overrides: object) -> WorkerConfig:
    """``WorkerConfig`` from flags the functions above made (``overrides`` win; a field whose
    flag the parser lacks keeps its default).

    Raises:
        ValueError: a bad value, named.
    """
    values = fields.values_from_args(WorkerConfig, a)
    preset = MODEL_PRESETS[getattr(a, "preset", "default")]
    for name, size in preset.items():
        values.setdefault(name, size)
    values.update(overrides)
    return WorkerConfig(**values)


def load_config(argv: Sequence[str] | None = None) -> WorkerConfig:
    """Parse ``tether worker`` flags into a validated ``WorkerConfig``. With ``--config FILE`` the
    file's values (typed JSON, read as they are) replace the defaults and the ``TETHER_*``
    variables, and a flag given beside it wins (a launcher's ``--metrics-port``, a restart's ``--steps``).

    Raises:
        ValueError: a bad value, or a file that cannot be read or holds no config, named.
    """
    parser = build_parser()
    a = parser.parse_args(argv)
    if a.config is not None:
        a = parser.parse_args(argv, namespace=_config_file(a.config))
    return config_from_args(a)


def _config_file(path: str) -> argparse.Namespace:
    """The parsed flags ``--config FILE`` holds.

    Raises:
        ValueError: the file cannot be read, or holds no ``WorkerConfig``, naming it.
    """
    try:
        return fields.namespace_from_json(WorkerConfig, Path(path).read_text())
    except OSError as exc:
        raise ValueError(f"--config {path}: {exc.strerror or exc}") from None
    except ValueError as exc:
        raise ValueError(f"--config {path}: {exc}") from None
