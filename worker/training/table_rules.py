"""A rule, learning rate, weight decay and schedule per table and for the dense parameters.

``--table-optimizer NAME=RULE[:key=value,...]`` (repeatable; ``TETHER_TABLE_OPTIMIZER`` holds
several separated by ``;``) and ``--optimizer-config FILE`` (JSON, or TOML for a ``.toml``
file: ``{NAME: {"rule": RULE, key: value, ...}}``) name, per table, the update rule and its
hyper-parameters. ``NAME`` is a table of the model, ``dense`` for the dense parameters (on the
shards, or sync's worker-side optimizer), or ``*`` for every table and the dense parameters
that have no entry of their own. The keys are ``OptimizerConfig``'s fields (``lr``,
``weight_decay``, ``eps``, the rule's own constants: whatever the registry's config takes)
and the schedule's (``warmup_steps``, ``warmup_factor``, ``decay``, ``decay_steps``, ``gamma``,
``min_lr``: ``tether.protos.schedules``); an entry's ``lr`` defaults to ``--lr``, its other keys
to the rule's defaults.

Precedence, for one table (first that applies):

1. its own entry (a ``--table-optimizer`` flag's, else the config file's);
2. the ``*`` entry (the flag's, else the file's);
3. the ``TableConfig`` the code passed (``Trainer(tables=...)``: a spec built in code keeps its
   own optimizer);
4. ``--optimizer`` and ``--lr``.

The rules come from the one registry (``tether.rules.optimizers``): a rule added there is
accepted here with no change.
"""

from __future__ import annotations

import importlib
import json
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tether.protos.errors import UsageError
from tether.protos.names import OPTIMIZERS
from tether.protos.schedules import SCHEDULE_KEYS, Schedule
from tether.protos.specs import OptimizerConfig, TableConfig
from tether.rules.optimizers import rule
from tether.rules.update_rules import follow_schedule

__all__ = ["ALL", "DENSE", "RuleEntry", "TableRules", "dense_torch_optimizer", "parse_entries", "parse_entry", "rule_keys"]

# The entry of the dense parameters, and the one of every table and dense parameter without its own.
DENSE, ALL = "dense", "*"


def _kind(annotation: Any) -> type:
    """int, str or float: how a key's text is read, from its field's annotation."""
    text = annotation if isinstance(annotation, str) else getattr(annotation, "__name__", str(annotation))
    if text.startswith("int"):
        return int
    if text.startswith("str"):
        return str
    return float


def rule_keys() -> dict[str, type]:
    """The keys an entry may set, with their types: the optimizer config's fields (but its
    name and schedule) and the schedule's."""
    keys = {f.name: _kind(f.type) for f in fields(OptimizerConfig) if f.name not in ("name", "schedule")}
    keys.update({f.name: _kind(f.type) for f in fields(Schedule)})
    return keys


@dataclass(frozen=True)
class RuleEntry:
    """One table's (or ``dense``'s, or ``*``'s) rule and the keys it sets."""

    name: str
    rule: str
    values: tuple[tuple[str, Any], ...] = ()

    def config(self, lr: float) -> OptimizerConfig:
        """The optimizer config, ``lr`` unless the entry sets one.

        Raises:
            ValueError: a value the config or the schedule refuses, naming the entry.
        """
        given = dict(self.values)
        schedule = {k: given.pop(k) for k in list(given) if k in SCHEDULE_KEYS}
        try:
            return OptimizerConfig(name=self.rule, **{"lr": lr, **given}, schedule=Schedule(**schedule))
        except (TypeError, ValueError) as exc:
            raise ValueError(f"optimizer of {self.name!r} ({self.rule}): {exc}") from None


def _value(name: str, key: str, kind: type, raw: Any) -> Any:
    if isinstance(raw, str) and kind is not str:
        try:
            return kind(raw)
        except ValueError:
            raise ValueError(f"optimizer of {name!r}: {key} must be {'an integer' if kind is int else 'a number'}, got {raw!r}") from None
    if kind is int and not (isinstance(raw, int) and not isinstance(raw, bool)):
        raise ValueError(f"optimizer of {name!r}: {key} must be an integer, got {raw!r}")
    if kind is float and (isinstance(raw, bool) or not isinstance(raw, (int, float))):
        raise ValueError(f"optimizer of {name!r}: {key} must be a number, got {raw!r}")
    if kind is str and not isinstance(raw, str):
        raise ValueError(f"optimizer of {name!r}: {key} must be a string, got {raw!r}")
    return kind(raw)


