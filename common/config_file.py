"""A child's config as a JSON file of its typed values: what a launcher hands each worker
(``to_json``: ``tether worker --config FILE``), and the parsed flags the child's parser starts
from (``namespace_from_json``), so no value is rendered as text and parsed again on the way. The
fields are declared once (``tether.common.settings``)."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from typing import Any

from tether.common.settings import Setting, declared, default_of, optional_float, optional_int, optional_str, told

__all__ = ["namespace_from_json", "to_json"]


def to_json(cfg: Any) -> str:
    """``cfg``'s flagged fields as one JSON object of their typed values (numbers, switches,
    lists, null; a parsed value that is a ``str``, as a mode, as its text): what a launcher hands
    a child in a file, read back by ``namespace_from_json`` with no text form in between. The
    fields are those ``to_argv`` tells (a switch that is off and a None that is the default are
    left out, so what the child inherits can still set them, as ever); derived fields (a token
    read from a file) are never written: the child derives them again."""
    return json.dumps({f.name: getattr(cfg, f.name) for f, _ in told(cfg)}, indent=1) + "\n"


# What an optional field's value is when it is not None.
_OPTIONAL: dict[Callable[[str], Any], type] = {optional_int: int, optional_float: float, optional_str: str}


def _json_value(cls: type, name: str, decl: Setting, value: Any) -> Any:
    """A field's value read from JSON, checked against the field's type (lists as tuples).

    Raises:
        ValueError: a value of another type, named.
    """
    if isinstance(value, list):
        value = tuple(value)
    default = default_of(cls, name)
    if value is None and (default is None or decl.parse in _OPTIONAL):
        return None
    kind = _OPTIONAL.get(decl.parse) or type(default)
    fits = isinstance(value, (int, float) if kind is float else kind) and isinstance(value, bool) == (kind is bool)
    if kind is tuple and fits:
        fits = all(isinstance(v, str) for v in value)
    if not fits:
        raise ValueError(f"{name}: expected {'a list of texts' if kind is tuple else kind.__name__}, got {value!r}")
    return float(value) if kind is float else value


def namespace_from_json(cls: type, text: str) -> argparse.Namespace:
    """The parsed flags ``to_json``'s text describes: each field it holds under its flag's
    attribute, as ``add_flags``'s flags store it. ``parser.parse_args(argv, namespace=...)`` starts
    from it, so the text's values stand in for the flags' defaults and variables and a flag given
    in ``argv`` wins; ``values_from_args`` then makes the config (deriving what is derived).

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
    namespace = argparse.Namespace()
    for name, value in given.items():
        decl = flagged[name]
        value = _json_value(cls, name, decl, value)
        setattr(namespace, decl.dest, value != decl.negated if decl.switch else value)
    return namespace
