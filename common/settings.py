"""Config fields declared once. A frozen config dataclass declares each field that can be set from
outside with ``setting(default, flag=..., help=...)``: the default, the ``--flag``, its ``TETHER_*``
variable, the help text and the text form live on that one line, and everything else is made
from it here: the parser's flags and their environment fallbacks (``add_flags``), the config's
values from parsed flags (``values_from_args``) or from the environment (``env_values``,
``from_env``), and the argv or environment that gives a child process the same config
(``to_argv``, ``to_env``; the JSON file of its typed values: ``tether.common.config_file``).
A field's text parsers (``optional_int``, ...) live in ``tether.common.cli_args``.

Shard and worker both use it (``protos`` is the one package both import)."""

from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from tether.common.cli_args import DeprecatedAlias, comma_list

__all__ = [
    "Presets",
    "Setting",
    "add_flags",
    "declared",
    "default_of",
    "derived",
    "env_values",
    "from_env",
    "override",
    "setting",
    "to_argv",
    "to_env",
    "told",
    "values_from_args",
    "variables",
]

C = TypeVar("C")

# The keys under which a field's metadata holds its declaration.
_SETTING = "tether.setting"
_DERIVED = "tether.derived"


def _show(value: Any) -> str:
    """The text form of a value: what ``parse`` reads back (floats by ``repr``, so exactly)."""
    if value is None:
        return ""
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, tuple):
        return ",".join(str(v) for v in value)
    return str(value)


def _truthy(text: str) -> bool:
    """A switch's variable: anything but empty or ``0`` turns it on."""
    return text not in ("", "0")


@dataclass(frozen=True)
class Setting:
    """How one config field is set from outside the program."""

    # ``--lr``; None: the field is read from its variable only (a test hook, say).
    flag: str | None
    # ``TETHER_LR``; then ``fallback_env`` in order when it is unset.
    env: str
    help: str
    # Text (a flag's argument, a variable's value) -> the field's value, and back.
    parse: Callable[[str], Any]
    show: Callable[[Any], str]
    # Which flags a command takes: ``add_flags(..., groups=...)`` picks by it.
    group: str = ""
    # An on/off flag (``store_true``); ``negated``: the flag turns the field off (``--no-prefetch``).
    switch: bool = False
    negated: bool = False
    metavar: str | None = None
    choices: tuple[str, ...] | None = None
    fallback_env: tuple[str, ...] = ()
    # The flag's default is None, not the field's: someone else fills the field (a preset).
    unset: bool = False
    # An old spelling of the flag, kept for one release (it warns, and stores here).
    old_flag: str | None = None
    # A repeatable flag: each adds its entries (a text may hold several, separated by this), and
    # the flags given replace the variable's.
    separator: str | None = None

    @property
    def dest(self) -> str:
        """The parsed flag's attribute (argparse's own rule); empty without a flag."""
        return (self.flag or "").lstrip("-").replace("-", "_")

    def env_note(self) -> str:
        """``(env TETHER_X)`` for the help text (HelpFormatter puts the default inside)."""
        if self.switch:
            return f"(env {self.env}=1)"
        return f"(env {self.env}" + "".join(f", else {e}" for e in self.fallback_env) + ")"

    def text_from(self, environ: Mapping[str, str]) -> str | None:
        """This setting's variable (or its first set fallback), None when none is set."""
        for name in (self.env, *self.fallback_env):
            if name in environ:
                return environ[name]
        return None


@dataclass(frozen=True)
class Presets:
    """``--preset NAME``: a named set of values for a config's ``unset`` fields (a model's sizes),
    a flag given for one of them winning. A config class declares one as its ``PRESETS``;
    ``add_flags`` adds the flag first in its group, and ``values_from_args`` fills those fields.
    A preset's value may be a function of the config's other values (the flags' over the
    defaults), for a field whose preset value depends on them (a push window only in async)."""

    flag: str
    help: str
    group: str
    values: Mapping[str, Mapping[str, Any]]
    default: str = "default"

    @property
    def env(self) -> str:
        return "TETHER_" + self.flag.lstrip("-").upper().replace("-", "_")

    @property
    def dest(self) -> str:
        return self.flag.lstrip("-").replace("-", "_")


def _presets(cls: type) -> Presets | None:
    found = getattr(cls, "PRESETS", None)
    return found if isinstance(found, Presets) else None


