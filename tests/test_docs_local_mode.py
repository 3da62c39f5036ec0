"""What the docs say of local mode matches the commands: ``tether worker --local`` and
``TETHER_LOCAL=1`` select it, ``tether launch`` (which starts shards) has no ``--local``."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _sentences(text: str) -> list[str]:
    return re.split(r"(?<=\.)\s+", " ".join(text.split()))


def test_tether_launch_refuses_local_and_no_page_says_it_takes_it() -> None:
    done = subprocess.run([sys.executable, "-m", "tether.deploy.cli", "launch", "--local"], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2 and "unrecognized arguments: --local" in done.stderr
    wrong = [
        f"{page.relative_to(ROOT)}: {s}"
        for page in PAGES for s in _sentences(page.read_text())
        if "`tether launch`" in s and "`--local`" in s and "has no `--local`" not in s
    ]
    assert wrong == []
