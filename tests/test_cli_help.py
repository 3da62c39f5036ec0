"""The ``tether`` commands' help and flag names: every option shows its default, every
``tether server`` and ``tether worker`` flag names the ``TETHER_*`` variable it really falls back
to, process counts are ``--num-shards``/``--num-workers`` (old spellings warn), ``compare`` and
``sweep`` refuse ``--mode``, and ``tether --version``."""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from importlib.metadata import version
from pathlib import Path

import pytest

from tether.common.cli_args import DeprecatedAlias
from tether.deploy import cli

COMMANDS = ("server", "worker", "launch", "compare", "sweep", "export", "convert")
# Commands whose every flag falls back to a TETHER_* variable (the README says so).
ENV_COMMANDS = ("server", "worker")


def _clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("TETHER_") and k != "JOB_COMPLETION_INDEX"}


def _tether(args: list[str], timeout: float = 60) -> subprocess.CompletedProcess:
    env = {**_clean_env(), "COLUMNS": "100"}
    return subprocess.run([sys.executable, "-m", "tether.deploy.cli", *args], capture_output=True, text=True, timeout=timeout, env=env)


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Defaults as they are with no TETHER_* variable set (parsers read the environment when built)."""
    for name in list(os.environ):
        if name.startswith("TETHER_") or name == "JOB_COMPLETION_INDEX":
            monkeypatch.delenv(name)
    monkeypatch.setenv("COLUMNS", "100")


class _Captured(Exception):
    pass


def parser_of(command: str, monkeypatch: pytest.MonkeyPatch) -> argparse.ArgumentParser:
    """The parser ``tether COMMAND`` builds (caught when it parses, before it does anything)."""
    seen: list[argparse.ArgumentParser] = []

    def capture(self: argparse.ArgumentParser, *args: object, **kwargs: object) -> argparse.Namespace:
        seen.append(self)
        raise _Captured

    with monkeypatch.context() as m:
        m.setattr(argparse.ArgumentParser, "parse_args", capture)
        with pytest.raises(_Captured):
            cli.main([command])
    return seen[0]


def option_blocks(help_text: str) -> dict[str, str]:
    """Each option's help, whitespace joined, keyed by each of its spellings."""
    blocks: dict[str, str] = {}
    current: list[str] | None = None
    entries: list[list[str]] = []
    for line in help_text.splitlines():
        if re.match(r"^  -", line):
            current = [line]
            entries.append(current)
        elif current is not None and re.match(r"^ {3,}\S", line):
            current.append(line)
        else:
            current = None
    for entry in entries:
        text = " ".join(" ".join(entry).split())
        head = entry[0].strip().split("  ")[0]
        for flag in re.findall(r"(--?[\w-]+)", head):
            blocks[flag] = text
    return blocks


def _documented(parser: argparse.ArgumentParser) -> Iterator[argparse.Action]:
    """Each option the help lists (positionals, such as convert's, have no flag or default), old
    spellings left out (they store into their new flag's destination and have no default)."""
    for action in parser._actions:
        if (action.option_strings and action.help != argparse.SUPPRESS and not isinstance(action, argparse._HelpAction)
                and not isinstance(action, DeprecatedAlias)):
            yield action


def _has_default(action: argparse.Action) -> bool:
    return action.default not in (None, "", argparse.SUPPRESS) and not action.required


@pytest.mark.parametrize("command", COMMANDS)
def test_help_shows_every_default(command: str, monkeypatch: pytest.MonkeyPatch, clean_env: None) -> None:
    parser = parser_of(command, monkeypatch)
    assert isinstance(parser.formatter_class, type) and issubclass(parser.formatter_class, argparse.ArgumentDefaultsHelpFormatter)
    blocks = option_blocks(parser.format_help())
    checked = 0
    for action in _documented(parser):
        block = blocks[action.option_strings[0]]
        if _has_default(action):
            shown = ("on" if action.default else "off") if isinstance(action.default, bool) else str(action.default)
            assert f"default: {shown}" in block, (command, action.option_strings, block)
            checked += 1
    assert checked >= (0 if command in ("export", "convert") else 3)  # their flags are required or optional


