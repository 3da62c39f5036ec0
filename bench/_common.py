"""Shared helpers for the benchmarks: timing, ports, child processes, Markdown tables.

Everything here is bounded: timing loops stop at ``max_seconds`` and child processes are
joined, terminated and finally killed within a timeout, so a benchmark cannot hang.
"""

from __future__ import annotations

import math
import multiprocessing as mp
import socket
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

__all__ = [
    "MIB",
    "QUICK_SIZES",
    "SIZES",
    "ChildProcess",
    "call_stats",
    "fmt_size",
    "free_port",
    "make_certificates",
    "markdown_table",
    "mib_per_s",
    "percentile",
    "start_process",
    "time_op",
    "unique_ids",
]

MIB = 2**20
"""Bytes in a MiB; every "MB/s" in bench/ is MiB/s (2**20 bytes per second)."""

SIZES = [4 * 2**10 * 4**k for k in range(8)]
"""Payload sizes in bytes for throughput sweeps: 4 KiB, 16 KiB, ... 64 MiB."""

QUICK_SIZES = [4 * 2**10, 64 * 2**10, MIB, 4 * MIB, 64 * MIB]
"""The ``--quick`` subset of :data:`SIZES` (keeps 4 MiB, the size the targets quote)."""


def time_op(
    op: Callable[[], object],
    min_seconds: float,
    min_iters: int = 1,
    warmup: int = 1,
    max_seconds: float | None = None,
    warmup_seconds: float = 0.0,
) -> list[float]:
    """Run ``op`` repeatedly and return the latency of each call in seconds.

    Args:
        op: the operation; called with no arguments.
        min_seconds: keep going until this much time has been spent timing.
        min_iters: ... and until at least this many calls were timed.
        warmup: untimed calls made first (connection set-up, allocator warm-up).
        max_seconds: hard stop for the timed loop even if ``min_iters`` is not reached;
            defaults to ``10 * min_seconds + 30``.
        warmup_seconds: keep making untimed calls (after ``warmup``) until this much time
            has passed; large payloads need a while for the allocators to settle.

    Raises:
        ValueError: if a bound is negative or ``min_iters`` < 1.
    """
    if min(min_seconds, warmup, warmup_seconds) < 0 or min_iters < 1:
        raise ValueError(
            f"need min_seconds, warmup, warmup_seconds >= 0 and min_iters >= 1; got "
            f"{min_seconds=}, {warmup=}, {warmup_seconds=}, {min_iters=}"
        )
    limit = 10 * min_seconds + 30 if max_seconds is None else max_seconds
    clock = time.perf_counter
    for _ in range(warmup):
        op()
    warm_until = clock() + warmup_seconds
    while clock() < warm_until:
        op()
    latencies: list[float] = []
    start = clock()
    while True:
        t0 = clock()
        op()
        t1 = clock()
        latencies.append(t1 - t0)
        elapsed = t1 - start
        if elapsed >= limit or (elapsed >= min_seconds and len(latencies) >= min_iters):
            return latencies


def percentile(values: Sequence[float], q: float) -> float:
    """Return the ``q``-th percentile (0..100) of ``values`` by linear interpolation.

    Raises:
        ValueError: if ``values`` is empty or ``q`` is outside 0..100.
    """
    if not values:
        raise ValueError("percentile of an empty sequence")
    if not 0 <= q <= 100:
        raise ValueError(f"percentile q must be in [0, 100], got {q}")
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def mib_per_s(bytes_per_op: int, latencies: Sequence[float]) -> float:
    """Throughput in MiB/s (2**20 bytes) of ops that each moved ``bytes_per_op`` bytes."""
    total = sum(latencies)
    if total <= 0:
        raise ValueError(f"total time must be positive, got {total}")
    return bytes_per_op * len(latencies) / total / MIB


def call_stats(latencies: Sequence[float]) -> dict[str, float]:
    """Rate and latency of sequential calls: ``calls_per_s``, ``p50_us``, ``p99_us``."""
    return {
        "calls_per_s": len(latencies) / sum(latencies),
        "p50_us": percentile(latencies, 50) * 1e6,
        "p99_us": percentile(latencies, 99) * 1e6,
    }


def unique_ids(num_ids: int, generator: Any) -> Any:
    """``num_ids`` distinct int64 ids from a 2**40 key space, in random order (a torch tensor;
    ``generator`` is a ``torch.Generator``)."""
    import torch

    ids = torch.randint(0, 2**40, (2 * num_ids,), generator=generator).unique()[:num_ids]
    return ids[torch.randperm(len(ids), generator=generator)]


