"""tether's compile decorator for its numba kernels (``compiled``): ``numba.njit(cache=True,
nogil=True)`` whose disk cache entry is keyed by the sources the kernel inlines or calls too.

numba keys a cached kernel by its own file only (the index's "source stamp"), so after an edit
to a helper in another file (``tether.rules.kernel_helpers``, ``mix64`` in
``tether.rules.index_kernels``) the kernels that inline it would keep loading the old machine
code. Here each kernel's cache (``SourceKeyedCache``, numba's ``FunctionCache``) adds to that
stamp a digest of what the kernel reaches: every function (plain, a numba dispatcher's or an
intrinsic's) its code names as a global, transitively, outside numba, NumPy and the standard
library: the content of each one's source file (and of a module it names) and its bytecode,
and the value of every constant global it names (numba freezes them into the code); the
kernel's own file and bytecode too (numba 0.60's own stamp is the file's mtime and size). The
bytecode is the code as imported, so a file edited while a process compiles is not taken for
the code it compiled. Computing it costs about 4 ms for the shard's kernels. A changed
digest makes numba read the index as stale: it compiles again and overwrites the entry. The
digest is taken at the kernel's first load, from the modules as imported, so a helper must be
imported (named in the kernel's module) before the kernel's first call, as usual.

Where numba's cache is not the one described (another numba's internals), the kernel is
compiled in memory in every process instead, with one warning: slower to start, never stale.

Compiled once per machine, not once per process: processes that start together (a job's shards,
its workers) would each compile the same kernels at the same time, on the same cores, and each
save the same entry. Here a kernel is compiled (or loaded) under a lock file beside its cache
entry (``flock``), so the first process compiles it and the others wait and load it from disk;
``load_kernels`` loads a group of kernels leaving each one another process is compiling for
last, so processes starting together compile different kernels side by side and load the rest.
The wait is bounded (``COMPILE_WAIT_S``: after it a process compiles the kernel itself). A
process that compiles says so once, in one line naming what and how long it usually takes
(``COMPILE_NOTICE``, logged as a warning by ``tether.kernels``; ``tether launch`` shows the
first one on its console).
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import logging
import os
import sys
import threading
import time
import types
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import numba
import numpy as np
from numba.core import caching, sigutils
from numba.core.compiler_lock import global_compiler_lock

from tether.common.kernel_notice import COMPILE_NOTICE

__all__ = ["COMPILE_WAIT_S", "KernelBusy", "SourceKeyedCache", "compiled", "load_kernels", "sources_digest"]

log = logging.getLogger("tether.server")
notice_log = logging.getLogger("tether.kernels")
_warned: set[str] = set()
# How long a process waits for another one compiling a kernel before compiling it itself (a
# compile that hangs or a process stopped while holding the lock must not stop this one).
COMPILE_WAIT_S = 300.0
_POLL_S = 0.02
# Modules whose functions a kernel may name but whose sources are not followed (numba compiles
# its own implementations of them, and they change only with an upgrade).
_FOREIGN = frozenset({"numba", "numpy", "llvmlite", "builtins"}) | frozenset(sys.stdlib_module_names)
_SCALARS = (bool, int, float, complex, str, bytes, np.generic, type(None))


def _warn_once(kind: str, message: str, *args: Any) -> None:
    if kind not in _warned:
        _warned.add(kind)
        log.warning(message, *args)


def compiled(**options: Any) -> Callable[[Callable[..., Any]], Any]:
    """``numba.njit(cache=True, nogil=True, **options)``, its disk cache keyed by the sources
    the kernel reaches (``SourceKeyedCache``). Where no cache location is writable (a read-only
    package directory and no writable ``NUMBA_CACHE_DIR`` or home), or numba's cache is not the
    one ``SourceKeyedCache`` extends, the kernel is compiled in memory at every start instead
    (a few seconds), with one warning."""

    def decorate(fn: Callable[..., Any]) -> Any:
        try:
            kernel = numba.njit(cache=True, nogil=True, **options)(fn)
        except RuntimeError as exc:  # numba: "cannot cache function ...: no locator available"
            _warn_once("locator", "compiled kernels are not cached on disk (%s); set NUMBA_CACHE_DIR to a writable directory", exc)
            return numba.njit(cache=False, nogil=True, **options)(fn)
        if not _key_by_sources(kernel):
            return numba.njit(cache=False, nogil=True, **options)(fn)
        _compile_once_per_machine(kernel)
        return kernel

    return decorate


def _key_by_sources(kernel: Any) -> bool:
    """Give ``kernel`` (a dispatcher with numba's disk cache) a ``SourceKeyedCache``; False (one
    warning) where its cache is not numba's ``FunctionCache`` as ``SourceKeyedCache`` knows it."""
    try:
        if type(getattr(kernel, "_cache", None)) is not caching.FunctionCache:
            raise TypeError(f"the dispatcher's cache is {type(getattr(kernel, '_cache', None)).__name__}")
        kernel._cache = SourceKeyedCache(kernel.py_func)  # noqa: SLF001 (numba has no public hook for this)
    except (TypeError, AttributeError) as exc:
        _warn_once("internals", "numba %s's disk cache is not the one tether extends (%s): kernels are compiled in memory at "
                   "every start", numba.__version__, exc)
        return False
    return True