def _entry(name: str, rule_name: str, values: Mapping[str, Any]) -> RuleEntry:
    """A checked entry: a rule of the registry, known keys, values of their types.

    Raises:
        ValueError: one line naming the entry and what is wrong.
    """
    if not name:
        raise ValueError("optimizer entry without a table name (NAME=RULE[:key=value,...])")
    if rule_name not in OPTIMIZERS:
        raise ValueError(f"optimizer of {name!r}: unknown rule {rule_name!r} (rules: {', '.join(OPTIMIZERS)})")
    keys = rule_keys()
    checked = []
    for key, raw in values.items():
        if key not in keys:
            raise ValueError(f"optimizer of {name!r}: unknown key {key!r} (keys: {', '.join(keys)})")
        checked.append((key, _value(name, key, keys[key], raw)))
    entry = RuleEntry(name, rule_name, tuple(checked))
    entry.config(1.0)  # the values in range (lr aside: it is checked where it is known)
    return entry


def parse_entry(text: str) -> RuleEntry:
    """``NAME=RULE[:key=value,...]``.

    Raises:
        ValueError: one line naming the entry and what is wrong.
    """
    name, eq, rest = text.strip().partition("=")
    if not eq:
        raise ValueError(f"--table-optimizer {text!r}: expected NAME=RULE[:key=value,...]")
    rule_name, _, params = rest.partition(":")
    values: dict[str, str] = {}
    for part in (p.strip() for p in params.split(",")):
        if not part:
            continue
        key, eq, value = part.partition("=")
        if not eq or not key.strip():
            raise ValueError(f"--table-optimizer {text!r}: expected key=value, got {part!r}")
        values[key.strip()] = value.strip()
    return _entry(name.strip(), rule_name.strip(), values)


def parse_entries(text: str) -> tuple[str, ...]:
    """Entries separated by ``;`` (a flag's or ``TETHER_TABLE_OPTIMIZER``'s text), each checked.

    Raises:
        ValueError: a bad entry, named.
    """
    entries = tuple(part.strip() for part in text.split(";") if part.strip())
    for e in entries:
        parse_entry(e)
    return entries


def _toml(text: str) -> Any:
    """TOML, with Python 3.11's tomllib or, on 3.10, the tomli package.

    Raises:
        ValueError: malformed, or no TOML reader (a JSON file needs none).
    """
    for name in ("tomllib", "tomli"):
        try:
            reader = importlib.import_module(name)
        except ImportError:
            continue
        return reader.loads(text)
    raise ValueError("reading TOML needs Python 3.11 or the tomli package (pip install tomli); a .json file needs neither")


# Each --optimizer-config file's entries by path, with the file's identity, size and modification
# time when it was read. A config's copies (``dataclasses.replace`` runs ``__post_init__`` again,
# and a job makes several) find the file here instead of reading and parsing it again; a file
# changed since (another size or time) is read again.
_LOADED: dict[str, tuple[tuple[int, int, int, int], tuple[RuleEntry, ...]]] = {}


def load_file(path: str) -> tuple[RuleEntry, ...]:
    """The entries of a JSON or TOML (``.toml``) config file, read once while it is unchanged.

    Raises:
        ValueError: unreadable, not JSON/TOML, or a bad entry: one line naming the file.
    """
    try:
        st = os.stat(path)
    except OSError as exc:
        raise ValueError(f"--optimizer-config {path}: {exc.strerror or exc}") from None
    key = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
    known = _LOADED.get(path)
    if known is not None and known[0] == key:
        return known[1]
    entries = _read_file(path)
    _LOADED[path] = (key, entries)
    return entries


