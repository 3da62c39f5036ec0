"""The row cache and the push window in real jobs (issue 29 items 4 and 5): held-out loss and
samples/s with and without the cache, at push windows K (``--push-window``), side by side in one
invocation, for the default CTR job and the MovieLens-format example (4 workers x 2 shards, async),
over loopback and over shaped links. The rows and bytes moved at each bound do not depend on the
machine: bench/traffic.py gives them for the same id streams.

    python bench/row_cache.py                    # both jobs, bound 20 beside no cache, 300 steps, 1 round
    python bench/row_cache.py --job ctr --bounds 5,20,20/2 --steps 200 --rounds 3
    python bench/row_cache.py --job ctr --admission all,recurring --links 0.1gbit --rounds 3
    python bench/row_cache.py --windows 1,3 --links loopback,1gbit:200us --steps 200 --json out.json
    python bench/row_cache.py --job movielens --workers 1 --shards 1 --bounds 20,20/5,20/1 --no-prefetch

With one worker and one shard a job's loss is (nearly) deterministic, so the loss columns compare
the cache's combined pushes and local updates with no cache; ``--no-prefetch`` also takes away
what prefetching changes (without a cache a step's rows miss the worker's last update; a cache's
local copy has it), so there cache 20/0 is exactly no cache and what remains is the combined push.

Links: ``loopback`` runs every process here (``run_job``; a worker and a shard on one machine talk
through shared memory, so a row saved costs the wire almost nothing). ``RATEgbit[:RTTus]`` runs the
shards in one network namespace and the workers in another, joined by a veth pair shaped with
``tc`` (``bench/cross_host.py``'s ``netns_link``: needs root or CAP_SYS_ADMIN), with
``--transport tcp``: every byte saved is wire time saved. Each round runs every configuration
(the order alternates between rounds) in fresh processes; ratios are against no cache at K = 1 on
the same link.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

_HERE = Path(__file__).resolve().parent
ROOT = _HERE.parent
sys.path.insert(0, str(_HERE))
sys.path.insert(0, str(ROOT / "examples" / "movielens_two_tower"))

from cross_host import _env, _result, _stop, netns_link, netns_rights, parse_link, start_shards  # noqa: E402
from movielens import write_ratings  # noqa: E402

from tether.common.choices import CACHE_ADMISSIONS  # noqa: E402
from tether.deploy.job import run_job  # noqa: E402
from tether.deploy.launch import LocalCluster, Program  # noqa: E402
from tether.worker.config import WorkerConfig  # noqa: E402
from tether.worker.training.run_record import RunRecord  # noqa: E402

WORKERS, SHARDS = 4, 2
_TIMEOUT_S = 1800.0


def _program(kind: str, ratings: Path) -> Program | None:
    return Program.script(str(ROOT / "examples" / "movielens_two_tower" / "train.py"), ["--data", str(ratings)]) \
        if kind == "movielens" else None


Result = tuple[float, float, dict[str, float]]  # held-out loss, samples/s, each phase's share of the workers' step time


def _shares(phases: list[dict[str, float]]) -> dict[str, float]:
    """Each phase's share of the step time summed over the workers."""
    total = {k: sum(p.get(k, 0.0) for p in phases) for k in phases[0]} if phases else {}
    whole = sum(total.values()) or 1.0
    return {k: round(v / whole, 4) for k, v in total.items()}


def _movielens_on_shards(addresses: list[str], workers: int, ratings: Path, seed: int = 0, optimizer: str = "adagrad") -> float:
    """The MovieLens-format example's held-out MSE with the parameters the shards hold now (its
    model and tables, as train.py declares them; read past any worker's cache)."""
    from movielens import read_ratings
    from torch import nn
    from train import TwoTower

    from tether.worker.config import TrainingConfig
    from tether.worker.training.trainer import Trainer

    train, held_out = read_ratings(ratings, 0, workers)
    model = TwoTower(16, float(train["rating"].mean()))
    # The job's seed and rule (the tables' spec: a shard refuses a table declared again with another).
    config = TrainingConfig(shards=tuple(addresses), num_workers=workers, worker_index=0, mode="async", seed=seed, optimizer=optimizer)

    def mse(m: nn.Module, b: dict[str, Any]) -> Any:
        return nn.functional.mse_loss(m(b), b["rating"])

    held = [{k: v[i:i + 4096] for k, v in held_out.items()} for i in range(0, len(held_out["rating"]), 4096)]
    sparse = {"user": "user", "movie": "movie", "user_bias": "user", "movie_bias": "movie"}
    with Trainer(model, config, loss=mse, sparse=lambda b: {t: b[c] for t, c in sparse.items()}, printer=lambda line: None) as t:
        return float(t.evaluate(held, lambda m, b: {"eval_mse": float(mse(m, b))})["eval_mse"])


