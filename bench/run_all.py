"""Run every benchmark, side by side with the peer and the ceilings, and rewrite ``RESULTS.md``.

    python bench/run_all.py            # the reference run (about 15 minutes on 2 cores)
    python bench/run_all.py --quick    # CI-sized (a few minutes); says so in the file

What runs (``bench/tether_ps.py`` holds the measurements): dense push + pull MiB/s 4 KiB ..
64 MiB against the ``torch.distributed.rpc`` parameter server, raw grpc and raw sockets;
small-call rate and latency; sparse rows/s with 1 and 2 shards (a pull then a push per step, and
one push_pull per step on both sides); the shard's in-process apply rate; samples/s of the
default model (1, 2 workers x 1, 2 shards) against the same model in one process; and tether
again with a ``bfloat16`` wire. Each comparison is the median of
``--repeats`` back-to-back repeats. The file's last section, ``## GPU (NVIDIA H100)``, is
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
import time
from pathlib import Path
from typing import Any

_HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(_HERE))

import step_budget as sb  # noqa: E402
import tether_ps as tp  # noqa: E402  (sets OMP_NUM_THREADS=1 before torch is imported)
from _common import MIB, QUICK_SIZES, SIZES, fmt_size, markdown_table  # noqa: E402

__all__ = ["GPU_HEADING", "TARGETS", "machine_info", "main", "render"]

GPU_HEADING = "## GPU (NVIDIA H100)"
TARGETS = {
    "dense_4mib_vs_peer": 1.25,
    "sparse_2_shards_vs_peer": 2.0,
    "model_1w1s_vs_in_process": 0.70,
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
    return {
        "cpu": cpu,
        "cores": str(os.cpu_count()),
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


def _loadavg() -> str:
    """1-minute load average (other work on the machine skews every figure)."""
    try:
        return Path("/proc/loadavg").read_text().split()[0]
    except OSError:
        return "unknown"


def data_ms_per_batch(batch_size: int = 256, batches: int = 300) -> float:
    """Milliseconds to generate one synthetic training batch (what the data thread of a tether
    worker, and of the in-process side, pays per step)."""
    from tether.worker.data import SyntheticClickLog, SyntheticConfig

    it = SyntheticClickLog(SyntheticConfig()).batches(batch_size, batches + 1)
    next(it)
    t0 = time.perf_counter()
    for _ in range(batches):
        next(it)
    return (time.perf_counter() - t0) / batches * 1e3


# --------------------------------------------------------------------------- measuring


def measure(quick: bool, repeats: int, seconds: float, wire: str | None, log: Any = tp._stderr) -> dict[str, Any]:
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


# --------------------------------------------------------------------------- rendering


def _med(xs: list[float]) -> float:
    return statistics.median(xs)


def _ratio(t: list[float], o: list[float], invert: bool = False) -> tuple[float, float, float]:
    """Ratio of medians and the per-repeat range; ``invert`` for lower-is-better figures."""
    if invert:
        t, o = o, t
    per = [a / b for a, b in zip(t, o, strict=True)]
    return _med(t) / _med(o), min(per), max(per)


def _rx(r: tuple[float, float, float]) -> str:
    return f"{r[0]:.2f}x ({r[1]:.2f}-{r[2]:.2f})" if len({round(r[1], 2), round(r[2], 2)}) > 1 else f"{r[0]:.2f}x"


def _verdict(value: float, target: float) -> str:
    return "met" if value >= target else "**not met**"


def _phase_str(phases: dict[str, float]) -> str:
    keys = ("pull_wait", "compute", "push", "staleness_wait")
    return ", ".join(f"{k} {phases[k]:.0%}" for k in keys if phases.get(k, 0) >= 0.005)


def targets(res: dict[str, Any]) -> list[dict[str, Any]]:
    """Each DESIGN.md target with its measured ratio."""
    d4 = res["dense"][fmt_size(_TARGET_SIZE)]
    sp2 = res["sparse"]["2"]
    one = res["model"]["tether"]["1x1:float32"]
    return [
        {"name": "dense push/pull, 4 MiB fp32, vs rpc peer", "key": "dense_4mib_vs_peer",
         "ratio": _ratio(d4["tether"], d4["peer"]), "tether": _med(d4["tether"]), "other": _med(d4["peer"]), "unit": "MiB/s"},
        {"name": "sparse rows/s, 4096 x 64, 2 shards, vs rpc peer", "key": "sparse_2_shards_vs_peer",
         "ratio": _ratio(sp2["tether"], sp2["peer"]), "tether": _med(sp2["tether"]), "other": _med(sp2["peer"]), "unit": "rows/s"},
        {"name": "default model, 1 worker + 1 shard, vs in one process", "key": "model_1w1s_vs_in_process",
         "ratio": _ratio(one, res["model"]["in_process"]), "tether": _med(one), "other": _med(res["model"]["in_process"]),
         "unit": "samples/s"},
    ]


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
    json_name: str = "bench/results.json",
) -> str:
    """RESULTS.md without its GPU section."""
    L: list[str] = ["# Benchmark results", ""]
    L.append(
        "Written by `bench/run_all.py`; do not edit by hand except the GPU section at the end, which the script keeps "
        "verbatim. Every ratio is tether / the other side, measured side by side in this run: the median of "
        f"{repeats} back-to-back repeat(s), alternating which side runs first; the range in brackets is the lowest "
        "and highest per-repeat ratio. MiB/s is 2**20 bytes per second, bytes pushed plus bytes pulled."
    )
    if quick:
        L += ["", "> **Quick (CI-sized) run**: short measurements and fewer sizes; not the reference figures."]
    L += ["", "## Machine", ""]
    L.append(markdown_table(["", ""], [
        ["CPU", info["cpu"]], ["cores", info["cores"]], ["RAM", info["ram"]], ["OS", info["os"]],
        ["Python", info["python"]], ["torch", info["torch"]], ["grpcio", info["grpcio"]],
        ["protobuf", info["protobuf"]], ["numpy", info["numpy"]], ["date", info["date"]], ["commit", info["commit"]],
        ["load average (1 min) at start / end", f"{info['load']} / {info.get('load_end', '?')}"],
    ]))
    L += ["", "## Command", "", "```", command, "```", "",
          f"{repeats} repeat(s), {seconds:g} s per dense size, {2 * seconds:g} s per small-call and sparse figure, "
          f"{res['model']['steps']} steps x {res['model']['batch_size']} samples per model run; one torch thread in every "
          f"process (`OMP_NUM_THREADS=1`, as `tether launch` gives its children); loopback. Whole run: "
          f"{res['wall_s'] / 60:.1f} min. Raw per-repeat figures: `{json_name}`. The machine was not reserved: a load "
          f"average above {info['cores']} means other processes competed for the cores, which slows the figures "
          f"(both sides of a comparison alike, since they alternate)."]

    L += ["", "## Targets (DESIGN.md)", ""]
    trows = []
    for t in targets(res):
        target = TARGETS[t["key"]]
        trows.append([t["name"], f"{t['tether']:,.0f} {t['unit']}", f"{t['other']:,.0f} {t['unit']}", _rx(t["ratio"]),
                      f">= {target:.2f}x", _verdict(t["ratio"][0], target)])
    L.append(markdown_table(["target", "tether", "other", "ratio", "target", ""], trows))

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
        target = ">= 0.70x: " + _verdict(r[0], 0.70) if key == "1x1:float32" else ""
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
    L += ["", "## What limits us", "", limits(res), ""]
    return "\n".join(L)


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


def main(argv: list[str] | None = None) -> int:
    """Run everything, write RESULTS.md and results.json; returns the exit code."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="CI-sized run: fewer sizes, shorter measurements, 1 repeat")
    p.add_argument("--repeats", type=int, help="back-to-back repeats per comparison (default 3, quick 1)")
    p.add_argument("--seconds", type=float, help="time per dense size (default 1.0, quick 0.3)")
    p.add_argument("--wire-dtype", default="bfloat16", choices=["bfloat16", "float16", "none"],
                   help="also measure tether with this wire dtype (none: skip)")
    p.add_argument("--out", type=Path, default=_HERE / "RESULTS.md", help="Markdown file to rewrite")
    p.add_argument("--json", type=Path, default=_HERE / "results.json", help="raw per-repeat figures")
    p.add_argument("--check", action="store_true", help="exit 1 if a DESIGN.md target is missed")
    a = p.parse_args(argv)
    repeats = a.repeats if a.repeats is not None else (1 if a.quick else 3)
    if repeats < 1:
        p.error(f"--repeats must be >= 1, got {repeats}")
    seconds = a.seconds if a.seconds is not None else (0.3 if a.quick else 1.0)
    wire = None if a.wire_dtype == "none" else a.wire_dtype
    command = "python bench/run_all.py" + ("" if argv is None and len(sys.argv) == 1 else " " + " ".join(argv if argv is not None else sys.argv[1:]))
    import torch

    torch.set_num_threads(1)
    info = machine_info()
    res = measure(a.quick, repeats, seconds, wire)
    info["load_end"] = _loadavg()
    try:
        json_name = str(a.json.resolve().relative_to(_HERE.parent))
    except ValueError:
        json_name = str(a.json)
    # The raw figures first: a run of a quarter of an hour must not be lost to the rendering.
    a.json.write_text(json.dumps({"machine": info, "command": command, "repeats": repeats, "seconds": seconds,
                                  "quick": a.quick, "results": res}, indent=1))
    text = render(res, info, command, a.quick, repeats, seconds, json_name)
    gpu = _gpu_section(a.out)
    a.out.write_text(text.rstrip() + "\n\n" + gpu)
    print(text)
    print(f"\nwrote {a.out} and {a.json}", file=sys.stderr)
    missed = [t["name"] for t in targets(res) if t["ratio"][0] < TARGETS[t["key"]]]
    if missed:
        print("targets not met: " + "; ".join(missed), file=sys.stderr)
    return 1 if (a.check and missed) else 0


if __name__ == "__main__":
    sys.exit(main())
