"""``tether launch --entry module:function``: the module is found as ``python -m`` would find it
(the current folder first), and a missing function is one line, exit 2, before anything starts."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tether.deploy.launch import Program

_MODULE = "def main():\n    return 0\n"


def test_an_entry_in_the_current_folder_is_found(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "entry_here_mod.py").write_text(_MODULE)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    monkeypatch.delitem(sys.modules, "entry_here_mod", raising=False)
    # Before: "--entry entry_here_mod:main: no module 'entry_here_mod' on the Python path".
    assert Program.entry("entry_here_mod:main", ["--x", "1"]).argv == ("-m", "tether.worker.entry", "entry_here_mod:main", "--x", "1")
    with pytest.raises(ValueError, match="module 'entry_here_mod' has no 'nosuchfn'"):
        Program.entry("entry_here_mod:nosuchfn")
    with pytest.raises(ValueError, match="expected module:function"):
        Program.entry("entry_here_mod:")


def test_a_missing_function_is_one_line_before_any_process_starts(tmp_path: Path) -> None:
    (tmp_path / "entry_cli_mod.py").write_text(_MODULE)
    proc = subprocess.run(
        [sys.executable, "-m", "tether.deploy.cli", "launch", "--entry", "entry_cli_mod:nosuchfn", "--num-workers", "1",
         "--num-shards", "1", "--steps", "2", "--out", str(tmp_path / "out")],
        capture_output=True, text=True, timeout=120, cwd=tmp_path,
    )
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()]
    assert "module 'entry_cli_mod' has no 'nosuchfn'" in proc.stderr
    assert "shard(s) at" not in proc.stdout and not (tmp_path / "out" / "logs").exists()