class _FinalShards:
    """A ``run_job`` ``during`` context: once every worker finished, the MovieLens model's
    held-out MSE on the shards (``loss``), before they stop."""

    def __init__(self, workers: int, ratings: Path, seed: int = 0, optimizer: str = "adagrad") -> None:
        self.workers, self.ratings, self.seed, self.optimizer, self.loss = workers, ratings, seed, optimizer, float("nan")
        self.cluster: LocalCluster | None = None

    def __call__(self, cluster: LocalCluster) -> _FinalShards:
        self.cluster = cluster
        return self

    def __enter__(self) -> _FinalShards:
        return self

    def __exit__(self, kind: object, *exc: object) -> None:
        if kind is None and self.cluster is not None:
            self.loss = _movielens_on_shards(list(self.cluster.addresses), self.workers, self.ratings, self.seed, self.optimizer)


def _job(kind: str, template: WorkerConfig, folder: Path, ratings: Path, shards: int = SHARDS) -> Result:
    """(held-out loss, samples/s, phase shares) of one job, every process on this machine. The
    loss is the final model's as the shards hold it once every worker finished (the CTR job's
    evaluation; the MovieLens example's, not worker 0's own, taken while others may still train)."""
    final = _FinalShards(template.num_workers, ratings, template.seed, template.optimizer) if kind == "movielens" else None
    summary: dict[str, Any] = run_job(template, shards, out=folder, timeout_s=_TIMEOUT_S, echo=False, program=_program(kind, ratings),
                                      during=final)
    loss = final.loss if final is not None else summary["eval_loss"]
    return float(loss), float(summary["samples_per_sec"]), _shares([w["phase_seconds"] for w in summary["workers"]])


def _job_over(place: Any, kind: str, kw: dict[str, Any], folder: Path, ratings: Path, shards: int) -> Result:
    """(held-out loss, samples/s, phase shares) of one job: shards on the link's server side, the workers (one
    child of this script running them) on its client side, over TCP."""
    folder.mkdir(parents=True, exist_ok=True)
    log = folder / "link.log"
    procs: list[subprocess.Popen[str]] = []
    with tempfile.TemporaryDirectory(prefix="tether-rowcache-") as tmp:
        try:
            addresses = start_shards(place, shards, tmp, log, procs)
            spec = {"kind": kind, "ratings": str(ratings),
                    "config": {**kw, "shards": addresses, "transport": "tcp", "out": str(folder)}}
            child = subprocess.Popen([*place.client_prefix, sys.executable, str(Path(__file__).resolve()), "--_workers", json.dumps(spec)],
                                     stdout=subprocess.PIPE, stderr=log.open("a"), text=True, env=_env(place.client_if),
                                     start_new_session=True)
            procs.append(child)
            got = _result(child, _TIMEOUT_S, f"{kind} workers", log)
        finally:
            _stop(procs)
    return float(got["loss"]), float(got["samples_per_sec"]), dict(got["phases"])


