"""``bench/job_anatomy.py``'s probe, loaded by every process of the job it starts (this folder is
put first on ``PYTHONPATH``; Python imports ``sitecustomize`` at start-up). Where
``TETHER_ANATOMY_OUT`` is set, a daemon thread waits until the process has imported a worker's
or a shard's modules, wraps the calls named below in a counter of thread CPU time and calls, and
writes the counters, with the process's CPU time, to ``$TETHER_ANATOMY_OUT.<pid>.json`` once a
second. The wrapped calls are timed on the thread that makes them (time spent waiting for a lock
or a reply is not counted); a call inside another is counted in both."""

from __future__ import annotations

import collections
import functools
import importlib
import json
import os
import sys
import threading
import time
from typing import Any

# (module, class or None, names, label prefix): a worker's step and client, a shard's handler and tables.
_WORKER = [
    ("tether.worker.training.step", "Step", ("run", "_compute", "_push", "_pull"), "step."),
    ("tether.worker.cache.client", "CachedClient", ("_due", "_plan"), "client."),
    ("tether.worker.cache.row_cache", "RowCache", ("plan", "merge", "accumulate"), "cache."),
    ("tether.worker.client.ps_client", "PSClient", ("push_pull",), "ps_client."),
    ("tether.worker.client.router", "Router", ("push_requests", "pull_requests"), "router."),
]
_SHARD = [
    ("tether.server.serving.data_port", "DataPlaneServer", ("_answer",), "data_port."),
    ("tether.server.serving.handler", "RequestHandler", ("_push", "_pull"), "handler."),
    ("tether.server.storage.shard", "Shard", ("push", "pull", "_check_sparse"), "shard."),
    ("tether.server.storage.tables", "EmbeddingTable",
     ("push", "push_counted", "largest_staleness", "_count", "_apply", "locate", "_insert", "checked"), "table."),
]
# Functions a module imported by name: wrapped where each of these modules uses them.
_SHARD_FUNCTIONS = [("tether.rules.push_hooks", ("check_combined", "part_rows", "apply_rows"),
                     ("tether.server.storage.shard", "tether.server.storage.tables"))]
# The worker row cache's compiled passes, one by one (labels "pass.<name>").
_WORKER_FUNCTIONS = [("tether.worker.cache.batch", ("plan_all", "store_all", "hold_all", "take_all", "with_unheld", "later_all"),
                      ("tether.worker.cache.row_cache",)),
                     ("tether.worker.cache.split", ("pack_push", "group_ids"), ("tether.worker.cache.row_cache",))]


def _wrap(counters: dict[str, collections.Counter[str]], name: str, fn: Any) -> Any:
    cpu, calls = counters["cpu"], counters["calls"]

    @functools.wraps(fn)
    def timed(*args: Any, **kwargs: Any) -> Any:
        start = time.thread_time_ns()
        try:
            return fn(*args, **kwargs)
        finally:
            cpu[name] += time.thread_time_ns() - start
            calls[name] += 1

    return timed


def _install(out: str) -> None:
    role, spec = None, []
    while role is None:
        if "tether.worker.training.step" in sys.modules:
            role, spec = "worker", _WORKER
        elif "tether.server.serving.data_port" in sys.modules:
            role, spec = "shard", _SHARD
        else:
            time.sleep(0.05)
    time.sleep(0.5)  # its other modules imported by now
    counters: dict[str, collections.Counter[str]] = {"cpu": collections.Counter(), "calls": collections.Counter()}
    for module, cls, names, prefix in spec:
        owner = getattr(importlib.import_module(module), cls)
        for n in names:
            if n in vars(owner):  # a call another version of tether lacks is left out
                setattr(owner, n, _wrap(counters, prefix + n, getattr(owner, n)))
    functions, label = (_SHARD_FUNCTIONS, "push_hooks.") if role == "shard" else (_WORKER_FUNCTIONS, "pass.")
    if role == "shard" or "tether.worker.cache.row_cache" in sys.modules:
        for module, names, users in functions:
            home = importlib.import_module(module)
            for n in names:
                if not hasattr(home, n):  # as above: another version's
                    continue
                wrapped = _wrap(counters, label + n, getattr(home, n))
                for user in (home, *(importlib.import_module(u) for u in users)):
                    if hasattr(user, n):
                        setattr(user, n, wrapped)
    path = f"{out}.{os.getpid()}.json"
    while True:
        time.sleep(1.0)
        snapshot = {"role": role, "time": time.time(), "process_ns": time.process_time_ns(),
                    "cpu": dict(counters["cpu"]), "calls": dict(counters["calls"])}
        with open(path + ".tmp", "w") as f:
            json.dump(snapshot, f)
        os.replace(path + ".tmp", path)


if os.environ.get("TETHER_ANATOMY_OUT"):
    threading.Thread(target=_install, args=(os.environ["TETHER_ANATOMY_OUT"],), daemon=True, name="anatomy-probe").start()
