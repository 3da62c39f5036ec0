"""tether's numba disk cache (tether.rules.kernel_cache): a cached kernel is compiled again once a
helper it inlines, in another file, changes (numba alone keys it by its own file), it loads from
disk while nothing changed, and where numba's cache is not the one it extends it compiles in
memory instead of risking a stale kernel."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import numba
import numpy as np
import pytest
from numba.core import caching

from tether.rules import kernel_cache

# Two helper files: a plain function the kernel's module registers with numba (as the rules'
# helpers are) and a constant, and a compiled helper that is inlined (as ``mix64``).
_PLAIN = textwrap.dedent("""
    SHIFT = 1000

    def plain(x):
        return x * 3
""")
_JITTED = textwrap.dedent("""
    from tether.rules.kernel_cache import compiled

    @compiled(inline="always")
    def jitted(x):
        return x + 7
""")
_KERNEL = textwrap.dedent("""
    import numba.extending
    from tether.rules.kernel_cache import compiled
    from plain_helper import SHIFT, plain
    from jitted_helper import jitted

    numba.extending.register_jitable(inline="always")(plain)

    @compiled()
    def kernel(x):
        return plain(x) + jitted(x) + SHIFT
""")
_RUN = ("import json, kernel; r = kernel.kernel(2); s = kernel.kernel.stats; "
        "print(json.dumps([r, sum(s.cache_hits.values()), sum(s.cache_misses.values())]))")


def _run(tmp_path: Path, seed: int) -> list[int]:
    """kernel(2), the cache's hits and misses, in a fresh process (its own str hash seed; no
    .pyc files, which Python too keys by a source's mtime and size)."""
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path / "cache"), "PYTHONHASHSEED": str(seed), "PYTHONPATH": str(tmp_path),
           "PYTHONDONTWRITEBYTECODE": "1"}
    run = subprocess.run([sys.executable, "-c", _RUN], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    return list(json.loads(run.stdout.strip().splitlines()[-1]))


def _edit(path: Path, old: str, new: str) -> None:
    """Replace ``old`` by ``new`` (the same length) in ``path``, its size and mtime kept."""
    assert len(old) == len(new)
    st = path.stat()
    text = path.read_text()
    assert old in text
    path.write_text(text.replace(old, new))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert path.stat().st_size == st.st_size and path.stat().st_mtime_ns == st.st_mtime_ns


def test_an_edited_helper_compiles_the_kernel_again(tmp_path: Path) -> None:
    (tmp_path / "plain_helper.py").write_text(_PLAIN)
    (tmp_path / "jitted_helper.py").write_text(_JITTED)
    (tmp_path / "kernel.py").write_text(_KERNEL)
    assert _run(tmp_path, 1) == [2 * 3 + 9 + 1000, 0, 1]  # compiled and saved
    assert _run(tmp_path, 2) == [2 * 3 + 9 + 1000, 1, 0]  # loaded from disk, whatever the hash seed
    _edit(tmp_path / "plain_helper.py", "x * 3", "x * 5")  # the registered helper's body
    assert _run(tmp_path, 3) == [2 * 5 + 9 + 1000, 0, 1]
    _edit(tmp_path / "jitted_helper.py", "x + 7", "x - 7")  # the compiled helper's body
    assert _run(tmp_path, 4) == [2 * 5 - 5 + 1000, 0, 1]


def _double(x: np.ndarray) -> np.ndarray:
    return x * 2


def test_the_digest_follows_helpers_and_the_constants_they_name() -> None:
    base = kernel_cache.sources_digest(_double)
    assert base == kernel_cache.sources_digest(_double)
    from tether.rules import index_kernels, row_kernels
    init = kernel_cache.sources_digest(row_kernels.init_rows_into.py_func)
    # mix64's constants are globals of index_kernels that init_rows_into reaches through mix64.
    saved = index_kernels._M1
    try:
        index_kernels._M1 = np.uint64(1)
        assert kernel_cache.sources_digest(row_kernels.init_rows_into.py_func) != init
    finally:
        index_kernels._M1 = saved
    assert kernel_cache.sources_digest(row_kernels.init_rows_into.py_func) == init


def test_an_unknown_numba_cache_compiles_in_memory(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    other = types.SimpleNamespace(FunctionCache=type("OtherCache", (), {}), IndexDataCacheFile=caching.IndexDataCacheFile)
    monkeypatch.setattr(kernel_cache, "caching", other)
    monkeypatch.setattr(kernel_cache, "_warned", set())
    with caplog.at_level(logging.WARNING, logger="tether.server"):
        kernel = kernel_cache.compiled()(_double)
    assert isinstance(kernel, numba.core.registry.CPUDispatcher)
    assert isinstance(kernel._cache, caching.NullCache)  # never loads nor saves
    assert [r.message for r in caplog.records if "compiled in memory" in r.message]
    assert kernel(np.arange(3.0)).tolist() == [0.0, 2.0, 4.0]


def test_tethers_kernels_are_keyed_by_their_sources() -> None:
    from tether.rules import index_kernels, row_kernels
    from tether.rules.optimizers import rule
    assert isinstance(index_kernels.mix64._cache, kernel_cache.SourceKeyedCache)
    assert isinstance(row_kernels.gather_rows._cache, kernel_cache.SourceKeyedCache)
    assert isinstance(row_kernels.row_kernel(rule("adam"))._cache, kernel_cache.SourceKeyedCache)