def _workers_main(text: str) -> int:
    """The client side of a link: the job's workers against the shards named, then the loss."""
    from tether.worker.ctr.job import evaluate_job

    spec = json.loads(text)
    cfg = WorkerConfig(**{**spec["config"], "shards": tuple(spec["config"]["shards"])})
    folder = Path(cfg.out or ".")
    with LocalCluster(log_dir=folder / "logs", grace_s=5.0) as cluster:
        cluster.addresses = list(cfg.shards)
        cluster.start_workers(cfg, echo=False, program=_program(spec["kind"], Path(spec["ratings"])))
        cluster.wait_workers(_TIMEOUT_S)
    records = [RunRecord.load(folder / f"worker-{i}.json") for i in range(cfg.num_workers)]
    sps = sum(r.samples for r in records) / max(r.wall_s for r in records)
    if spec["kind"] == "movielens":
        loss = (records[0].final_eval or {})["eval_mse"]
    else:
        loss = evaluate_job(cfg)["eval_loss"]
    print("RESULT " + json.dumps({"loss": loss, "samples_per_sec": sps, "phases": _shares([r.phase_seconds for r in records])}),
          flush=True)
    return 0


def _configs(a: argparse.Namespace, bounds: list[tuple[int, ...]], windows: list[int], admissions: list[str]) -> dict[str, dict[str, Any]]:
    """Each configuration's fields (beside the job's), by name."""
    base = {"num_workers": a.workers, "mode": "async", "steps": a.steps, "log_every": 10**6, "eval_every": 0, "seed": a.seed, "data_seed": a.seed,
            "prefetch": not a.no_prefetch}
    configs: dict[str, dict[str, Any]] = {}
    for k in windows:
        tail = "" if k == 1 else f" K={k}"
        configs["no cache" + tail] = {**base, "push_window": k}
        for b in bounds:
            for adm in admissions:
                name = "cache " + "/".join(map(str, b)) + ("" if adm == CACHE_ADMISSIONS[0] else f" {adm}") + tail
                configs[name] = {**base, "push_window": k, "cache_rows": a.cache_rows, "cache_bound": b[0], "cache_write_bound": b[-1],
                                 "cache_admission": adm}
    return configs


def _run_link(link: str, a: argparse.Namespace, configs: dict[str, dict[str, Any]], ratings: Path, tmp: Path) -> dict[str, Any]:
    """Every job and configuration over one link, ``rounds`` times; per job and configuration the
    (loss, samples/s) of each round."""
    out: dict[str, Any] = {}

    def rounds(place: Any) -> None:
        for kind in a.job or ["ctr", "movielens"]:
            results: dict[str, list[Result]] = {name: [] for name in configs}
            for r in range(a.rounds):
                names = list(configs) if r % 2 == 0 else list(reversed(list(configs)))
                for name in names:
                    folder = tmp / f"{link.replace(':', '-')}-{kind}-{r}-{name.replace(' ', '-').replace('/', '-').replace('=', '')}"
                    kw = configs[name]
                    results[name].append(_job(kind, WorkerConfig(shards=("127.0.0.1:1",), **kw), folder, ratings, a.shards)
                                         if place is None else _job_over(place, kind, kw, folder, ratings, a.shards))
                    loss, sps, shares = results[name][-1]
                    where = " ".join(f"{k} {v:.0%}" for k, v in shares.items() if v)
                    print(f"{link} {kind} round {r + 1} {name}: held-out loss {loss:.5f}, {sps:,.0f} samples/s ({where})", flush=True)
            out[kind] = results
            _report(link, kind, a, results)

    if link == "loopback":
        rounds(None)
    else:
        with netns_link(link) as place:
            if place.note:
                print(f"{link}: {place.note}", flush=True)
            rounds(place)
    return out