def free_port() -> int:
    """Return a TCP port on 127.0.0.1 that was free a moment ago (racy by nature)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def fmt_size(nbytes: int) -> str:
    """Format a byte count as e.g. ``4 KiB``, ``64 MiB``, ``8 B``."""
    for unit, scale in (("GiB", 2**30), ("MiB", MIB), ("KiB", 2**10)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale} {unit}"
    return f"{nbytes} B"


@dataclass
class ChildProcess:
    """A spawned child process that can always be stopped within a timeout."""

    process: BaseProcess

    def stop(self, timeout: float = 10.0) -> int | None:
        """Wait up to ``timeout`` s for a clean exit, then terminate, then kill.

        Returns:
            the exit code (negative for a signal), or None if it could not be reaped.
        """
        proc = self.process
        proc.join(timeout)
        if proc.is_alive():
            proc.terminate()
            proc.join(3.0)
        if proc.is_alive():
            proc.kill()
            proc.join(3.0)
        return proc.exitcode

    def __enter__(self) -> ChildProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def start_process(
    target: Callable[..., Any],
    args: tuple[Any, ...] = (),
    name: str | None = None,
    context: Any = None,
) -> ChildProcess:
    """Start ``target(*args)`` in a fresh interpreter (multiprocessing ``spawn``).

    ``target`` must be a module-level function; pass the spawn ``context`` used to make any
    queue or event in ``args``.
    """
    ctx = context if context is not None else mp.get_context("spawn")
    proc = ctx.Process(target=target, args=args, name=name, daemon=True)
    proc.start()
    return ChildProcess(proc)


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """Render ``rows`` as a GitHub Markdown table; numbers are right-aligned.

    Raises:
        ValueError: if a row's length differs from the header's.
    """
    cells = [[str(h) for h in headers]]
    for row in rows:
        if len(row) != len(headers):
            raise ValueError(f"row {row!r} has {len(row)} cells, expected {len(headers)}")
        cells.append([_fmt_cell(v) for v in row])
    numeric = [
        all(isinstance(row[i], (int, float)) for row in rows) and bool(rows)
        for i in range(len(headers))
    ]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]

    def line(values: Sequence[str]) -> str:
        parts = [
            v.rjust(w) if num else v.ljust(w)
            for v, w, num in zip(values, widths, numeric, strict=True)
        ]
        return "| " + " | ".join(parts) + " |"

    rule = (
        "|"
        + "|".join(
            "-" * (w + 1) + ":" if num else "-" * (w + 2)
            for w, num in zip(widths, numeric, strict=True)
        )
        + "|"
    )
    return "\n".join([line(cells[0]), rule, *(line(r) for r in cells[1:])])


def _fmt_cell(value: object) -> str:
    if isinstance(value, float):
        return f"{value:,.0f}" if abs(value) >= 100 else f"{value:.3g}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


def make_certificates(folder: Path, ips: Sequence[str] = ("127.0.0.1",)) -> dict[str, Path]:
    """A throwaway CA, a shard certificate (SAN: ``ips`` and localhost) and a client certificate
    (for mutual TLS), made with ``openssl``.

    Returns:
        ``ca.crt``, ``server.crt``, ``server.key``, ``client.crt``, ``client.key`` paths.

    Raises:
        RuntimeError: openssl is missing or failed.
    """
    folder.mkdir(parents=True, exist_ok=True)
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    san = ",".join([f"IP:{ip}" for ip in ips] + ["DNS:localhost"])
    (folder / "server.ext").write_text(f"subjectAltName={san}\nextendedKeyUsage=serverAuth\n")
    (folder / "client.ext").write_text("extendedKeyUsage=clientAuth\n")
    for args in (
        ["req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.crt", "-days", "2", "-subj", "/CN=tether bench ca"],
        ["req", *ec, "-keyout", "server.key", "-out", "server.csr", "-subj", "/CN=tether bench shard"],
        ["x509", "-req", "-in", "server.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial", "-out", "server.crt",
         "-days", "2", "-extfile", "server.ext"],
        ["req", *ec, "-keyout", "client.key", "-out", "client.csr", "-subj", "/CN=tether bench worker"],
        ["x509", "-req", "-in", "client.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial", "-out", "client.crt",
         "-days", "2", "-extfile", "client.ext"],
    ):
        try:
            proc = subprocess.run(["openssl", *args], cwd=folder, capture_output=True, text=True, timeout=60)
        except OSError as exc:
            raise RuntimeError(f"openssl is needed for TLS benchmarks: {exc}") from exc
        if proc.returncode:
            raise RuntimeError(f"openssl {' '.join(args)} failed: {proc.stderr.strip()}")
    return {n: folder / n for n in ("ca.crt", "server.crt", "server.key", "client.crt", "client.key")}


def cache_bounds(text: str) -> tuple[int, int]:
    """``--cache R/W`` (or ``R``: both bounds R) as the row cache's (read, write) bounds.

    Raises:
        ValueError: not two integers, R < 1 or W < 0 (one line, for ``argparse``'s error).
    """
    try:
        r, w = (int(x) for x in (text.split("/") if "/" in text else (text, text)))
    except ValueError:
        raise ValueError(f"--cache must be R/W (two integers), got {text!r}") from None
    if r < 1 or w < 0:
        raise ValueError(f"--cache must be R/W with R >= 1 and W >= 0, got {text!r}")
    return r, w
