"""What a first run compiles, and who compiles it (tether.rules.kernel_cache.load_kernels, the
shard's ``warm_up_shard`` and its rules' loads): a shard compiles only the kernels every shard
uses and its tables' rules, with the types its requests really call them with; processes that
start together compile each kernel once between them (the others load it from disk); a process
that compiles says so once, with how long it usually takes, and one that loads says nothing;
``tether launch`` shows each such notice once (tether.deploy.children.Notices)."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

from tether.common.kernel_notice import COMPILE_NOTICE
from tether.deploy import children


def _python(code: str, cache: Path, cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "NUMBA_CACHE_DIR": str(cache), "PYTHONPATH": str(cwd)}
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


_SHARD = textwrap.dedent("""
    import json
    import numba
    import numpy as np
    import torch
    from tether.protos.specs import OptimizerConfig, TableConfig
    from tether.rules import index_kernels, row_kernels
    from tether.rules.row_kernels import NO_ROWS
    from tether.rules.optimizers import OPTIMIZERS, rule
    from tether.server.storage.tables import EmbeddingTable

    def compiled():
        out = {}
        for mod in (index_kernels, row_kernels):
            for name, fn in vars(mod).items():
                if isinstance(fn, numba.core.registry.CPUDispatcher) and fn.signatures:
                    out[name] = len(fn.signatures)
        for name in OPTIMIZERS:
            r = rule(name)
            for kind, fn in (("rows", r.rows), ("combined", r.combined_rows)):
                kernel = row_kernels._row_kernels.get(fn)
                if kernel is not None and kernel.signatures:
                    out[name + "." + kind] = len(kernel.signatures)
        return out

    row_kernels.warm_up_shard()
    at_start = compiled()
    table = EmbeddingTable(TableConfig("t", 8, OptimizerConfig("adagrad", 0.1)), initial_capacity=4)
    for thread in list(row_kernels._rules_loading.values()):
        thread.join()
    loaded = compiled()
    # As a request's: ids decoded from its bytes (read-only), enough new ones to grow the index;
    # and writable ones (as local mode's, or a push's after de-duplication).
    ids = np.frombuffer(np.arange(10, 5000, 7, dtype=np.int64).tobytes(), np.int64)
    table.pull(ids)
    table.checked(ids, torch.ones(len(ids), 8).numpy(), NO_ROWS, np.float32(0))  # a push part's checks, as a shard's
    table.push(ids, torch.ones(len(ids), 8))
    table.pull(ids)
    table.pull(np.arange(3, 6000, 5, dtype=np.int64))
    table.push(np.arange(3, 600, 5, dtype=np.int64), torch.ones(120, 8))
    print(json.dumps({"at_start": at_start, "loaded": loaded, "after": compiled()}))
""")


def test_a_shard_compiles_only_what_it_uses_with_the_types_its_requests_use(tmp_path: Path) -> None:
    run = _python(_SHARD, tmp_path / "cache", tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    shard = {"slot_lookup": 1, "slot_place": 1, "slot_rebuild": 1, "log_record": 1, "count_linked": 1, "gather_rows": 1, "init_rows_into": 1,
             "push_part_fault": 1, "combined_push_fault": 1, "not_finite": 1, "combined_stats_fault": 1}
    # Not the worker row cache's index (index_*), a removal's (slot_cells), nor any rule's.
    assert got["at_start"] == shard
    # A table's rule is loaded when the table is made; only its row update, no other rule's.
    assert got["loaded"] == {**shard, "adagrad.rows": 1}
    # Pulls and pushes as a request makes them compile nothing more (same types as the warm-up).
    assert got["after"] == got["loaded"]
    notices = [line for line in run.stderr.splitlines() if COMPILE_NOTICE in line]
    assert len(notices) == 2, run.stderr  # the shard's kernels, then the rule's: each said once
    assert "the shard's id index and row passes" in notices[0] and "usually about 4 s" in notices[0]
    assert "the adagrad rule's row update" in notices[1]


# Four small kernels in a module of their own, loaded as one group by two processes that start
# together (each waits for the file "go"), then by a third.
_KERNELS = textwrap.dedent("""
    import numpy as np
    from tether.rules.kernel_cache import compiled

    @compiled()
    def k0(x):
        return np.sum(x * 2.0)

    @compiled()
    def k1(x):
        return np.sum(np.sqrt(np.abs(x)) + 1.0)

    @compiled()
    def k2(x):
        s = 0.0
        for i in range(len(x)):
            s += x[i] * i
        return s

    @compiled()
    def k3(x):
        return np.max(np.cumsum(x))

    KERNELS = (k0, k1, k2, k3)
""")
_LOAD = textwrap.dedent("""
    import json, logging, os, sys, time
    import numpy as np
    logging.basicConfig(level=logging.INFO, format="%(name)s %(levelname)s %(message)s")
    import toy_kernels
    from tether.rules.kernel_cache import load_kernels
    while not os.path.exists("go"):
        time.sleep(0.005)
    x = np.arange(5.0)
    load_kernels("the toy kernels", 3.0, [(lambda k=k: k(x)) for k in toy_kernels.KERNELS])
    print(json.dumps([sum(k.stats.cache_misses.values()) for k in toy_kernels.KERNELS]))