def _report(link: str, kind: str, a: argparse.Namespace, results: dict[str, list[Result]]) -> None:
    l0, s0 = (statistics.median(x[0] for x in results["no cache"]), statistics.median(x[1] for x in results["no cache"]))
    for name, v in results.items():
        l1, s1 = statistics.median(x[0] for x in v), statistics.median(x[1] for x in v)
        same = name.split(" K=")[0]  # the configuration at K = 1
        vs_k1 = f", {s1 / statistics.median(x[1] for x in results[same]):.2f}x its K=1" if " K=" in name else ""
        print(f"{link} {kind} ({a.workers} workers x {a.shards} shards, async, {a.steps} steps, median of {a.rounds}) {name}: "
              f"loss {l1:.5f} ({(l1 / l0 - 1):+.2%} vs no cache), {s1:,.0f} samples/s ({s1 / s0:.2f}x{vs_k1})", flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--job", action="append", choices=("ctr", "movielens"), help="repeatable; default both")
    p.add_argument("--bounds", default="20", help="cache bounds to run beside no cache: R (read = write bound) or R/W, "
                   "comma list; default 20")
    p.add_argument("--cache-rows", type=int, default=100_000, help="rows per table, default 100000")
    p.add_argument("--admission", default=CACHE_ADMISSIONS[0], help="the cache's admission (--cache-admission) at each bound, comma "
                   f"list of {', '.join(CACHE_ADMISSIONS)}; default {CACHE_ADMISSIONS[0]}")
    p.add_argument("--windows", default="1", help="push windows K to run each configuration at (--push-window), comma list; "
                   "default 1")
    p.add_argument("--links", default="loopback", help="loopback and/or RATEgbit[:RTTus] (two network namespaces joined by a "
                   "shaped veth, TCP), comma list; default loopback")
    p.add_argument("--steps", type=int, default=300, help="steps per worker, default 300")
    p.add_argument("--rounds", type=int, default=1, help="rounds of every configuration, default 1")
    p.add_argument("--seed", type=int, default=0, help="the jobs' seed and data seed (--seed, --data-seed: the initial model, the data's order), default 0")
    p.add_argument("--workers", type=int, default=WORKERS, help=f"workers, default {WORKERS}")
    p.add_argument("--shards", type=int, default=SHARDS, help=f"shards, default {SHARDS}")
    p.add_argument("--no-prefetch", action="store_true", help="every configuration without prefetching (--no-prefetch): a step's "
                   "pull waits for the previous push, so no cache reads what a cache's own updates give (isolates a combined push)")
    p.add_argument("--json", metavar="FILE", help="also write every round's (loss, samples/s) here")
    p.add_argument("--_workers", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a._workers:
        return _workers_main(a._workers)
    try:
        bounds = [tuple(int(x) for x in b.split("/")) for b in a.bounds.split(",") if b.strip()]
        windows = [int(k) for k in a.windows.split(",") if k.strip()]
    except ValueError:
        p.error(f"--bounds: R or R/W integers, --windows: integers, comma lists; got {a.bounds!r}, {a.windows!r}")
    if any(len(b) > 2 or min(b) < 0 for b in bounds) or a.steps < 2 or a.rounds < 1 or min(a.workers, a.shards) < 1:
        p.error("--bounds R or R/W >= 0, --steps >= 2, --rounds, --workers and --shards >= 1")
    if not windows or min(windows) < 1:
        p.error("--windows: integers >= 1")
    if a.no_prefetch and windows != [1]:
        p.error("--no-prefetch runs at push window 1 only")
    windows = sorted(set(windows) | {1})  # K = 1 is what the others are compared with
    links = [x.strip() for x in a.links.split(",") if x.strip()]
    for link in links:
        try:
            if link != "loopback" and parse_link(link)[0] != "shaped":
                raise ValueError
        except ValueError:
            p.error(f"--links: loopback or RATEgbit[:RTTus] (e.g. 1gbit:200us), got {link!r}")
    if any(link != "loopback" for link in links):
        why = netns_rights()
        if why is not None:
            print(f"shaped links skipped: {why}", flush=True)
            links = [link for link in links if link == "loopback"]
    admissions = [x.strip() for x in a.admission.split(",") if x.strip()]
    if not admissions or any(x not in CACHE_ADMISSIONS for x in admissions):
        p.error(f"--admission: a comma list of {', '.join(CACHE_ADMISSIONS)}, got {a.admission!r}")
    configs = _configs(a, bounds, windows, admissions)
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        ratings = Path(tmp) / "ratings.dat"
        write_ratings(ratings, 100_000, num_users=943, num_movies=1682, seed=0)
        for link in links:
            results[link] = _run_link(link, a, configs, ratings, Path(tmp))
    if a.json:
        Path(a.json).write_text(json.dumps({"args": {k: v for k, v in vars(a).items() if k != "_workers"}, "results": results},
                                           indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
