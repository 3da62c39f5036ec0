"""Command-line helpers shared by every ``tether`` command: help text that shows each flag's
default next to its environment variable, old flag spellings kept for one release, and the text
parsers of optional values and lists (``tether.common.settings`` declares fields with them)."""

from __future__ import annotations

import argparse
import os
import re
import sys
from collections.abc import Sequence
from typing import Any

__all__ = ["DeprecatedAlias", "HelpFormatter", "comma_list", "env", "optional_float", "optional_int", "optional_str"]

# The last "(env TETHER_X ...)" of a help text; the default goes inside it.
_ENV = re.compile(r"\(env ([^()]*)\)")


def env(name: str, default: object) -> object:
    """A flag's default: the environment variable ``name`` when it is set, else ``default``."""
    return os.environ.get(name, default)


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """``--help`` that shows every option's default: a help text ending its env note with
    ``(env TETHER_X)`` gets ``(default: V; env TETHER_X)``, any other ``(default: V)`` at its
    end. Options without one (``None``, an empty string, a required flag) show none; on/off
    flags show ``on`` or ``off``. The default shown is the one in force, environment included."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if (
            "%(default)" in text
            or not action.option_strings
            or action.required
            or default is None
            or default is argparse.SUPPRESS
            or default == ""
            or isinstance(action, (argparse._HelpAction, argparse._VersionAction))  # noqa: SLF001 - argparse has no public names for them
        ):
            return text
        value = ("on" if default else "off") if isinstance(default, bool) else "%(default)s"
        matches = list(_ENV.finditer(text))
        if not matches:
            return f"{text} (default: {value})"
        last = matches[-1]
        return f"{text[:last.start()]}(default: {value}; env {last.group(1)}){text[last.end():]}"


class DeprecatedAlias(argparse.Action):
    """An old spelling of a flag, kept for one release: it stores into the new flag's
    destination and prints one warning line on stderr naming the new spelling.

    Give it ``default=argparse.SUPPRESS`` so the new flag's default stands.
    """

    def __init__(self, option_strings: Sequence[str], dest: str, *, new: str, **kwargs: Any) -> None:
        if not new.startswith("--"):
            raise ValueError(f"DeprecatedAlias: new must be a flag like '--num-shards', got {new!r}")
        self.new = new
        super().__init__(option_strings, dest, **kwargs)

    def __call__(
        self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any, option_string: str | None = None
    ) -> None:
        print(
            f"{parser.prog}: warning: {option_string} is deprecated and will be removed in the next release; use {self.new}",
            file=sys.stderr, flush=True,
        )
        setattr(namespace, self.dest, values)


def optional_int(text: str) -> int | None:
    """An integer, or None for an empty text."""
    if text.strip() == "":
        return None
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"expected an integer (or nothing), got {text!r}") from None


def optional_float(text: str) -> float | None:
    """A number, or None for an empty text."""
    if text.strip() == "":
        return None
    try:
        return float(text)
    except ValueError:
        raise ValueError(f"expected a number (or nothing), got {text!r}") from None


def optional_str(text: str) -> str | None:
    """The text, or None for an empty one."""
    return text or None


def comma_list(text: str) -> tuple[str, ...]:
    """``a,b,c`` as ``("a", "b", "c")``; blanks dropped."""
    return tuple(part.strip() for part in text.split(",") if part.strip())