class SourceKeyedCache(caching.FunctionCache):
    """numba's ``FunctionCache`` whose index stamp is numba's (the kernel's own file) and the
    digest of the sources the kernel reaches (``sources_digest``), taken at its first use."""

    def __init__(self, py_func: Callable[..., Any]) -> None:
        super().__init__(py_func)
        cache_file = getattr(self, "_cache_file", None)
        if not isinstance(cache_file, caching.IndexDataCacheFile) or not hasattr(cache_file, "_source_stamp"):
            raise TypeError("numba's cache has no IndexDataCacheFile._source_stamp")
        self._numba_stamp = cache_file._source_stamp  # noqa: SLF001 (checked above)
        self._stamped = False

    def _stamp(self) -> None:
        if not self._stamped:
            stamp = ("tether-sources", self._numba_stamp, sources_digest(self._py_func))
            self._cache_file._source_stamp = stamp  # noqa: SLF001 (checked in __init__)
            self._stamped = True

    def load_overload(self, sig: Any, target_context: Any) -> Any:
        self._stamp()
        loaded = super().load_overload(sig, target_context)
        if loaded is None:  # numba compiles it next
            _notice_compile(self._py_func)
        return loaded

    @property
    def lock_path(self) -> str:
        """The lock file beside this kernel's index (``<name>-<line>.pyXY.lock``)."""
        index = self._cache_file._index_path  # noqa: SLF001 (numba has no public name for it)
        return index[:-len(".nbi")] + ".lock" if index.endswith(".nbi") else index + ".lock"

    def save_overload(self, sig: Any, data: Any) -> None:
        self._stamp()
        super().save_overload(sig, data)


class KernelBusy(Exception):
    """Another process is compiling this kernel now (``load_kernels`` loads it after the others)."""


# Per thread: the lock files held (a kernel compiled inside another's compile takes its own too),
# whether a busy kernel is left for later (``load_kernels``' first pass), and the group loading.
_local = threading.local()
_announced: set[str] = set()
_announced_lock = threading.Lock()


def _compile_once_per_machine(kernel: Any) -> None:
    """Make ``kernel`` (a dispatcher with a ``SourceKeyedCache``) compile or load each new
    signature under its lock file, so that of the processes that need it at once one compiles
    it and the others load it from the disk cache when it is saved."""
    original = kernel.compile
    cache: SourceKeyedCache = kernel._cache  # noqa: SLF001 (set by _key_by_sources)

    def compile(sig: Any) -> Any:  # numba calls it by this name
        try:
            args, _ = sigutils.normalize_signature(sig)
            if tuple(args) in kernel.overloads:  # in memory already: nothing to wait for
                return original(sig)
        except Exception:  # noqa: BLE001 - numba's own compile reports a bad signature
            return original(sig)
        with global_compiler_lock, _machine_lock(cache.lock_path):
            return original(sig)

    kernel.compile = compile


