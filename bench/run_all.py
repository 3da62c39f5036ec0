"""Run every benchmark, side by side with the peer and the ceilings, and rewrite ``RESULTS.md``.

    python bench/run_all.py            # the reference run: 3 invocations (about 15 minutes on 2 cores)
    python bench/run_all.py --quick    # CI-sized (a few minutes); says so in the file
    python bench/run_all.py --cross-host --tls   # also TCP over loopback/veth links, and TLS

Every figure comes from ``--invocations`` separate processes (default 3), each measuring every
comparison once side by side; the file gives the median and the range (min-max) over them, and
the machine (CPU model, ``nproc``, kernel, transparent huge pages), the date, and per invocation
its load average, CPU steal and memory-copy bandwidth, so that a slow day shows as one.
Same-host figures (shared memory between the worker and the shard) and cross-host ones (TCP over
loopback and over veth links between network namespaces, ``bench/cross_host.py``) are reported
apart.

What runs (``bench/tether_ps.py`` holds the measurements): dense push + pull MiB/s 4 KiB ..
64 MiB against the ``torch.distributed.rpc`` parameter server, raw grpc and raw sockets;
small-call rate and latency; sparse rows/s with 1 and 2 shards (a pull then a push per step, and
one push_pull per step on both sides); the shard's in-process apply rate; samples/s of the
default model (1, 2 workers x 1, 2 shards) against the same model in one process; and tether
again with a ``bfloat16`` wire. Each comparison is the median of
``--repeats`` back-to-back repeats. The file's last section, ``## GPU (NVIDIA H100, H200)``, is
filled by hand from a GPU machine and kept verbatim. ``--check`` exits 1 when a DESIGN.md
target is missed.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

_HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(_HERE))

import step_budget as sb  # noqa: E402
import tether_ps as tp  # noqa: E402  (sets OMP_NUM_THREADS=1 before torch is imported)
from _common import MIB, QUICK_SIZES, SIZES, fmt_size, markdown_table  # noqa: E402

__all__ = ["GPU_HEADING", "TARGETS", "machine_info", "main", "merge", "render", "targets"]

GPU_HEADING = "## GPU (NVIDIA H100, H200)"
# DESIGN.md's "Numbers we hold ourselves to" (ratios, tether / the other side).
TARGETS = {
    "dense_4mib_vs_peer": 1.25,
    "sparse_2_shards_vs_peer": 2.0,
    "model_1w1s_vs_in_process": 0.90,
    "apply_sgd_vs_torch": 3.0,
    "apply_adagrad_vs_torch": 2.0,
    # Cross-host (TCP), with --cross-host: against the peer forced onto TCP; dense share of a shaped link.
    "tcp_dense_vs_peer": 1.5,
    "tcp_sparse_vs_peer": 2.0,
    "tcp_small_vs_peer": 1.3,
    "tcp_dense_link_share": 0.8,
    # TLS, with --tls: the TLS data plane against plain TCP (4 MiB); the model, mutual TLS vs plaintext.
    "tls_dense_vs_tcp": 0.8,
    "tls_model_vs_plaintext": 0.9,
}
_TARGET_SIZE = 4 * MIB


# --------------------------------------------------------------------------- machine


def machine_info() -> dict[str, str]:
    """CPU model, cores, RAM, library versions, date and commit of this run."""
    import grpc
    import numpy
    import torch
    from google import protobuf

    cpu = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    ram = "unknown"
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                ram = f"{int(line.split()[1]) / 2**20:.1f} GiB"
                break
    except OSError:
        pass
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10, cwd=_HERE
        ).stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        commit = "unknown"
    try:
        thp = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text().strip()
    except OSError:
        thp = "unknown"
    return {
        "cpu": cpu,
        "cores": str(os.cpu_count()),
        "nproc": str(len(os.sched_getaffinity(0))),
        "kernel": platform.release(),
        "thp": thp,
        "ram": ram,
        "os": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "grpcio": grpc.__version__,
        "protobuf": protobuf.__version__,
        "numpy": numpy.__version__,
        "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "load": _loadavg(),
        "commit": commit,
    }


def cpu_times() -> tuple[float, float]:
    """(total, steal) jiffies of all CPUs since boot (``/proc/stat``), to give a run's steal share."""
    try:
        f = [float(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
        return sum(f[:8]), f[7]
    except (OSError, IndexError, ValueError):
        return 0.0, 0.0


def copy_gb_per_s(mib: int = 64, repeats: int = 5) -> float:
    """Memory-copy bandwidth now (numpy, ``mib`` MiB, best of ``repeats``): the dense path's own speed limit."""
    import numpy

    a = numpy.ones(mib * MIB, dtype=numpy.uint8)
    b = numpy.empty_like(a)
    best = 0.0
    for _ in range(repeats):
        t0 = time.perf_counter()
        numpy.copyto(b, a)
        best = max(best, a.nbytes / (time.perf_counter() - t0) / 1e9)
    return best


def _loadavg() -> str:
    """1-minute load average (other work on the machine skews every figure)."""
    try:
        return Path("/proc/loadavg").read_text().split()[0]
    except OSError:
        return "unknown"


def data_ms_per_batch(batch_size: int = 256, batches: int = 300) -> float:
    """Milliseconds to generate one synthetic training batch (what the data thread of a tether
    worker, and of the in-process side, pays per step)."""
    from tether.worker.data.synthetic import SyntheticClickLog, SyntheticConfig

    it = SyntheticClickLog(SyntheticConfig()).batches(batch_size, batches + 1)
    next(it)
    t0 = time.perf_counter()
    for _ in range(batches):
        next(it)
    return (time.perf_counter() - t0) / batches * 1e3


# --------------------------------------------------------------------------- measuring


def measure(quick: bool, repeats: int, seconds: float, wire: str | None, log: Any = tp.log_stderr) -> dict[str, Any]:
    """Run every benchmark; returns the raw per-repeat figures (JSON-friendly keys)."""
    sizes = QUICK_SIZES if quick else SIZES
    t0 = time.perf_counter()
    res: dict[str, Any] = {"sizes": sizes}

    dense = tp.compare_dense(sizes, seconds, repeats, "float32", with_ceiling=True, log=log)
    res["dense"] = {
        fmt_size(s): {
            "tether": dense["peer"][s].tether,
            "peer": dense["peer"][s].other,
            "grpc": dense["grpc"][s].other,
            "socket": dense["socket"][s].other,
        }
        for s in sizes
    }
    small = tp.compare_small(2 * seconds, repeats, log=log)
    res["small"] = {m: {"tether": small["peer"][m].tether, "peer": small["peer"][m].other, "grpc": small["grpc"][m].other}
                    for m in ("calls_per_s", "p50_us", "p99_us")}
    sparse = tp.compare_sparse((1, 2), 2 * seconds, repeats, "float32", log=log)
    res["sparse"] = {str(n): {"tether": c.tether, "peer": c.other} for n, c in sparse.items()}
    fused = tp.compare_sparse((1, 2), 2 * seconds, repeats, "float32", log=log, fused=True)
    res["sparse_fused"] = {str(n): {"tether": c.tether, "peer": c.other} for n, c in fused.items()}
    apply = tp.compare_apply(seconds, repeats, log=log)
    res["apply"] = {o: {"tether": v["cmp"].tether, "raw": v["cmp"].other, "lookup": v["lookup"]} for o, v in apply.items()}

    steps = 200 if quick else 1000
    configs = [(1, 1, "float32"), (1, 2, "float32"), (2, 1, "float32"), (2, 2, "float32")]
    if wire:
        configs.append((1, 1, wire))
    model = tp.compare_model(steps, repeats, configs, log=log)
    res["model"] = {
        "data_ms_per_batch": data_ms_per_batch(),
        "steps": steps,
        "batch_size": 256,
        "in_process": model["in_process"],
        "in_process_pregenerated": model["in_process_pregenerated"],
        "tether": {f"{w}x{s}:{wd}": v for (w, s, wd), v in model["tether"].items()},
        "phases": {f"{w}x{s}:{wd}": v for (w, s, wd), v in model["phases"].items()},
    }
    if wire:
        res["wire"] = wire
        d = tp.repeat_tether(repeats, lambda: tp.tether_dense_mbps(sizes, seconds, wire), log, f"dense ({wire} wire)")
        res["dense_wire"] = {fmt_size(s): [x[s] for x in d] for s in sizes}
        res["sparse_wire"] = {
            str(n): tp.repeat_tether(repeats, lambda n=n: tp.tether_sparse_rows_per_s(n, seconds=2 * seconds, wire=wire), log,
                                     f"sparse {n} shard(s) ({wire} wire)")
            for n in (1, 2)
        }
    log("stage budgets (in process)")
    res["budget"] = {}
    for key, fn in (("dense_4mib", lambda: sb.dense_budget(4.0, 30)), ("sparse_4096x64", lambda: sb.sparse_budget(30))):
        rows, e2e = fn()
        res["budget"][key] = {"stages": [[n, t] for n, t in rows], "e2e": e2e}
    res["wall_s"] = time.perf_counter() - t0
    return res


def measure_extra(res: dict[str, Any], seconds: float, quick: bool, tls: bool, links: list[str], log: Any = tp.log_stderr) -> None:
    """The TLS and cross-host stages of one invocation, added to ``res``."""
    if tls:
        log("TLS: data plane inside TLS vs plain TCP; model, mutual TLS vs plaintext")
        c = tp.compare_tls([_TARGET_SIZE], seconds, 1, 200 if quick else 1000, log=log)
        d = c["dense"][_TARGET_SIZE]
        res["tls"] = {"dense": {"tls": d.tether, "tcp": d.other},
                      "model": {"tls": c["model"].tether, "plain": c["model"].other, "plain_tcp": c["model_tcp"]}}
    if links:
        import cross_host as xh

        why = xh.netns_rights() if any(x != "loopback" for x in links) else None
        logfile = Path(tempfile.mkdtemp(prefix="tether-xhost-log-")) / "processes.log"
        res["cross_host"] = {"links": {}, "skipped": []}
        for spec in links:
            if spec != "loopback" and why:
                res["cross_host"]["skipped"].append(f"{spec}: skipped, {why}")
                log(res["cross_host"]["skipped"][-1])
                continue
            if spec == "loopback":
                out = xh.measure_link(xh.Place("loopback"), ["dense", "sparse", "small"], seconds, 1, logfile, say=log)
            else:
                with xh.netns_link(spec) as place:
                    out = xh.measure_link(place, ["dense", "sparse", "small"], seconds, 1, logfile, say=log)
            res["cross_host"]["links"][spec] = out


# Keys whose values are not per-invocation figures (kept from the first invocation).
_KEEP = {"sizes", "budget", "steps", "batch_size", "note", "link", "rate_bps", "rtt_us_asked", "rtt_added", "skipped", "wire", "lookup"}


def merge(runs: list[Any], key: str = "") -> Any:
    """One result from the results of several invocations: per-repeat lists concatenated (one
    entry per invocation and repeat), other numbers as their median, the rest from the first."""
    first = runs[0]
    if key in _KEEP:
        return first
    if isinstance(first, dict):
        return {k: merge([r[k] for r in runs if k in r], k) for k in first}
    if isinstance(first, list) and all(isinstance(x, (int, float)) for r in runs for x in r):
        return [x for r in runs for x in r]
    if isinstance(first, (int, float)) and not isinstance(first, bool):
        return sum(runs) if key == "wall_s" else statistics.median(runs)
    return first


# --------------------------------------------------------------------------- rendering


def _med(xs: list[float]) -> float:
    return statistics.median(xs)


def _ratio(t: list[float], o: list[float], invert: bool = False) -> tuple[float, float, float]:
    """Median, min and max of the ratio measured side by side in each invocation (and repeat);
    ``invert`` for lower-is-better figures."""
    if invert:
        t, o = o, t
    per = [a / b for a, b in zip(t, o, strict=True)]
    return _med(per), min(per), max(per)


def _rx(r: tuple[float, float, float]) -> str:
    return f"{r[0]:.2f}x ({r[1]:.2f}-{r[2]:.2f})" if len({round(r[1], 2), round(r[2], 2)}) > 1 else f"{r[0]:.2f}x"


def _range(xs: list[float], fmt: str = "{:,.0f}") -> str:
    """``median (min-max)`` of a figure over invocations."""
    if len(xs) == 1 or min(xs) == max(xs):
        return fmt.format(_med(xs))
    return f"{fmt.format(_med(xs))} ({fmt.format(min(xs))}-{fmt.format(max(xs))})"


def _verdict(value: float, target: float) -> str:
    return "met" if value >= target else "**not met**"


def _phase_str(phases: dict[str, float]) -> str:
    keys = ("pull_wait", "compute", "push", "staleness_wait")
    return ", ".join(f"{k} {phases[k]:.0%}" for k in keys if phases.get(k, 0) >= 0.005)


def _target(name: str, where: str, key: str, t: list[float], o: list[float], unit: str) -> dict[str, Any]:
    return {"name": name, "where": where, "key": key, "ratio": _ratio(t, o), "tether": _med(t), "other": _med(o), "unit": unit}


def targets(res: dict[str, Any]) -> list[dict[str, Any]]:
    """Each DESIGN.md target with its measured ratio (median and range over invocations)."""
    d4 = res["dense"][fmt_size(_TARGET_SIZE)]
    sp2 = res["sparse"]["2"]
    one = res["model"]["tether"]["1x1:float32"]
    same = "same host (shared memory)"
    out = [
        _target("dense push/pull, 4 MiB fp32, vs rpc peer", same, "dense_4mib_vs_peer", d4["tether"], d4["peer"], "MiB/s"),
        _target("sparse rows/s, 4096 x 64, 2 shards, vs rpc peer", same, "sparse_2_shards_vs_peer", sp2["tether"], sp2["peer"], "rows/s"),
        _target("default model, 1 worker + 1 shard, vs in one process", same, "model_1w1s_vs_in_process", one,
                res["model"]["in_process"], "samples/s"),
        _target("shard apply, SGD, vs raw torch", "in process", "apply_sgd_vs_torch", res["apply"]["sgd"]["tether"],
                res["apply"]["sgd"]["raw"], "rows/s"),
        _target("shard apply, Adagrad, vs raw torch", "in process", "apply_adagrad_vs_torch", res["apply"]["adagrad"]["tether"],
                res["apply"]["adagrad"]["raw"], "rows/s"),
    ]
    for spec, x in res.get("cross_host", {}).get("links", {}).items():
        where = "cross-host TCP, loopback" if spec == "loopback" else f"cross-host TCP, veth {spec}"
        out += [
            _target("dense 4 MiB vs peer on TCP", where, "tcp_dense_vs_peer", x["dense"]["tether"], x["dense"]["peer"], "MiB/s"),
            _target("sparse 4096 x 64, 2 shards, vs peer on TCP", where, "tcp_sparse_vs_peer", x["sparse"]["tether"], x["sparse"]["peer"],
                    "rows/s"),
            _target("small calls/s vs peer on TCP", where, "tcp_small_vs_peer", x["small"]["tether"], x["small"]["peer"], "calls/s"),
        ]
        if x.get("rate_bps"):
            rate = x["rate_bps"] / 8 / MIB  # MiB/s of the link, one direction
            out.append(_target(f"dense 4 MiB, share of the link's {x['rate_bps'] / 1e9:g} Gbit/s", where, "tcp_dense_link_share",
                               x["dense"]["tether"], [rate] * len(x["dense"]["tether"]), "MiB/s"))
    if "tls" in res:
        tls = res["tls"]
        out += [
            _target("dense 4 MiB, data plane inside TLS vs plain TCP", "same host, TCP", "tls_dense_vs_tcp", tls["dense"]["tls"],
                    tls["dense"]["tcp"], "MiB/s"),
            _target("default model 1 x 1, mutual TLS cluster vs plaintext", "same host", "tls_model_vs_plaintext", tls["model"]["tls"],
                    tls["model"]["plain"], "samples/s"),
        ]
    return out


def _fused_sentence(res: dict[str, Any]) -> str:
    f = res.get("sparse_fused")
    if not f:
        return ""
    ms = {n: 4096 / _med(v["tether"]) * 1e3 for n, v in f.items()}
    peer = {n: 4096 / _med(v["peer"]) * 1e3 for n, v in f.items()}
    return (
        f"With one round trip per step (push_pull, as tether's async workers run), the step takes {ms['1']:.1f} ms "
        f"with 1 shard and {ms['2']:.1f} ms with 2 (the peer, given the same fused call: {peer['1']:.1f} and "
        f"{peer['2']:.1f} ms). "
    )


def limits(res: dict[str, Any]) -> str:
    """The "what limits us" paragraphs, derived from the measured figures."""
    out = []
    size = _TARGET_SIZE
    d = res["dense"][fmt_size(size)]

    def ms(mbps: float) -> float:
        return 2 * size / (mbps * MIB) * 1e3

    t_t, t_p, t_g, t_s = ms(_med(d["tether"])), ms(_med(d["peer"])), ms(_med(d["grpc"])), ms(_med(d["socket"]))
    need = ms(_med(d["peer"]) * TARGETS["dense_4mib_vs_peer"])
    text = (
        f"**Dense.** A 4 MiB push + pull takes {t_t:.1f} ms through tether, {t_p:.1f} ms through the rpc peer, "
        f"{t_g:.1f} ms as a raw grpc identity echo of the same bytes and {t_s:.1f} ms as a raw socket echo. tether's "
        f"push and pull travel on the shard's data plane, through a shared-memory region here (client and shard share "
        f"the machine), so the bytes are copied, not sent: into the region, applied from it, gathered into it and "
        f"copied out. "
    )
    text += (
        f"The target needs {need:.1f} ms per step: "
        + ("met. " if t_t <= need else f"{t_t / need:.2f}x too slow. ")
    )
    b = res.get("budget", {}).get("dense_4mib")
    if b:
        stages = sorted(b["stages"], key=lambda r: -r[1])
        inproc = sum(t for _, t in b["stages"])
        text += (
            f"In the stage budget (above), of a {b['e2e'] * 1e3:.1f} ms step the stages run in process take "
            f"{inproc * 1e3:.1f} ms, the largest being \"{stages[0][0]}\" ({stages[0][1] * 1e3:.2f} ms) and "
            f"\"{stages[1][0]}\" ({stages[1][1] * 1e3:.2f} ms): memory copies and the optimizer's pass, which no "
            f"transport removes; the other {max(b['e2e'] - inproc, 0) * 1e3:.1f} ms are two socket round trips and "
            f"the wake-ups of the shard's connection thread and of the client."
        )
    out.append(text)

    s = res["small"]
    p50_t, p50_p, p50_g = _med(s["p50_us"]["tether"]), _med(s["p50_us"]["peer"]), _med(s["p50_us"]["grpc"])
    out.append(
        f"**Small calls.** A tiny push_pull round trip has a p50 of {p50_t:.0f} us against {p50_g:.0f} us for a raw grpc "
        f"echo and {p50_p:.0f} us for the rpc peer. On the data plane a call is one framed message each way on a kept "
        f"connection, sent from the calling thread; what remains is request building, validation, metrics and "
        f"protobuf on both sides, and the process wake-ups of a 2-vCPU virtual machine."
    )

    sp = res["sparse"]
    rows = {n: _med(v["tether"]) for n, v in sp.items()}
    step_ms = {n: 4096 / r * 1e3 for n, r in rows.items()}
    ap = res["apply"]["sgd"]
    apply_ms = 4096 / _med(ap["tether"]) * 1e3
    lookup_ms = 4096 / ap["lookup"] * 1e3
    raw_ms = 4096 / _med(ap["raw"]) * 1e3
    peer_ms = {n: 4096 / _med(v["peer"]) * 1e3 for n, v in sp.items()}
    out.append(
        f"**Sparse.** One 4096-row pull + push takes {step_ms['1']:.1f} ms with 1 shard and {step_ms['2']:.1f} ms with 2 "
        f"(the rpc peer: {peer_ms['1']:.1f} and {peer_ms['2']:.1f} ms). Applying the SGD push inside the shard costs "
        f"{apply_ms:.2f} ms ({apply_ms / step_ms['1']:.0%} of the 1-shard step; raw torch does the same update in "
        f"{raw_ms:.2f} ms, and the id -> slot lookup alone takes {lookup_ms:.2f} ms, once per step: the push reuses the slots its pull found), so "
        f"the rest is the client's splitting and reassembly and, above all, four socket round trips' wake-ups. "
        + _fused_sentence(res)
        + (f"A second shard makes the step slower, not faster ({step_ms['2'] / step_ms['1']:.2f}x): on this "
           f"{os.cpu_count()}-core machine the extra process competes for the cores, and per-shard fixed costs double."
           if step_ms["2"] > step_ms["1"] else
           f"A second shard speeds the step up {step_ms['1'] / step_ms['2']:.2f}x.")
    )
    b = res.get("budget", {}).get("sparse_4096x64")
    if b:
        stages = sorted(b["stages"], key=lambda r: -r[1])
        inproc = sum(t for _, t in b["stages"])
        out[-1] += (
            f" In the stage budget, the in-process stages take {inproc * 1e3:.1f} ms of a {b['e2e'] * 1e3:.1f} ms step, "
            f"led by \"{stages[0][0]}\" ({stages[0][1] * 1e3:.2f} ms); sockets and wake-ups take the other "
            f"{max(b['e2e'] - inproc, 0) * 1e3:.1f} ms."
        )

    m = res["model"]
    one = _med(m["tether"]["1x1:float32"])
    local = _med(m["in_process"])
    ph = m["phases"]["1x1:float32"]
    out.append(
        f"**Model.** One worker and one shard reach {one:,.0f} samples/s, {one / local:.0%} of the {local:,.0f} samples/s "
        f"of the same model in one process. The worker spends its step as {_phase_str(ph)}; the part outside compute "
        f"({1 - ph.get('compute', 0):.0%}) is the parameter server's (pull_wait: the prefetched pull was not back when "
        f"compute finished; push: encoding and sending the gradients before the next step). "
        f"Both sides read their batches from a generator on a background thread, as a tether worker does "
        f"({m['data_ms_per_batch']:.2f} ms per batch); "
        + (f"with every batch made before its clock starts instead, the in-process side reaches "
           f"{_med(m['in_process_pregenerated']):,.0f} samples/s, and tether {one / _med(m['in_process_pregenerated']):.0%} of that "
           f"(on 2 cores the data thread competes with the step for the CPU and the GIL). "
           if m.get("in_process_pregenerated") else "")
        + "Scaling: " + ", ".join(
            f"{k.split(':')[0].replace('x', ' worker(s) x ')} shard(s) {_med(v):,.0f}" for k, v in m["tether"].items()
            if k.endswith(":float32")
        ) + " samples/s."
    )
    return "\n\n".join(out)


def render(
    res: dict[str, Any], info: dict[str, str], command: str, quick: bool, repeats: int, seconds: float,
    json_name: str = "bench/results.json", invocations: list[dict[str, Any]] | None = None,
) -> str:
    """RESULTS.md without its GPU section."""
    invocations = invocations or []
    n = max(len(invocations), 1)
    L: list[str] = ["# Benchmark results", ""]
    L.append(
        "Written by `bench/run_all.py`; do not edit by hand except the GPU section at the end, which the script keeps "
        f"verbatim. Every figure comes from {n} separate invocation(s) of the benchmarks (fresh processes each time, "
        f"{repeats} side-by-side repeat(s) in each, alternating which side runs first). A ratio is tether / the other "
        "side measured side by side in one invocation; the tables give the median of those ratios and, in brackets, "
        "the lowest and highest. MiB/s is 2**20 bytes per second, bytes pushed plus bytes pulled."
    )
    L += ["", "**Same host or cross-host.** The sections up to \"Cross-host\" measure a worker and shards on one machine: "
          "tether's pushes and pulls go through shared memory (a memfd region, the small message over a unix socket), "
          "the rpc peer's through TensorPipe as it chooses on one host. The \"Cross-host\" section forces TCP on both "
          "sides (tether `transport=\"tcp\"`, TensorPipe `uv` transport and `basic` channel), over loopback and over "
          "veth links between network namespaces; the \"TLS\" section is tether's data plane inside TLS."]
    if quick:
        L += ["", "> **Quick (CI-sized) run**: short measurements and fewer sizes; not the reference figures."]
    L += ["", "## Machine", ""]
    L.append(markdown_table(["", ""], [
        ["CPU", info["cpu"]], ["cores (`nproc`)", info.get("nproc", info["cores"])], ["kernel", info.get("kernel", "?")],
        ["transparent huge pages", info.get("thp", "?")], ["RAM", info["ram"]], ["OS", info["os"]],
        ["Python", info["python"]], ["torch", info["torch"]], ["grpcio", info["grpcio"]],
        ["protobuf", info["protobuf"]], ["numpy", info["numpy"]], ["date", info["date"]], ["commit", info["commit"]],
        ["load average (1 min) at start / end", f"{info['load']} / {info.get('load_end', '?')}"],
    ]))
    L += ["", "## Command", "", "```", command, "```", "",
          f"{n} invocation(s) x {repeats} repeat(s), {seconds:g} s per dense size, {2 * seconds:g} s per small-call and sparse figure, "
          f"{res['model']['steps']} steps x {res['model']['batch_size']} samples per model run; one torch thread in every "
          f"process (`OMP_NUM_THREADS=1`, as `tether launch` gives its children). Measuring time (all invocations): "
          f"{res['wall_s'] / 60:.1f} min. Raw per-invocation figures: `{json_name}`. The machine was not reserved: a load "
          f"average above {info['cores']} means other processes competed for the cores, which slows the figures "
          f"(both sides of a comparison alike, since they alternate)."]

    if invocations:
        L += ["", "## Invocations", "",
              "Each row is one separate run of every benchmark. Steal is the share of CPU time the hypervisor gave to "
              "others during the invocation; copy is numpy's memory-copy bandwidth measured at its start. A slow day "
              "shows here before it shows in a ratio.", ""]
        irows = []
        for i, inv in enumerate(invocations, 1):
            irows.append([i, inv["date"], f"{inv['load_start']} / {inv['load_end']}", f"{inv['steal']:.1%}",
                          f"{inv['copy_gb_s']:.1f} GB/s", f"{inv['wall_s'] / 60:.1f} min"])
        L.append(markdown_table(["invocation", "start", "load average at start / end", "CPU steal", "copy", "wall"], irows))

    L += ["", "## Targets (DESIGN.md)", "",
          f"Median (lowest-highest) over the {n} invocation(s); a target is met when the median is.", ""]
    trows = []
    for t in targets(res):
        target = TARGETS[t["key"]]
        trows.append([t["name"], t["where"], f"{t['tether']:,.0f} {t['unit']}", f"{t['other']:,.0f} {t['unit']}", _rx(t["ratio"]),
                      f">= {target:.2f}x", _verdict(t["ratio"][0], target)])
    L.append(markdown_table(["target", "where", "tether", "other", "ratio", "target", ""], trows))

    L += ["", "## Dense push + pull (fp32, one shard, SGD)", "",
          "A step pushes the gradient of one dense tensor and pulls its value (tether: `push` then `pull`; the peer: "
          "`rpc_sync` push then pull). The ceilings echo the same bytes: raw grpc unary call with identity serializers, "
          "raw TCP socket.", ""]
    drows = []
    for s in res["sizes"]:
        d = res["dense"][fmt_size(s)]
        drows.append([fmt_size(s), _med(d["tether"]), _med(d["peer"]), _rx(_ratio(d["tether"], d["peer"])),
                      _med(d["grpc"]), _rx(_ratio(d["tether"], d["grpc"])), _med(d["socket"])])
    L.append(markdown_table(["size", "tether MiB/s", "rpc peer MiB/s", "tether / peer", "grpc echo MiB/s",
                             "tether / grpc echo", "socket echo MiB/s"], drows))

    s = res["small"]
    L += ["", "## Small calls (sequential round trips, 8 bytes each way)", "",
          "tether: `push_pull` of a 2-float dense tensor; the peer: `rpc_sync` push_pull of the same; the ceiling: an "
          "8-byte grpc identity echo. For latencies the ratio is other / tether, so above 1 is tether faster.", ""]
    srows = []
    for metric, label, inv in (("calls_per_s", "calls/s", False), ("p50_us", "p50 latency, us", True),
                               ("p99_us", "p99 latency, us", True)):
        v = s[metric]
        srows.append([label, _med(v["tether"]), _med(v["peer"]), _rx(_ratio(v["tether"], v["peer"], inv)),
                      _med(v["grpc"]), _rx(_ratio(v["tether"], v["grpc"], inv))])
    L.append(markdown_table(["", "tether", "rpc peer", "tether vs peer", "grpc echo", "tether vs grpc"], srows))

    L += ["", "## Sparse rows (4096 unique random int64 ids x 64 dims, pull then push, SGD)", "",
          "tether splits ids by its partition function and calls the shards in parallel; the peer splits by "
          "`id % servers` and uses `rpc_async` in parallel. A row counts once per step.", ""]
    sprows = []
    for n in ("1", "2"):
        v = res["sparse"][n]
        r = _ratio(v["tether"], v["peer"])
        sprows.append([n, _med(v["tether"]), _med(v["peer"]), _rx(r), ">= 2.00x" if n == "2" else "",
                       _verdict(r[0], 2.0) if n == "2" else ""])
    L.append(markdown_table(["shards", "tether rows/s", "rpc peer rows/s", "tether / peer", "target", ""], sprows))
    if "sparse_fused" in res:
        L += ["", "The same rows with one round trip per step on both sides: the gradients of the last step's rows "
              "travel with the pull of this step's (tether: `push_pull`, as its async workers train; the peer: a "
              "`push_pull_rows` call that applies, then gathers). Each shard still applies a step's push before it "
              "serves the next pull.", ""]
        frows = []
        for n in ("1", "2"):
            v = res["sparse_fused"][n]
            frows.append([n, _med(v["tether"]), _med(v["peer"]), _rx(_ratio(v["tether"], v["peer"]))])
        L.append(markdown_table(["shards", "tether rows/s", "rpc peer rows/s", "tether / peer"], frows))

    L += ["", "## Shard apply rate (in process, no RPC, 4096 x 64)", "",
          "`EmbeddingTable.push` on rows that exist, of ids pulled just before (the steady state: the push reuses the slots its pull found), beside the same update in raw torch on a "
          "table of the same size whose row slots are known in advance (SGD: `index_add_`, as the peer; Adagrad: "
          "gather, update, scatter). The lookup column is the id -> slot index alone.", ""]
    arows = []
    for o, v in res["apply"].items():
        arows.append([o, _med(v["tether"]), _med(v["raw"]), _rx(_ratio(v["tether"], v["raw"])), v["lookup"]])
    L.append(markdown_table(["optimizer", "tether rows/s", "raw torch rows/s", "tether / raw", "lookup rows/s"], arows))

    m = res["model"]
    local = m["in_process"]
    L += ["", "## Default CTR model: samples/s and scaling", "",
          f"`run_job` with the default model and synthetic data, {m['steps']} steps x {m['batch_size']} per worker, "
          "Adagrad, async; against the same model, batches and optimizer trained in one process with no parameter "
          "server (`bench/model_throughput.py`), both reading their batches from a background thread as a tether "
          "worker does. Step split: the workers' time per phase.", ""]
    mrows = [["in one process, no parameter server", _med(local), "1.00x", "", ""]]
    if m.get("in_process_pregenerated"):
        pre = m["in_process_pregenerated"]
        mrows.append(["in one process, every batch made before the clock (reference)", _med(pre), _rx(_ratio(pre, local)), "", ""])
    for key, v in m["tether"].items():
        cfg, wd = key.split(":")
        w, sh = cfg.split("x")
        r = _ratio(v, local)
        goal = TARGETS["model_1w1s_vs_in_process"]
        target = f">= {goal:.2f}x: " + _verdict(r[0], goal) if key == "1x1:float32" else ""
        mrows.append([f"tether {w} worker(s) x {sh} shard(s)" + ("" if wd == "float32" else f", {wd} wire"), _med(v), _rx(r),
                      target, _phase_str(m["phases"][key])])
    L.append(markdown_table(["setup", "samples/s", "vs in-process", "target", "worker step split"], mrows))

    if "wire" in res:
        wd = res["wire"]
        L += ["", f"## {wd} on the wire", "",
              f"The same tether measurements with `ClientConfig(wire_dtype=torch.{wd})` (values cast on the wire, fp32 on "
              f"the shard and in the model). MiB/s still counts fp32 bytes, so it is the user-visible rate. The peer "
              f"column is the fp32 peer from the tables above (same run).", ""]
        wrows = []
        for s in res["sizes"]:
            k = fmt_size(s)
            wrows.append([f"dense {k}, MiB/s", _med(res["dense_wire"][k]), _med(res["dense"][k]["tether"]),
                          _med(res["dense"][k]["peer"]), _rx(_ratio(res["dense_wire"][k], res["dense"][k]["peer"]))])
        for n in ("1", "2"):
            wrows.append([f"sparse {n} shard(s), rows/s", _med(res["sparse_wire"][n]), _med(res["sparse"][n]["tether"]),
                          _med(res["sparse"][n]["peer"]), _rx(_ratio(res["sparse_wire"][n], res["sparse"][n]["peer"]))])
        L.append(markdown_table(["", f"tether {wd}", "tether fp32", "rpc peer", f"tether {wd} / peer"], wrows))

    if "budget" in res:
        L += ["", "## Where the time goes: stage budget (in process)", "",
              "`bench/step_budget.py`: each stage of one step run alone in this process on the real objects, along the "
              "data plane's shared-memory path (client request building, copies into and out of the region, protobuf "
              "for the small messages, the shard's servicer), beside the end-to-end step against a shard process; what "
              "the stages do not explain is the sockets and the wake-ups of threads and processes. "
              "Medians of 30 runs per stage.", ""]
        for key, title in (("dense_4mib", "dense 4 MiB fp32, push then pull"), ("sparse_4096x64", "sparse 4096 x 64, pull then push (SGD)")):
            b = res["budget"][key]
            L += [f"**{title}**", "", sb.budget_table([(n, t) for n, t in b["stages"]], b["e2e"]), ""]
    if "cross_host" in res:
        L += ["", "## Cross-host: TCP over loopback and veth links", "", cross_host_section(res["cross_host"])]
    if "tls" in res:
        tls = res["tls"]
        L += ["", "## TLS on the data plane", "",
              "`bench/tether_ps.py --tls`'s measurement: dense 4 MiB push + pull over tether's data plane with "
              "`transport=\"tcp\"`, the shard serving TLS (TLS 1.3, AES-256-GCM) against the same shard in plaintext; and "
              f"the default model, 1 worker x 1 shard, {res['model']['steps']} steps, through a mutual-TLS cluster (its data plane is TCP "
              "inside TLS: no shared memory under mutual TLS) against a plaintext cluster (shared memory).", ""]
        L.append(markdown_table(["", "TLS", "plain", "TLS / plain", "target"], [
            ["dense 4 MiB, MiB/s", _range(tls["dense"]["tls"]), _range(tls["dense"]["tcp"]),
             _rx(_ratio(tls["dense"]["tls"], tls["dense"]["tcp"])), f">= {TARGETS['tls_dense_vs_tcp']:.1f}x"],
            ["model, samples/s", _range(tls["model"]["tls"]), _range(tls["model"]["plain"]),
             _rx(_ratio(tls["model"]["tls"], tls["model"]["plain"])), f">= {TARGETS['tls_model_vs_plaintext']:.1f}x"],
            ["model, plaintext workers on TCP (`--transport tcp`), samples/s", _range(tls["model"]["tls"]),
             _range(tls["model"]["plain_tcp"]), _rx(_ratio(tls["model"]["tls"], tls["model"]["plain_tcp"])), "(TLS's own cost)"],
        ]))
    L += ["", "## What limits us", "", limits(res), ""]
    return "\n".join(L)


def cross_host_section(x: dict[str, Any]) -> str:
    """The cross-host table: every link, tether on TCP against the peer on TCP, medians and ranges."""
    units = {"dense": "MiB/s", "sparse": "rows/s", "small": "calls/s"}
    names = {"dense": "dense 4 MiB push + pull", "sparse": "sparse 4096 x 64, 2 shards, pull + push", "small": "small calls (8 B push_pull)"}
    goals = {"dense": "tcp_dense_vs_peer", "sparse": "tcp_sparse_vs_peer", "small": "tcp_small_vs_peer"}
    rows = []
    notes = []
    for spec, v in x["links"].items():
        for m in ("dense", "sparse", "small"):
            share = ""
            if m == "dense" and v.get("rate_bps"):
                share = _range([t * MIB * 8 / v["rate_bps"] for t in v[m]["tether"]], "{:.0%}")
            rows.append([spec, f"{names[m]}, {units[m]}", _range(v[m]["tether"]), _range(v[m]["peer"]), _rx(_ratio(v[m]["tether"], v[m]["peer"])),
                         f">= {TARGETS[goals[m]]:.1f}x", share])
        rtt = v.get("rtt_us_measured")
        rtt_text = f"{_med(rtt) if isinstance(rtt, list) else rtt:.0f} us" if rtt is not None else "?"
        notes.append(f"- `{spec}`: 1-byte TCP round trip {rtt_text} (median)" + (f"; {v['note']}" if v.get("note") else ""))
    text = (
        "tether's client with `transport=\"tcp\"` (checked after every measurement: no shared memory, no gRPC fallback) "
        "against `bench/rpc_peer.py`'s parameter server with TensorPipe forced onto TCP (`_transports=[\"uv\"], "
        "_channels=[\"basic\"]`). `loopback`: all processes on 127.0.0.1. Other links: `bench/cross_host.py` makes two "
        "network namespaces joined by a veth pair (10.213.0.1/.2) and runs the shards (the peer's servers) in one and the "
        "client (its trainer) in the other; `RATEgbit:RTTus` links are shaped with `tc ... tbf rate` on both ends and, "
        "where the kernel has it, `netem delay RTT/2`. Dense / link rate: MiB/s pushed + pulled over the link's rate in "
        "one direction (push and pull take turns).\n\n"
    )
    text += markdown_table(["link", "figure", "tether", "peer on TCP", "tether / peer", "target", "dense / link rate"], rows)
    text += "\n\n" + "\n".join(notes)
    for skipped in x.get("skipped", []):
        text += f"\n- {skipped}"
    return text


def _gpu_section(path: Path) -> str:
    """The existing GPU section (verbatim, to the end of the file), or a placeholder."""
    if path.exists():
        text = path.read_text()
        if text.startswith(GPU_HEADING):
            return text
        at = text.find("\n" + GPU_HEADING)
        if at != -1:
            return text[at + 1 :]
    return (
        f"{GPU_HEADING}\n\nNot measured yet. Fill this section by hand from a GPU machine; `bench/run_all.py` keeps "
        "it verbatim.\n"
    )


def _invocation(a: argparse.Namespace, repeats: int, seconds: float, wire: str | None, links: list[str]) -> dict[str, Any]:
    """One invocation's measurements, with what the machine was doing meanwhile."""
    import torch

    torch.set_num_threads(1)
    total0, steal0 = cpu_times()
    inv: dict[str, Any] = {"date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "load_start": _loadavg(),
                           "copy_gb_s": copy_gb_per_s()}
    t0 = time.perf_counter()
    res = measure(a.quick, repeats, seconds, wire)
    measure_extra(res, seconds, a.quick, a.tls, links)
    total1, steal1 = cpu_times()
    inv.update(load_end=_loadavg(), wall_s=time.perf_counter() - t0, steal=(steal1 - steal0) / max(total1 - total0, 1.0))
    return {"invocation": inv, "results": res}


def main(argv: list[str] | None = None) -> int:
    """Run everything in separate invocations, write RESULTS.md and results.json; returns the exit code."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="CI-sized run: fewer sizes, shorter measurements, 1 invocation")
    p.add_argument("--invocations", type=int, help="separate processes, each measuring everything (default 3, quick 1)")
    p.add_argument("--repeats", type=int, default=1, help="side-by-side repeats inside each invocation (default 1)")
    p.add_argument("--seconds", type=float, help="time per dense size (default 1.0, quick 0.3)")
    p.add_argument("--wire-dtype", default="bfloat16", choices=["bfloat16", "float16", "none"],
                   help="also measure tether with this wire dtype (none: skip)")
    p.add_argument("--cross-host", nargs="?", const="loopback,10gbit:100us,25gbit:50us", default="", metavar="LINKS",
                   help="also tether's TCP data plane vs the peer on TCP over these links (bench/cross_host.py; default "
                        "loopback,10gbit:100us,25gbit:50us; veth links need the rights to make network namespaces)")
    p.add_argument("--tls", action="store_true", help="also the data plane inside TLS vs plain TCP, and the model under mutual TLS")
    p.add_argument("--out", type=Path, default=_HERE / "RESULTS.md", help="Markdown file to rewrite")
    p.add_argument("--json", type=Path, default=_HERE / "results.json", help="raw per-invocation figures")
    p.add_argument("--check", action="store_true", help="exit 1 if the median of a DESIGN.md target is missed")
    p.add_argument("--_invocation", type=Path, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    invocations = a.invocations if a.invocations is not None else (1 if a.quick else 3)
    if invocations < 1 or a.repeats < 1:
        p.error(f"--invocations and --repeats must be >= 1, got {invocations} and {a.repeats}")
    seconds = a.seconds if a.seconds is not None else (0.3 if a.quick else 1.0)
    wire = None if a.wire_dtype == "none" else a.wire_dtype
    links = [x for x in a.cross_host.split(",") if x]
    if links:
        import cross_host as xh

        for x in links:
            try:
                xh.parse_link(x)
            except ValueError as exc:
                p.error(f"--cross-host: {exc}")
    if a._invocation is not None:  # a child: one invocation, raw figures to the file
        a._invocation.write_text(json.dumps(_invocation(a, a.repeats, seconds, wire, links)))
        return 0
    args = list(argv if argv is not None else sys.argv[1:])
    command = "python bench/run_all.py" + ("" if not args else " " + " ".join(args))
    info = machine_info()
    runs = []
    with tempfile.TemporaryDirectory(prefix="tether-run-all-") as tmp:
        for i in range(invocations):
            out = Path(tmp) / f"invocation-{i}.json"
            tp.log_stderr(f"invocation {i + 1}/{invocations}")
            child = [a_ for a_ in args if a_ != "--check"] + ["--_invocation", str(out)]
            subprocess.run([sys.executable, str(Path(__file__).resolve()), *child], check=True)
            runs.append(json.loads(out.read_text()))
    res = merge([r["results"] for r in runs])
    invs = [r["invocation"] for r in runs]
    info["load"], info["load_end"] = invs[0]["load_start"], invs[-1]["load_end"]
    try:
        json_name = str(a.json.resolve().relative_to(_HERE.parent))
    except ValueError:
        json_name = str(a.json)
    # The raw figures first: a run of half an hour must not be lost to the rendering.
    a.json.write_text(json.dumps({"machine": info, "command": command, "invocations": runs, "repeats": a.repeats,
                                  "seconds": seconds, "quick": a.quick}, indent=1))
    text = render(res, info, command, a.quick, a.repeats, seconds, json_name, invs)
    gpu = _gpu_section(a.out)
    a.out.write_text(text.rstrip() + "\n\n" + gpu)
    print(text)
    print(f"\nwrote {a.out} and {a.json}", file=sys.stderr)
    missed = [f"{t['name']} ({t['where']})" for t in targets(res) if t["ratio"][0] < TARGETS[t["key"]]]
    if missed:
        print("targets not met (median over invocations): " + "; ".join(missed), file=sys.stderr)
    return 1 if (a.check and missed) else 0


if __name__ == "__main__":
    sys.exit(main())