@pytest.mark.parametrize("command", ENV_COMMANDS)
def test_every_flag_names_its_env_variable_and_really_falls_back_to_it(
    command: str, monkeypatch: pytest.MonkeyPatch, clean_env: None
) -> None:
    parser = parser_of(command, monkeypatch)
    blocks = option_blocks(parser.format_help())
    names: dict[str, str] = {}
    for action in _documented(parser):
        block = blocks[action.option_strings[0]]
        found = re.search(r"env (TETHER_[A-Z0-9_]+)", block)
        assert found, (command, action.option_strings, block)
        names[action.dest] = found.group(1)
    # Set each named variable: the flag's default must follow it.
    for dest, name in names.items():
        action = next(a for a in parser._actions if a.dest == dest)
        value = "1" if isinstance(action.default, bool) else str(action.choices[-1]) if action.choices else "7"
        monkeypatch.setenv(name, value)
    rebuilt = parser_of(command, monkeypatch)
    for action in _documented(rebuilt):
        expected = True if isinstance(action.default, bool) else str(action.choices[-1]) if action.choices else "7"
        got = action.default if isinstance(action.default, bool) else str(action.default)
        assert got == expected, (command, action.option_strings, names[action.dest], action.default)


@pytest.mark.parametrize("command", ("launch", "compare", "sweep", "export"))
def test_launching_commands_say_which_flags_have_no_env(command: str, monkeypatch: pytest.MonkeyPatch, clean_env: None) -> None:
    parser = parser_of(command, monkeypatch)
    assert "per invocation" in " ".join(parser.description.split())
    blocks = option_blocks(parser.format_help())
    own = [a for a in _documented(parser) if "env TETHER_" not in blocks[a.option_strings[0]]]
    assert own, command
    if command != "export":
        # The job flags (from --steps on) fall back as the worker's do.
        job = [a for a in _documented(parser) if "env TETHER_" in blocks[a.option_strings[0]]]
        assert {"--steps", "--lr", "--tensorboard"} <= {a.option_strings[0] for a in job}


def test_real_worker_help_output(clean_env: None) -> None:
    proc = _tether(["worker", "--help"])
    assert proc.returncode == 0, proc.stderr
    blocks = option_blocks(proc.stdout)
    assert "default: 30.0; env TETHER_TIMEOUT" in blocks["--timeout"] and "seconds" in blocks["--timeout"]
    assert "default: 300.0; env TETHER_WAIT_TIMEOUT" in blocks["--wait-timeout"] and "seconds" in blocks["--wait-timeout"]
    assert "deprecated" in blocks["--ssp-timeout"] and "--wait-timeout" in blocks["--ssp-timeout"]
    assert "env TETHER_TENSORBOARD" in blocks["--tensorboard"]
    assert all("env TETHER_" in text for flag, text in blocks.items() if flag not in ("-h", "--help")), proc.stdout
    server = option_blocks(_tether(["server", "--help"]).stdout)
    assert "seconds" in server["--checkpoint-every"] and "env TETHER_CHECKPOINT_EVERY" in server["--checkpoint-every"]


# -- process counts: --num-shards / --num-workers, the old spellings for one release ---------------