def _held() -> list[str]:
    held = getattr(_local, "held", None)
    if held is None:
        held = _local.held = []
    return held


@contextlib.contextmanager
def _machine_lock(path: str) -> Iterator[None]:
    """Hold ``path``'s ``flock`` (waiting up to ``COMPILE_WAIT_S`` for the process holding it);
    where it cannot be opened, nothing is locked. Raises ``KernelBusy`` instead of waiting in
    ``load_kernels``' first pass, for a kernel asked for directly (not from another's compile)."""
    held = _held()
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
    except OSError:
        yield
        return
    try:
        if not _try_lock(fd):
            if getattr(_local, "try_only", False) and not held:
                raise KernelBusy(path)
            _wait_lock(fd, path)
        held.append(path)
        try:
            yield
        finally:
            held.pop()
    finally:
        os.close(fd)  # releases the lock


def _try_lock(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    except OSError:  # a file system without flock: compile unlocked, as numba does
        return True
    return True


def _wait_lock(fd: int, path: str) -> None:
    deadline = time.monotonic() + COMPILE_WAIT_S
    while time.monotonic() < deadline:
        time.sleep(_POLL_S)
        if _try_lock(fd):
            return
    _warn_once(f"wait {path}", "another process has held %s for %.0f s: compiling the kernel here too", path, COMPILE_WAIT_S)


def _notice_compile(py_func: Callable[..., Any]) -> None:
    """Say that this process compiles: once per ``load_kernels`` group (its words); a kernel
    compiled at its first use outside a group says so once per process (a warning: the first;
    the others at info level)."""
    group = getattr(_local, "group", None)
    name = f"{py_func.__module__}.{py_func.__qualname__}"
    with _announced_lock:
        key = group[0] if group is not None else name
        if key in _announced:
            return
        first_alone = group is None and "" not in _announced
        _announced.update((key, "") if first_alone else (key,))
    if group is not None:
        what, usual_s = group
        notice_log.warning("%s %s (once per machine: usually about %.0f s on 2 cores; later runs load them from the disk cache)",
                           COMPILE_NOTICE, what, usual_s)
    else:
        notice_log.log(logging.WARNING if first_alone else logging.INFO,
                       "%s %s%s at first use (once per machine: about a second each; later runs load them from the disk cache)",
                       COMPILE_NOTICE, name, " and any others" if first_alone else "")


def load_kernels(what: str, usual_s: float, loads: Iterable[Callable[[], object]]) -> float:
    """Load each kernel ``loads`` call (each calls one or a few kernels with the argument types
    the program uses) from the disk cache, compiling the ones not there; the seconds it took.

    A kernel another process is compiling now is left for the end and then loaded once that
    process has saved it, so processes that start together compile different kernels side by
    side instead of the same ones twice. If any is compiled, this process says so once:
    ``compiling tether's kernels: <what> (once per machine: usually about <usual_s> s ...)``."""
    started = time.perf_counter()
    saved = getattr(_local, "group", None)
    _local.group = (what, usual_s)
    try:
        later = []
        for load in loads:
            _local.try_only = True
            try:
                load()
            except KernelBusy:
                later.append(load)
            finally:
                _local.try_only = False
        for load in later:
            load()
    finally:
        _local.group = saved
    return time.perf_counter() - started


def sources_digest(fn: Callable[..., Any]) -> str:
    """sha256 (hex) of what ``fn``'s compiled form depends on: the source files and bytecode of
    ``fn`` and of the functions it reaches, and the constant globals they name."""
    files: set[str] = set()
    facts: set[str] = set()
    seen: set[Any] = set()
    todo: list[Any] = [fn]
    while todo:
        f = todo.pop()
        if f in seen:
            continue
        seen.add(f)
        files.add(f.__code__.co_filename)
        facts.add(f"code {f.__module__}.{f.__qualname__} {_code_key(f.__code__)} {_constant_key(f.__defaults__)}")
        for name, value in _named(f):
            target = _function(value)
            if target is not None:
                if not _foreign(getattr(target, "__module__", None)):
                    todo.append(target)
            elif isinstance(value, types.ModuleType):
                if not _foreign(value.__name__) and getattr(value, "__file__", None):
                    files.add(value.__file__)  # type: ignore[arg-type]
            else:
                key = _constant_key(value)
                if key is not None:
                    facts.add(f"global {f.__module__}.{name}={key}")
    h = hashlib.sha256()
    for path in sorted(files):
        h.update(_file_hash(path))
    for fact in sorted(facts):
        h.update(fact.encode())
    return h.hexdigest()


def _named(f: types.FunctionType) -> Iterator[tuple[str, Any]]:
    """The globals ``f``'s code (nested code too) names, sorted, and its closure's contents."""
    names: set[str] = set()
    codes = [f.__code__]
    while codes:
        code = codes.pop()
        names.update(code.co_names)
        codes.extend(c for c in code.co_consts if isinstance(c, types.CodeType))
    for name in sorted(names):
        if name in f.__globals__:
            yield name, f.__globals__[name]
    for i, cell in enumerate(f.__closure__ or ()):
        try:
            yield f"<cell {i}>", cell.cell_contents
        except ValueError:  # an empty cell
            continue


def _function(value: Any) -> types.FunctionType | None:
    """The Python function behind ``value``: itself, a dispatcher's ``py_func``, an intrinsic's
    definition; None for anything else."""
    for candidate in (value, getattr(value, "py_func", None), getattr(value, "_defn", None)):
        if isinstance(candidate, types.FunctionType):
            return candidate
    return None


def _foreign(module: str | None) -> bool:
    return module is not None and module.partition(".")[0] in _FOREIGN


def _code_key(code: types.CodeType) -> str:
    """A digest of ``code``'s bytecode, names and constants (nested code objects too), the same
    in every process."""
    h = hashlib.sha256(code.co_code)
    h.update(repr((code.co_names, code.co_varnames, code.co_freevars)).encode())
    for const in code.co_consts:
        h.update((_code_key(const) if isinstance(const, types.CodeType) else _const_repr(const)).encode())
    return h.hexdigest()


def _const_repr(const: Any) -> str:
    if isinstance(const, frozenset):  # its order follows str hashing, which differs between processes
        return "frozenset(" + ",".join(sorted(_const_repr(c) for c in const)) + ")"
    if isinstance(const, tuple):
        return "(" + ",".join(_const_repr(c) for c in const) + ")"
    return repr(const)


def _constant_key(value: Any) -> str | None:
    """How a global constant numba would freeze into a kernel is written into the digest; None
    for a value that is not one (a module, a class, an object)."""
    if isinstance(value, _SCALARS):
        return f"{type(value).__name__}:{value!r}"
    if isinstance(value, np.ndarray):
        return f"ndarray:{value.dtype.str}:{value.shape}:{hashlib.sha256(np.ascontiguousarray(value).tobytes()).hexdigest()}"
    if isinstance(value, tuple):
        keys = [_constant_key(v) for v in value]
        return None if None in keys else "(" + ",".join(keys) + ")"  # type: ignore[arg-type]
    return None


def _file_hash(path: str) -> bytes:
    try:
        st = os.stat(path)
    except OSError:
        return b"missing " + path.encode()
    return _hash_file(path, st.st_mtime_ns, st.st_size)


@functools.cache
def _hash_file(path: str, mtime_ns: int, size: int) -> bytes:
    """The sha256 of the file (memoised on its stamp: a file changed while running is read again)."""
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).digest()