def setting(
    default: Any,
    *,
    help: str,
    flag: str | None,
    env: str | None = None,
    parse: Callable[[str], Any] | None = None,
    show: Callable[[Any], str] = _show,
    group: str = "",
    negated: bool = False,
    metavar: str | None = None,
    choices: Sequence[str] | None = None,
    fallback_env: Sequence[str] = (),
    unset: bool = False,
    old_flag: str | None = None,
    separator: str | None = None,
    repr: bool = True,
) -> Any:
    """A dataclass field with its default, flag, variable (``TETHER_`` + the flag's name unless
    given), help and text form. ``parse`` defaults by the default's type (a bool makes a switch).
    ``old_flag``: a deprecated spelling; ``separator``: the flag is repeatable, each adding entries.

    Raises:
        ValueError: no ``parse`` can be guessed (a None default), or no variable can be named.
    """
    if parse is None:
        if isinstance(default, bool):
            parse = _truthy
        elif isinstance(default, (int, float, str)):
            parse = type(default)
        elif isinstance(default, tuple):
            parse = comma_list
        else:
            raise ValueError(f"setting {flag or env}: give parse= for a default of {default!r}")
    if env is None:
        if flag is None:
            raise ValueError("setting: a field without a flag needs env=")
        env = "TETHER_" + flag.lstrip("-").upper().replace("-", "_")
    decl = Setting(
        flag=flag, env=env, help=help, parse=parse, show=show, group=group, switch=isinstance(default, bool), negated=negated,
        metavar=metavar, choices=tuple(choices) if choices is not None else None, fallback_env=tuple(fallback_env), unset=unset,
        old_flag=old_flag, separator=separator,
    )
    return dataclasses.field(default=default, repr=repr, metadata={_SETTING: decl})


def override(cls: type, name: str, default: Any, **changes: Any) -> Any:
    """``cls``'s declaration of ``name`` again, with another default (and ``changes`` to its
    setting, a help text say): for a subclass whose job has another default."""
    found = {f.name: f for f in dataclasses.fields(cls)}[name]
    decl = dataclasses.replace(found.metadata[_SETTING], **changes)
    return dataclasses.field(default=default, repr=found.repr, metadata={_SETTING: decl})


def derived(
    compute: Callable[[Mapping[str, Any], Mapping[str, str]], Any],
    default: Any = None,
    *,
    repr: bool = True,
) -> Any:
    """A field no flag sets: loading computes it as ``compute(values, environ)`` from the other
    values (its own override wins), as the bearer token is read from the token file's field."""
    return dataclasses.field(default=default, repr=repr, metadata={_DERIVED: compute})


def declared(cls: type) -> Iterator[tuple[dataclasses.Field[Any], Setting]]:
    """``cls``'s declared fields and their settings, in field order."""
    for f in dataclasses.fields(cls):
        if _SETTING in f.metadata:
            yield f, f.metadata[_SETTING]


def default_of(cls: type, name: str) -> Any:
    """The default of field ``name`` of dataclass ``cls`` (so a second class can share it).

    Raises:
        KeyError: no such field, or one without a default.
    """
    f = {f.name: f for f in dataclasses.fields(cls)}[name]
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    raise KeyError(f"{cls.__name__}.{name} has no default")


def _defaults(cls: type) -> dict[str, Any]:
    return {f.name: default_of(cls, f.name) for f in dataclasses.fields(cls)
            if f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING}


def _flag_type(decl: Setting) -> Callable[[str], Any]:
    """``decl.parse`` as argparse's ``type``: builtins as they are (argparse names them in its
    message), others with their own message."""
    if decl.parse in (int, float, str):
        return decl.parse

    def parse(text: str) -> Any:
        try:
            return decl.parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    parse.__name__ = decl.parse.__name__
    return parse