# launch's shard count is chosen when not given (None here: 2 on a CPU host, the host's cores for
# GPU workers; tests/test_shard_count.py).
@pytest.mark.parametrize("command, shards, workers", [("launch", None, 2), ("compare", 2, 4), ("sweep", 2, 4)])
def test_num_shards_and_num_workers(command: str, shards: int | None, workers: int, monkeypatch: pytest.MonkeyPatch, clean_env: None,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    parser = parser_of(command, monkeypatch)
    base = ["--out", "x"] if command != "launch" else []
    a = parser.parse_args(base)
    assert (a.num_shards, a.num_workers) == (shards, workers)
    a = parser.parse_args([*base, "--num-shards", "3", "--num-workers", "5"])
    assert (a.num_shards, a.num_workers) == (3, 5)
    assert capsys.readouterr().err == ""
    a = parser.parse_args([*base, "--shards", "3", "--workers", "5"])
    assert (a.num_shards, a.num_workers) == (3, 5)
    err = capsys.readouterr().err.splitlines()
    assert err == [
        f"tether {command}: warning: --shards is deprecated and will be removed in the next release; use --num-shards",
        f"tether {command}: warning: --workers is deprecated and will be removed in the next release; use --num-workers",
    ]
    blocks = option_blocks(parser.format_help())
    assert "deprecated" in blocks["--shards"] and "--num-shards" in blocks["--shards"]
    assert "deprecated" in blocks["--workers"] and "--num-workers" in blocks["--workers"]
    if command == "launch":
        assert "one per core the GPU workers leave" in " ".join(blocks["--num-shards"].split())


def test_old_spelling_still_checked_under_the_new_name() -> None:
    proc = _tether(["launch", "--shards", "0"])
    assert proc.returncode == 2
    lines = proc.stderr.splitlines()
    assert lines == [
        "tether launch: warning: --shards is deprecated and will be removed in the next release; use --num-shards",
        "tether launch: error: --num-shards must be >= 1, got 0",
    ]
    proc = _tether(["compare", "--num-workers", "0", "--out", "x"])
    assert proc.returncode == 2 and proc.stderr.splitlines() == ["tether compare: error: --num-workers must be >= 1, got 0"]


def test_the_join_timeout_keeps_its_old_spelling(capsys: pytest.CaptureFixture[str]) -> None:
    from tether.common import settings as fields
    from tether.worker.config import TrainingConfig
    from tether.worker.flags import load_config

    assert load_config(["--shards", "a:1", "--wait-timeout", "7"]).wait_timeout_s == 7.0
    assert capsys.readouterr().err == ""
    assert load_config(["--shards", "a:1", "--ssp-timeout", "8"]).wait_timeout_s == 8.0
    assert capsys.readouterr().err.splitlines() == [
        "tether worker: warning: --ssp-timeout is deprecated and will be removed in the next release; use --wait-timeout"
    ]
    # The old variable is read when the new one is unset.
    old = {"TETHER_SHARDS": "a:1", "TETHER_SSP_TIMEOUT": "9"}
    assert fields.from_env(TrainingConfig, environ=old).wait_timeout_s == 9.0
    assert fields.from_env(TrainingConfig, environ={**old, "TETHER_WAIT_TIMEOUT": "4"}).wait_timeout_s == 4.0


# -- compare and sweep run several modes: --mode is refused ----------------------------------------


@pytest.mark.parametrize("command, argv", [
    ("compare", ["--mode", "sync", "--out", "x"]),
    ("compare", ["--out", "x", "--mode=ssp:2"]),
    ("sweep", ["--mode", "async", "--out", "x"]),
])
def test_compare_and_sweep_refuse_mode(command: str, argv: list[str]) -> None:
    proc = _tether([command, *argv])
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert lines[0].startswith(f"tether {command}: error: --mode "), lines[0]
    assert ("--bounds" if command == "sweep" else "--modes") in lines[0]


@pytest.mark.parametrize("command, argv, said", [
    ("compare", ["--modes", "async,async"], "--modes: async is given twice"),
    ("compare", ["--modes", "ssp:2,sync,ssp:02"], "--modes: ssp:2 is given twice"),
    ("sweep", ["--bounds", "2,1,2"], "--bounds: 2 is given twice"),
])
def test_compare_and_sweep_refuse_a_mode_given_twice(tmp_path: Path, command: str, argv: list[str], said: str) -> None:
    """`tether compare --modes async,async` ran async twice into one folder and printed two
    identical rows, each claiming both runs as its repeats."""
    out = tmp_path / "out"
    proc = _tether([command, *argv, "--steps", "2", "--num-workers", "1", "--num-shards", "1", "--out", str(out)])
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith(f"tether {command}: error: {said}"), proc.stderr
    assert "--repeats N" in lines[0] and not out.exists()


def test_compare_and_sweep_help_have_no_mode(monkeypatch: pytest.MonkeyPatch, clean_env: None) -> None:
    for command in ("compare", "sweep"):
        assert "--mode " not in parser_of(command, monkeypatch).format_usage()
    assert "--mode" in parser_of("launch", monkeypatch).format_usage()


# -- tether --version ------------------------------------------------------------------------------


@pytest.mark.parametrize("flag", ["--version", "-V"])
def test_version(flag: str) -> None:
    proc = _tether([flag])
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == f"tether {version('tether')}\n"


def test_top_level_help_mentions_version() -> None:
    proc = _tether(["--help"])
    assert proc.returncode == 0 and "--version" in proc.stdout
