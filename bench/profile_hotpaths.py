"""Where tether's time goes: py-spy profiles of the shard and the client/worker processes.

    pip install py-spy
    python bench/profile_hotpaths.py dense     # 4 MiB fp32 push + pull, 1 shard
    python bench/profile_hotpaths.py sparse    # 4096 x 64 pull + push, SGD, 1 shard
    python bench/profile_hotpaths.py model     # default model, 1 worker + 1 shard

Starts real processes as the benchmarks do (``LocalCluster``, one torch thread each), lets the
workload warm up, attaches ``py-spy record`` to every process for ``--seconds``, and prints,
per process: the share of samples by thread, the leaf functions with the most self time, and
the lines *in tether's code* (``server/``, ``worker/``, ``protos/``) under which the samples fall
(the deepest tether frame of each sample, so a line's share includes the library calls it
makes). Raw collapsed stacks are kept in ``--out`` for flame graphs.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ["OMP_NUM_THREADS"] = "1"

_HERE = Path(__file__).resolve().parent
_ROOT = _HERE.parent
sys.path.insert(0, str(_HERE))

__all__ = ["main", "summarize"]

_OURS = re.compile(r"\((?:.*/)?(?:server|worker|protos|deploy)/[^/]+\.py:\d+\)$")
_FRAME = re.compile(r"^(?P<func>.*) \((?P<file>[^()]*):(?P<line>\d+)\)$")


# --------------------------------------------------------------------------- client workloads


def _client_loop(workload: str, addresses: list[str], seconds: float) -> None:
    import torch

    from tether.common.allocator import tune_malloc
    from tether.protos.specs import OptimizerConfig, TableConfig
    from tether.worker.client.config import ClientConfig
    from tether.worker.client.ps_client import PSClient

    tune_malloc()  # what tether's own worker processes do at start-up

    torch.set_num_threads(1)
    client = PSClient(ClientConfig(addresses=tuple(addresses), worker_id="profile", timeout_s=60.0))
    sgd = OptimizerConfig("sgd", lr=0.01)
    if workload == "dense":
        n = (4 << 20) // 4
        client.declare(dense={"d": torch.zeros(n)}, dense_optimizer=sgd)
        grad = torch.randn(n)

        def step() -> None:
            client.push(dense={"d": grad}).result()
            client.pull(dense=["d"]).result()
    else:
        client.declare([TableConfig("emb", dim=64, optimizer=sgd)])
        gen = torch.Generator().manual_seed(0)
        sets = []
        for _ in range(8):
            ids = torch.randint(0, 2**40, (8192,), generator=gen).unique()[:4096]
            sets.append(ids[torch.randperm(len(ids), generator=gen)])
        it = iter(range(1 << 62))

        def step() -> None:
            ids = sets[next(it) % 8]
            rows = client.pull({"emb": ids}).result().rows["emb"]
            client.push({"emb": (ids, rows.mul(0.01))}).result()

    deadline = time.monotonic() + seconds
    steps = 0
    while time.monotonic() < deadline:
        step()
        steps += 1
    print(f"steps {steps}", flush=True)
    client.close()


# --------------------------------------------------------------------------- analysis


# A sample whose stack holds one of these is a thread waiting (on a lock, a queue, a poller),
# not working; native sampling cannot tell them apart from work by itself.
_WAITING = (
    "PyThread_acquire_lock_timed", "pthread_cond_wait", "pthread_cond_timedwait", "epoll_wait", "sem_wait",
    "sem_timedwait", "Condition.wait (", "_queue_SimpleQueue_get", "Event.wait (", "__futex_abstimed_wait",
    "poll (libc", "select (libc", "nanosleep",
)


def summarize(path: Path, top: int = 12) -> str:
    """Text report of one py-spy raw (collapsed) profile; waiting samples are left out."""
    threads: collections.Counter[str] = collections.Counter()
    leaves: collections.Counter[str] = collections.Counter()
    ours: collections.Counter[str] = collections.Counter()
    total = busy = 0
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        frames = stack.split(";")
        thread = frames[0] if frames[0].startswith(("thread", "process")) else "?"
        body = [f for f in frames if not f.startswith(("thread", "process"))]
        if not body:
            continue
        total += n
        if any(w in f for f in body for w in _WAITING):
            continue
        busy += n
        threads[_thread_kind(thread)] += n
        leaves[_short(body[-1])] += n
        mine = [f for f in body if _OURS.search(f)]
        if mine:
            ours[_short(mine[-1])] += n
        else:
            py = [f for f in body if ".py:" in f]
            ours["(no tether frame) " + _short(py[-1] if py else body[-1])] += n
    if not busy:
        return f"{path.name}: no busy samples ({total} in all)\n"
    out = [f"{path.name}: {busy} busy samples of {total} ({busy / total:.0%}; the rest are threads waiting); shares of busy"]
    out.append("  by thread: " + ", ".join(f"{k} {v / busy:.0%}" for k, v in threads.most_common()))
    out.append("  deepest tether line (inclusive of the library calls it makes):")
    out += [f"    {v / busy:6.1%}  {k}" for k, v in ours.most_common(top)]
    out.append("  leaf functions (self time):")
    out += [f"    {v / busy:6.1%}  {k[:160]}" for k, v in leaves.most_common(top)]
    return "\n".join(out) + "\n"


def _short(frame: str) -> str:
    m = _FRAME.match(frame)
    if not m:
        return frame
    f = m["file"]
    for marker in ("/server/", "/worker/", "/protos/", "/deploy/", "/site-packages/", "/lib/python3"):
        if marker in f:
            f = f[f.index(marker) + 1 :]
            break
    return f"{m['func']} ({f}:{m['line']})"


def _thread_kind(thread: str) -> str:
    """``thread (123): tether-rpc_3`` -> ``tether-rpc`` (pool threads grouped by prefix)."""
    name = thread.partition(": ")[2] or thread
    return re.sub(r"(_\d+|-\d+)$", "", name) or "?"


# --------------------------------------------------------------------------- driver


def _thread_cpu(pid: int) -> dict[str, float]:
    """CPU seconds (user + system) so far per thread name of ``pid`` (``/proc``; Linux only)."""
    tick = os.sysconf("SC_CLK_TCK")
    out: collections.Counter[str] = collections.Counter()
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            stat = (task / "stat").read_text()
        except OSError:
            continue
        name = stat[stat.index("(") + 1 : stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2 :].split()
        out[_thread_kind(": " + name)] += (int(fields[11]) + int(fields[12])) / tick
    return dict(out)


def _cpu_report(before: dict[str, float], after: dict[str, float], seconds: float, label: str) -> str:
    delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    total = sum(delta.values())
    parts = ", ".join(f"{k} {v / seconds:.2f}" for k, v in sorted(delta.items(), key=lambda kv: -kv[1]) if v > 0.005 * seconds)
    return f"{label}: {total / seconds:.2f} cores busy ({parts})"


def _perf(pid: int, seconds: float, out: Path) -> subprocess.Popen:
    return subprocess.Popen(
        ["perf", "record", "-F", "499", "-g", "-p", str(pid), "-o", str(out), "--", "sleep", str(seconds)],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )


def perf_summary(path: Path, top: int = 15) -> str:
    """Top symbols by self time, with the thread (comm) and library they run in."""
    res = subprocess.run(
        ["perf", "report", "-i", str(path), "--stdio", "--no-children", "--sort", "comm,dso,sym", "-g", "none",
         "--percent-limit", "0.7"],
        capture_output=True, text=True, timeout=300,
    )
    rows = [ln.strip() for ln in res.stdout.splitlines() if ln.strip() and not ln.startswith("#") and "%" in ln]
    return f"{path.name} (perf, self time, all threads incl. grpc core and kernel):\n" + "\n".join(
        "    " + r[:170] for r in rows[:top]
    ) + "\n"


def _record(pid: int, seconds: float, out: Path, rate: int, native: bool, gil: bool = False) -> subprocess.Popen:
    argv = ["py-spy", "record", "--pid", str(pid), "--duration", str(int(seconds)), "--rate", str(rate),
            "--format", "raw", "--threads", "--output", str(out)]
    # Native stacks need the process paused while sampling; Python-only sampling does not.
    argv.append("--native" if native else "--nonblocking")
    if gil:
        argv.append("--gil")
    return subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def main(argv: list[str] | None = None) -> int:
    """Profile one workload; print the report; keep raw profiles in ``--out``."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("workload", choices=["dense", "sparse", "model"])
    p.add_argument("--seconds", type=float, default=15.0, help="sampling time per process")
    p.add_argument("--warmup", type=float, default=5.0, help="seconds to run before sampling")
    p.add_argument("--rate", type=int, default=200, help="samples per second")
    p.add_argument("--native", action="store_true", help="include native (C/C++) frames in py-spy's stacks")
    p.add_argument("--gil", action="store_true",
                   help="sample only the thread holding the GIL (Python-level CPU; C code that releases the GIL is not seen)")
    p.add_argument("--perf", action="store_true", help="also record every process with Linux perf (grpc core threads, kernel)")
    p.add_argument("--out", type=Path, default=None, help="directory for the raw profiles (default: a temp dir)")
    p.add_argument("--report-only", action="store_true", help="summarize the raw profiles already in --out")
    p.add_argument("--_client", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--addresses", default="", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a._client:
        _client_loop(a.workload, a.addresses.split(","), a.seconds)
        return 0
    if a.report_only:
        if a.out is None:
            p.error("--report-only needs --out")
        report(a.out, a.workload, a.seconds, a.rate)
        return 0
    if shutil.which("py-spy") is None:
        print("py-spy is not installed: pip install py-spy", file=sys.stderr)
        return 2
    from tether.deploy.launch import LocalCluster
    from tether.worker.config import WorkerConfig

    out = a.out or Path(tempfile.mkdtemp(prefix="tether-profile-"))
    out.mkdir(parents=True, exist_ok=True)
    run_for = a.warmup + a.seconds + 10
    with LocalCluster(log_dir=out / "logs", grace_s=5.0) as cluster:
        addresses = cluster.start_shards(1, timeout_s=90)
        if a.workload == "model":
            # Long enough to outlast the sampling window at ~100 steps/s.
            cluster.start_workers(
                WorkerConfig(shards=tuple(addresses), steps=int(run_for * 150), batch_size=256, eval_samples=2000,
                             device="cpu", log_every=1000, out=str(out)),
                echo=False,
            )
            client_pid = cluster.workers[0].proc.pid
            client = None
        else:
            client = subprocess.Popen(
                [sys.executable, __file__, a.workload, "--_client", "--addresses", ",".join(addresses),
                 "--seconds", str(run_for)],
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"},
            )
            client_pid = client.pid
        try:
            time.sleep(a.warmup)
            pids = {"shard": cluster.shards[0].proc.pid, "client" if client else "worker": client_pid}
            cpu0 = {k: _thread_cpu(v) for k, v in pids.items()}
            t0 = time.monotonic()
            perfs = {k: _perf(v, a.seconds, out / f"{a.workload}-{k}.perf") for k, v in pids.items()} if a.perf else {}
            recs = {
                "shard": _record(cluster.shards[0].proc.pid, a.seconds, out / f"{a.workload}-shard.txt", a.rate, a.native, a.gil),
                "client" if client else "worker": _record(client_pid, a.seconds, out / f"{a.workload}-{'client' if client else 'worker'}.txt", a.rate, a.native, a.gil),
            }
            for name, rec in recs.items():
                try:
                    _, err = rec.communicate(timeout=a.seconds + 60)
                except subprocess.TimeoutExpired:
                    rec.kill()
                    _, err = rec.communicate()
                if rec.returncode:
                    print(f"py-spy on the {name} failed: {err.strip()[-500:]}", file=sys.stderr)
            for rec in perfs.values():
                try:
                    rec.communicate(timeout=a.seconds + 60)
                except subprocess.TimeoutExpired:
                    rec.kill()
                    rec.communicate()
            wall = time.monotonic() - t0
            cpu1 = {k: _thread_cpu(v) for k, v in pids.items()}
            (out / f"{a.workload}-cpu.txt").write_text(
                "\n".join(_cpu_report(cpu0[k], cpu1[k], wall, k) for k in pids) + "\n"
            )
        finally:
            if client is not None:
                client.terminate()
                try:
                    client.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    client.kill()
                    client.wait(timeout=5)
    report(out, a.workload, a.seconds, a.rate)
    return 0


def report(out: Path, workload: str, seconds: float, rate: int) -> None:
    """Print the summaries of the raw profiles of ``workload`` in ``out``."""
    print(f"# {workload}: py-spy, {seconds:g} s at {rate} Hz per process; raw profiles in {out}\n")
    cpu = out / f"{workload}-cpu.txt"
    if cpu.exists():
        print("CPU while sampling (cores, by thread name):\n" + cpu.read_text())
    for f in sorted(out.glob(f"{workload}-*.txt")):
        if f != cpu:
            print(summarize(f))
    for f in sorted(out.glob(f"{workload}-*.perf")):
        print(perf_summary(f))



if __name__ == "__main__":
    sys.exit(main())
