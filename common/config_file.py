"""A child's config as a JSON file of its typed values: what a launcher hands every child it starts
(``to_json``: ``tether server --config FILE``, ``tether worker --config FILE``, and
``TETHER_CONFIG=FILE`` for a user's program), and how each reads it back: the parsed flags the
child's parser starts from (``parse_with_config``, ``namespace_from_json``) or the field values
``TrainingConfig.from_env`` starts from (``read_values``), so no value is rendered as text and
parsed again on the way. The fields are declared once (``tether.common.settings``)."""

from __future__ import annotations

import argparse
import dataclasses
import json
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

from tether.common.cli_args import optional_float, optional_int, optional_str
from tether.common.settings import Setting, declared, default_of, told

T = TypeVar("T")

__all__ = ["CONFIG_ENV", "json_values", "namespace_from_json", "parse_with_config", "read_values", "to_json", "values_from_json"]

# The variable naming a user's program's config file (``TrainingConfig.from_env``; ``tether worker``'s ``--config`` falls back to it).
CONFIG_ENV = "TETHER_CONFIG"


def json_values(cfg: Any, cls: type | None = None) -> dict[str, Any]:
    """``cfg``'s flagged fields (those ``cls`` declares, by default all of ``type(cfg)``'s) a child
    must be told, by field name, as typed JSON values: the fields ``to_argv`` tells (a switch that
    is off and a None that is the default are left out, so what the child inherits can still set
    them, as ever); derived fields (a token read from a file) are never written: the child derives
    them again. ``cls``: a base class of ``type(cfg)`` the child reads (a user's program reads a
    ``TrainingConfig``, not the built-in job's ``WorkerConfig``)."""
    return {f.name: getattr(cfg, f.name) for f, _ in told(cfg, cls=cls)}


def to_json(cfg: Any, cls: type | None = None, changes: Mapping[str, Any] | None = None) -> str:
    """``json_values(cfg, cls)`` (with ``changes`` over them) as one JSON object (numbers,
    switches, lists, null; a parsed value that is a ``str``, as a mode, as its text): what a
    launcher writes to a child's config file, read back by ``read_values`` or
    ``namespace_from_json`` with no text form in between."""
    return json.dumps({**json_values(cfg, cls), **(changes or {})}, indent=1) + "\n"


# What an optional field's value is when it is not None.
_OPTIONAL: dict[Callable[[str], Any], type] = {optional_int: int, optional_float: float, optional_str: str}


def _may_be_none(cls: type, name: str, decl: Setting) -> bool:
    """Whether field ``name`` of ``cls`` may hold None: its default is None, its parser gives
    None, or its annotation says so (``data_port: int | None``, ``off`` on the command line)."""
    if default_of(cls, name) is None or decl.parse in _OPTIONAL:
        return True
    annotation = {f.name: f.type for f in dataclasses.fields(cls)}[name]
    return "None" in (part.strip() for part in str(annotation).split("|"))


def _json_value(cls: type, name: str, decl: Setting, value: Any) -> Any:
    """A field's value read from JSON, checked against the field's type (lists as tuples).

    Raises:
        ValueError: a value of another type, named.
    """
    if isinstance(value, list):
        value = tuple(value)
    if value is None and _may_be_none(cls, name, decl):
        return None
    default = default_of(cls, name)
    kind = _OPTIONAL.get(decl.parse) or type(default)
    fits = isinstance(value, (int, float) if kind is float else kind) and isinstance(value, bool) == (kind is bool)
    if kind is tuple and fits:
        fits = all(isinstance(v, str) for v in value)
    if not fits:
        raise ValueError(f"{name}: expected {'a list of texts' if kind is tuple else kind.__name__}, got {value!r}")
    return float(value) if kind is float else value


def values_from_json(cls: type, text: str) -> dict[str, Any]:
    """The field values ``to_json``'s text describes, by field name, each checked against its
    field's type (what the field's ``__post_init__`` checks is left to it).

    Raises:
        ValueError: not a JSON object, a field ``cls`` has no flag for, or a value of the wrong type, named.
    """
    try:
        given = json.loads(text)
    except ValueError as exc:
        raise ValueError(f"not JSON: {exc}") from None
    if not isinstance(given, dict):
        raise ValueError(f"expected a JSON object of field values, got {type(given).__name__}")
    flagged = {f.name: decl for f, decl in declared(cls) if decl.flag is not None}
    unknown = sorted(set(given) - set(flagged))
    if unknown:
        raise ValueError(f"{cls.__name__} has no field {', '.join(unknown)}")
    return {name: _json_value(cls, name, flagged[name], value) for name, value in given.items()}


def namespace_from_json(cls: type, text: str) -> argparse.Namespace:
    """The parsed flags ``to_json``'s text describes: each field it holds under its flag's
    attribute, as ``add_flags``'s flags store it. ``parser.parse_args(argv, namespace=...)`` starts
    from it, so the text's values stand in for the flags' defaults and variables and a flag given
    in ``argv`` wins; ``values_from_args`` then makes the config (deriving what is derived).

    Raises:
        ValueError: not a JSON object, a field ``cls`` has no flag for, or a value of the wrong type, named.
    """
    flagged = {f.name: decl for f, decl in declared(cls)}
    namespace = argparse.Namespace()
    for name, value in values_from_json(cls, text).items():
        decl = flagged[name]
        setattr(namespace, decl.dest, value != decl.negated if decl.switch else value)
    return namespace


def _from_file(path: str, named: str, parse: Callable[[str], T]) -> T:
    """``parse`` of the text of the file at ``path``, read once.

    Raises:
        ValueError: the file cannot be read or ``parse`` refuses it: one line starting with ``named``.
    """
    try:
        return parse(Path(path).read_text())
    except OSError as exc:
        raise ValueError(f"{named}: {exc.strerror or exc}") from None
    except ValueError as exc:
        raise ValueError(f"{named}: {exc}") from None


def read_values(cls: type, path: str, named: str) -> dict[str, Any]:
    """The field values of the config file at ``path`` (``values_from_json``).

    Raises:
        ValueError: the file cannot be read or holds no ``cls``: one line starting with ``named``
            (how the user gave the file: ``TETHER_CONFIG=FILE``).
    """
    return _from_file(path, named, lambda text: values_from_json(cls, text))


def parse_with_config(parser: argparse.ArgumentParser, argv: Sequence[str] | None, cls: type) -> argparse.Namespace:
    """``parser``'s flags (it has a ``--config FILE`` flag beside those ``add_flags`` made for
    ``cls``): with ``--config FILE`` the file's values (typed JSON, read as they are, once) replace
    the flags' defaults and ``TETHER_*`` variables, and a flag given beside it wins (a launcher's
    ``--metrics-port``, a restart's ``--steps`` or ``--port``).

    Raises:
        ValueError: the file cannot be read or holds no ``cls``: one line naming it.
    """
    a = parser.parse_args(argv)
    if a.config is None:
        return a
    namespace = _from_file(a.config, f"--config {a.config}", lambda text: namespace_from_json(cls, text))
    return parser.parse_args(argv, namespace=namespace)
