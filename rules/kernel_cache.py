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
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import sys
import types
from collections.abc import Callable, Iterator
from typing import Any

import numba
import numpy as np
from numba.core import caching

__all__ = ["SourceKeyedCache", "compiled", "sources_digest"]

log = logging.getLogger("tether.server")
_warned: set[str] = set()
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
        return super().load_overload(sig, target_context)

    def save_overload(self, sig: Any, data: Any) -> None:
        self._stamp()
        super().save_overload(sig, data)


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