def add_flags(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup,
    cls: type,
    groups: Sequence[str] | None = None,
    exclude: Sequence[str] = (),
    environ: Mapping[str, str] | None = None,
) -> None:
    """Add a flag for each declared field of ``cls`` (those of ``groups``, in that order, else
    all; fields named in ``exclude`` left out), each group's ``PRESETS`` flag first. A flag's
    default is its variable when set, else the field's default in text form, so ``--help`` shows
    the default in force."""
    environ = os.environ if environ is None else environ
    chosen = [(f, d, d.flag) for f, d in declared(cls) if d.flag is not None and f.name not in exclude]
    order = list(groups) if groups is not None else list(dict.fromkeys(d.group for _, d, _ in chosen))
    presets = _presets(cls)
    for group in order:
        if presets is not None and presets.group == group:
            parser.add_argument(presets.flag, choices=tuple(presets.values), default=environ.get(presets.env, presets.default),
                                help=f"{presets.help} (env {presets.env})".replace("%", "%%"))
        for f, decl, flag in chosen:
            if decl.group == group:
                _add_flag(parser, decl, flag, default_of(cls, f.name), environ)


def _add_flag(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup, decl: Setting, flag: str, default: Any, environ: Mapping[str, str]
) -> None:
    """One declared field's flag (and its old spelling, if it has one)."""
    text = decl.text_from(environ)
    help_text = f"{decl.help} {decl.env_note()}".replace("%", "%%")  # argparse formats help with %
    if decl.switch:
        on = _truthy(text) if text is not None else bool(default) != decl.negated
        parser.add_argument(flag, action="store_true", default=on, help=help_text)
        return
    if text is None:
        text = None if decl.unset or default is None else decl.show(default)
    if decl.separator is not None:
        parser.add_argument(flag, dest=decl.dest, action=_Entries, type=_splitter(decl.separator), default=text, metavar=decl.metavar,
                            help=help_text)
        return
    parser.add_argument(flag, type=_flag_type(decl), default=text, metavar=decl.metavar, choices=decl.choices, help=help_text)
    if decl.old_flag is not None:
        was = f" (env {decl.fallback_env[0]})" if decl.fallback_env else ""
        parser.add_argument(decl.old_flag, dest=decl.dest, type=_flag_type(decl), action=DeprecatedAlias, new=flag,
                            default=argparse.SUPPRESS, metavar=decl.metavar,
                            help=f"deprecated spelling of {flag}, removed in the next release{was}")


class _Entries(argparse.Action):
    """A repeatable flag (``Setting.separator``): the flags given replace the variable's
    entries, each adding its own (a flag's text may hold several)."""

    def __call__(
        self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: object, option_string: str | None = None
    ) -> None:
        given = f"{self.dest}_given"  # set on the namespace once one of these flags was read
        before = getattr(namespace, self.dest) if getattr(namespace, given, False) else ()
        setattr(namespace, self.dest, (*before, *values))  # type: ignore[misc]
        setattr(namespace, given, True)


def _splitter(separator: str) -> Callable[[str], tuple[str, ...]]:
    """A repeatable flag's text as its entries (the config checks each, one line as for every other value)."""

    def entries(text: str) -> tuple[str, ...]:
        return tuple(part.strip() for part in text.split(separator) if part.strip())

    return entries


def _derive(cls: type, values: dict[str, Any], given: Mapping[str, Any], environ: Mapping[str, str]) -> None:
    """Fill ``cls``'s derived fields that ``given`` does not set, from ``values`` over the defaults."""
    view = {**_defaults(cls), **values}
    for f in dataclasses.fields(cls):
        if _DERIVED in f.metadata and f.name not in given:
            values[f.name] = f.metadata[_DERIVED](view, environ)


def values_from_args(
    cls: type, namespace: argparse.Namespace, environ: Mapping[str, str] | None = None, exclude: Collection[str] = ()
) -> dict[str, Any]:
    """``cls``'s fields from flags ``add_flags`` made and argparse parsed: those the parser has
    (a field it lacks keeps its default; an ``unset`` flag left at None is left out for the
    caller), the variable-only fields, and the derived ones; fields named in ``exclude`` are
    left out (those ``add_flags`` left out, when the parser has a flag of the same name of its own).

    Raises:
        ValueError: a variable-only field's variable does not parse, named.
    """
    environ = os.environ if environ is None else environ
    values: dict[str, Any] = {}
    for f, decl in declared(cls):
        if f.name in exclude:
            continue
        if decl.flag is None:
            values.update(_from_variable(f.name, decl, environ))
            continue
        if not hasattr(namespace, decl.dest):
            continue
        value = getattr(namespace, decl.dest)
        if decl.switch:
            values[f.name] = bool(value) != decl.negated
        elif not (decl.unset and value is None):
            values[f.name] = value
    presets = _presets(cls)
    if presets is not None and hasattr(namespace, presets.dest):
        view = {**_defaults(cls), **values}
        for name, value in presets.values[getattr(namespace, presets.dest)].items():
            if name not in values:  # a flag given for the field wins
                values[name] = value(view) if callable(value) else value
    _derive(cls, values, {}, environ)
    return values