def _read_file(path: str) -> tuple[RuleEntry, ...]:
    """Raises: ValueError: unreadable, not JSON/TOML, or a bad entry: one line naming the file."""
    try:
        text = Path(path).read_text()
        data = _toml(text) if path.endswith(".toml") else json.loads(text)
    except (OSError, ValueError) as exc:
        raise ValueError(f"--optimizer-config {path}: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError(f"--optimizer-config {path}: expected a table name -> {{rule, key: value}} mapping at the top")
    entries = []
    for name, body in data.items():
        if not isinstance(body, dict) or not isinstance(body.get("rule"), str):
            raise ValueError(f"--optimizer-config {path}: {name!r} needs a mapping with a \"rule\"")
        try:
            entries.append(_entry(name, body["rule"], {k: v for k, v in body.items() if k != "rule"}))
        except ValueError as exc:
            raise ValueError(f"--optimizer-config {path}: {exc}") from None
    return tuple(entries)


@dataclass(frozen=True)
class TableRules:
    """The per-table entries of a job: the file's, then the flags' (a flag's entry replaces the
    file's of the same name), and the job's default rule and rate."""

    entries: Mapping[str, RuleEntry]
    default: OptimizerConfig

    @classmethod
    def of(cls, flags: Sequence[str], file: str | None, optimizer: str, lr: float) -> TableRules:
        """Raises: ValueError: a bad entry or file, one line."""
        entries = {e.name: e for e in (load_file(file) if file else ())}
        entries.update({e.name: e for e in map(parse_entry, flags)})
        for e in entries.values():
            e.config(lr)  # an lr out of range only shows with --lr
        return cls(entries, OptimizerConfig(name=optimizer, lr=lr))

    def optimizer(self, name: str, given: OptimizerConfig | None = None) -> OptimizerConfig:
        """The optimizer of table ``name`` (or ``dense``), ``given`` being the code's (the
        module's precedence)."""
        entry = self.entries.get(name) or self.entries.get(ALL)
        if entry is not None:
            return entry.config(self.default.lr)
        return given if given is not None else self.default

    def check_names(self, tables: Iterable[str]) -> None:
        """Every entry names a table the model has, ``dense`` or ``*``.

        Raises:
            UsageError: one line naming the unknown table and the model's.
        """
        have = sorted(set(tables))
        for name in self.entries:
            if name not in (DENSE, ALL) and name not in have:
                raise UsageError(
                    f"--table-optimizer/--optimizer-config name table {name!r}, which the model does not have "
                    f"(its tables: {', '.join(have) or 'none'}; also dense and *)"
                )

    def tables(self, tables: Sequence[TableConfig]) -> list[TableConfig]:
        """``tables`` with each optimizer as the entries say."""
        return [replace(t, optimizer=self.optimizer(t.name, t.optimizer)) for t in tables]


def dense_torch_optimizer(opt: OptimizerConfig, params: Sequence[nn.Parameter]) -> torch.optim.Optimizer:
    """The torch optimizer with which sync's workers step their dense parameters as the shards
    would: the rule's own, following ``opt.schedule`` step by step."""
    inner = rule(opt.name).torch_optimizer(opt, params)
    return inner if opt.schedule.constant else follow_schedule(inner, opt.lr, opt.schedule)


def apply_rules(
    rules: TableRules, tables: Sequence[TableConfig] | None, model_tables: Mapping[str, int], init_scale: float, seed: int
) -> tuple[list[TableConfig], OptimizerConfig]:
    """The table specs a ``Trainer`` declares and its dense parameters' optimizer: ``tables``
    (the code's) and, for each table of the model they do not name, the spec the ``Trainer``
    makes when given none (``--optimizer``/``--lr``, ``init_scale``, seed); each with the
    optimizer the rules give.

    Raises:
        UsageError: an entry naming a table the model does not have, or a spec of ``tables`` whose
            dim is not its ``ShardedEmbeddingBag``'s.
    """
    rules.check_names(model_tables)
    # Specs in code are often written for the one table that needs something only a spec sets
    # (FTRL's zero start, init_scale=0): the model's other tables get what they would have had.
    named = {t.name for t in tables or ()}
    tables = [*(tables or ()), *(TableConfig(name=t, dim=dim, optimizer=rules.default, init_scale=init_scale, seed=seed)
                                 for t, dim in model_tables.items() if t not in named)]
    for t in tables:
        if model_tables.get(t.name, t.dim) != t.dim:
            raise UsageError(f"Trainer(tables=...) declares table {t.name!r} with dim {t.dim}, but the model's "
                             f"ShardedEmbeddingBag({t.name!r}, ...) has dim {model_tables[t.name]}: give the spec the module's dim")
    return rules.tables(tables), rules.optimizer(DENSE)