""")


def test_processes_starting_together_compile_each_kernel_once_and_say_so_once(tmp_path: Path) -> None:
    (tmp_path / "toy_kernels.py").write_text(_KERNELS)
    cache = tmp_path / "cache"
    env = {**os.environ, "NUMBA_CACHE_DIR": str(cache), "PYTHONPATH": str(tmp_path)}
    procs = [subprocess.Popen([sys.executable, "-c", _LOAD], cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for _ in range(2)]
    time.sleep(3)  # both have imported numba and wait
    (tmp_path / "go").write_text("")
    outs = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), [err[-2000:] for _, err in outs]
    misses = [json.loads(out.strip().splitlines()[-1]) for out, _ in outs]
    # Each kernel compiled by exactly one of them; the other loaded it from the disk cache.
    assert [a + b for a, b in zip(*misses, strict=True)] == [1, 1, 1, 1], misses
    for (_, err), missed in zip(outs, misses, strict=True):
        notices = [line for line in err.splitlines() if COMPILE_NOTICE in line]
        assert len(notices) == (1 if sum(missed) else 0), err
        if notices:
            assert "tether.kernels WARNING" in notices[0]
            assert f"{COMPILE_NOTICE} the toy kernels (once per machine: usually about 3 s on 2 cores" in notices[0]
    # A later process loads them all, and says nothing.
    later = _python(_LOAD, cache, tmp_path)
    assert later.returncode == 0, later.stderr[-2000:]
    assert json.loads(later.stdout.strip().splitlines()[-1]) == [0, 0, 0, 0]
    assert COMPILE_NOTICE not in later.stderr


def test_a_kernel_another_process_compiles_is_loaded_after_it(tmp_path: Path) -> None:
    """While another process holds a kernel's lock (compiling it), load_kernels loads the
    others and waits for that one, then takes it (here: compiles it, its entry deleted)."""
    import fcntl

    (tmp_path / "toy_kernels.py").write_text(_KERNELS)
    cache = tmp_path / "cache"
    # The lock file of k0: where its index is, with .lock for .nbi (the first process makes it).
    first = _python(_LOAD.replace('while not os.path.exists("go")', "while False"), cache, tmp_path)
    assert first.returncode == 0, first.stderr[-2000:]
    locks = sorted(cache.rglob("toy_kernels.k0-*.lock"))
    assert len(locks) == 1, sorted(cache.rglob("*"))
    for index in cache.rglob("toy_kernels.k0-*.nbi"):  # k0 compiles again; the others load
        index.unlink()
    fd = os.open(locks[0], os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX)
    env = {**os.environ, "NUMBA_CACHE_DIR": str(cache), "PYTHONPATH": str(tmp_path)}
    proc = subprocess.Popen([sys.executable, "-c", _LOAD.replace('while not os.path.exists("go")', "while False")], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        time.sleep(4)
        assert proc.poll() is None  # waiting for k0, the only kernel left
    finally:
        os.close(fd)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-2000:]
    assert json.loads(out.strip().splitlines()[-1]) == [1, 0, 0, 0]


def test_the_launcher_shows_each_compile_notice_once(capsys) -> None:
    """A shard's notice (its output is not echoed) and the same notice from two workers: each
    distinct one on the console once, the rest of a shard's output not at all."""
    notices = children.Notices()
    line = f"2026-01-01 00:00:00,000 tether.kernels WARNING {COMPILE_NOTICE} the shard's id index and row passes (usually about 4 s)\n"
    worker = f"{COMPILE_NOTICE} the worker row cache's passes (usually about 15 s)\n"
    pumps = [
        threading.Thread(target=children._pump, args=(io.StringIO(f"serving\n{line}ready\n"), "[shard-0] ", None, False, notices)),
        threading.Thread(target=children._pump, args=(io.StringIO(f"{line}"), "[shard-1] ", None, False, notices)),
        threading.Thread(target=children._pump, args=(io.StringIO(f"start\n{worker}step 1\n"), "[worker-0] ", None, True, notices)),
        threading.Thread(target=children._pump, args=(io.StringIO(f"start\n{worker}step 1\n"), "[worker-1] ", None, True, notices)),
    ]
    for pump in pumps:
        pump.start()
    for pump in pumps:
        pump.join()
    shown = capsys.readouterr().out.splitlines()
    said = [s for s in shown if COMPILE_NOTICE in s]
    assert len(said) == 2, shown
    assert any(s.endswith(f"] {COMPILE_NOTICE} the shard's id index and row passes (usually about 4 s)") for s in said)
    assert any(s.endswith(f"] {worker.strip()}") for s in said)
    assert sorted(s.split("] ", 1)[1] for s in shown if COMPILE_NOTICE not in s) == ["start", "start", "step 1", "step 1"]