def _from_variable(name: str, decl: Setting, environ: Mapping[str, str]) -> dict[str, Any]:
    text = decl.text_from(environ)
    if text is None:
        return {}
    if decl.switch:
        return {name: _truthy(text) != decl.negated}
    try:
        return {name: decl.parse(text)}
    except ValueError as exc:
        raise ValueError(f"{decl.env}={text!r}: {exc}") from None


def env_values(
    cls: type,
    overrides: Mapping[str, Any] | None = None,
    *,
    environ: Mapping[str, str] | None = None,
    base: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """``cls``'s fields from the ``TETHER_*`` environment (each unset variable leaves its
    field's value in ``base``, a config file's, else its default), with ``overrides`` winning and
    derived fields filled.

    Raises:
        ValueError: a variable that does not parse, named with its value.
    """
    environ = os.environ if environ is None else environ
    overrides = dict(overrides or {})
    values: dict[str, Any] = dict(base or {})
    for f, decl in declared(cls):
        if f.name not in overrides:
            values.update(_from_variable(f.name, decl, environ))
    values.update(overrides)
    _derive(cls, values, overrides, environ)
    return values


def from_env(cls: type[C], overrides: Mapping[str, Any] | None = None, *, environ: Mapping[str, str] | None = None) -> C:
    """The ``cls`` the environment describes, ``overrides`` winning.

    Raises:
        ValueError: a variable that does not parse, or a value the config refuses, named.
    """
    return cls(**env_values(cls, overrides, environ=environ))


def _texts(cfg: Any, exclude: Collection[str] = ()) -> Iterator[tuple[str, str, str | None]]:
    """``(flag, variable, text)`` of each flagged field of ``cfg`` a child must be told (but
    those named in ``exclude``): text None for a switch that is on; a switch that is off and a
    None that is the default too are left out (so what a child inherits can still set them, as
    ever). Derived fields (a token read from a file) are never written: the child derives them again."""
    for f, decl in told(cfg, exclude):
        yield str(decl.flag), decl.env, None if decl.switch else decl.show(getattr(cfg, f.name))


def told(cfg: Any, exclude: Collection[str] = (), cls: type | None = None) -> Iterator[tuple[dataclasses.Field[Any], Setting]]:
    """The flagged fields of ``cfg`` a child must be told (``_texts``' rule; ``to_json``'s too):
    those ``cls`` declares (a base class of ``type(cfg)`` the child reads; by default ``type(cfg)``)."""
    cls = type(cfg) if cls is None else cls
    for f, decl in declared(cls):
        if decl.flag is None or f.name in exclude:
            continue
        value = getattr(cfg, f.name)
        if (bool(value) != decl.negated) if decl.switch else (value is not None or default_of(cls, f.name) is not None):
            yield f, decl


def to_argv(cfg: Any, exclude: Collection[str] = ()) -> list[str]:
    """The flags that give a process parsing ``type(cfg)``'s flags this very config (but the
    fields named in ``exclude``: those the caller gives each process itself)."""
    argv: list[str] = []
    for flag, _, text in _texts(cfg, exclude):
        argv += [flag] if text is None else [flag, text]
    return argv


def variables(cls: type, names: Collection[str]) -> list[str]:
    """The variables that set the fields ``names`` of ``cls`` (each field's, then its fallbacks):
    those a launcher takes out of a child's inherited environment when the child's config file
    holds the fields, so the file, not the launcher's shell, says what they are."""
    return [name for f, decl in declared(cls) if f.name in names for name in (decl.env, *decl.fallback_env)]


def to_env(cfg: Any, exclude: Collection[str] = ()) -> dict[str, str]:
    """The ``TETHER_*`` variables that describe ``cfg`` (``1`` for a switch that is on), but
    those of the fields named in ``exclude``."""
    return {name: "1" if text is None else text for _, name, text in _texts(cfg, exclude)}
