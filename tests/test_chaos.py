"""A CI-sized chaos run (bench/chaos.py): a real ssp:2 job of 4 workers x 3 shards while a seeded
schedule SIGKILLs, SIGSTOPs and restarts shards, workers and two ledger writers for ~30 s.
Every fault is recovered from, no acknowledged push is lost (beyond those a SIGKILLed shard
acknowledged after its last checkpoint, by design) or applied twice, the model still learns,
and nothing is left behind: processes, the launcher's file descriptors, the shards' file
descriptors and memfd regions, /dev/shm."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_a_job_under_chaos_recovers_loses_nothing_it_should_not_and_leaks_nothing(tmp_path: Path) -> None:
    out = tmp_path / "chaos.json"
    # 300 steps a worker outlast the schedule's first faults (a shard and a worker killed 3-6 s in;
    # worker faults end at 80% of the steps) and train well past the loss bar (0.45 vs 0.63 when run).
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "chaos.py"), "--modes", "ssp:2", "--seconds", "30", "--mean-gap", "3", "--steps", "300",
         "--vocab-size", "5000", "--eval-samples", "4000", "--no-baseline", "--seed", "3", "--out", str(tmp_path / "run"), "--json", str(out)],
        capture_output=True, text=True, timeout=280, check=False,
    )
    print(proc.stdout[-6000:])
    assert out.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    run = doc["results"][0]["chaos"]
    done = [f for f in run["faults"] if f["status"].startswith("done")]
    kinds = {(f["target"].split("-")[0], f["kind"]) for f in done}
    # The schedule starts with every (shard|worker) x (kill, stop, restart), 3 s apart on average.
    assert {("shard", "kill"), ("worker", "kill")} <= kinds, kinds
    assert len(done) >= 5, run["faults"]
    assert all(f["back_s"] is not None for f in done), done
    ledger = run["ledger"]["total"]
    assert ledger["lost"] == 0 and ledger["duplicated"] == 0, run["ledger"]
    assert ledger["acked"] > 300, ledger
    assert run["worker_unexpected_duplicates"] == 0
    leaks = run["leaks"]
    assert leaks["processes"] == [] and leaks["launcher_fds"] <= 0 and leaks["dev_shm_files"] == [], leaks
    for shard, state in leaks["shards_at_rest"].items():
        assert state["memfd_fds"] == 0 and state["memfd_maps"] == 0, (shard, state)
        assert state["fds"] <= state["fds_idle_at_start"], (shard, state)
    summary = run["summary"]
    assert summary["eval_loss"] < summary["baseline_loss"] - 0.05, summary
    assert sum(summary["restarts"].values()) >= 2, summary["restarts"]
    assert doc["problems"] == [] and proc.returncode == 0, doc["problems"]


def _chaos_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_chaos", ROOT / "bench" / "chaos.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_the_ledger_tells_a_loss_by_design_from_a_lost_push(tmp_path: Path) -> None:
    """What the run's 'lost 0' rests on: a push acknowledged before the checkpoint its shard came
    back from (or never killed) is a loss; one acknowledged after it, before the kill, is not."""
    chaos = _chaos_module()
    began = int(time.mktime(time.strptime("2030-01-01 00:00:06", "%Y-%m-%d %H:%M:%S")) * 1000)
    log = tmp_path / "shard-0.log"
    log.write_text(
        "2030-01-01 00:00:00,000 tether.server INFO shard 0/2 serving on 127.0.0.1:1 (plaintext)\n"
        f"2030-01-01 00:00:09,500 tether.server.checkpoints.checkpoint INFO restored checkpoint auto-{began} (this shard's part, 1 part(s)): ...\n"
        "2030-01-01 00:00:09,600 tether.server INFO shard 0/2 serving on 127.0.0.1:1 (plaintext)\n"
    )
    restores = {0: chaos._restores(log)}
    t0 = restores[0][0][0]
    assert restores[0][0][1] is None and restores[0][1][1] == t0 + 6.0
    kills = [(0, t0 + 8.0)]
    # (shard, sent or last failed, acked): applied by the shard in between.
    assert chaos._lost_by_design(0, t0 + 6.5, t0 + 7.0, kills, restores)  # acked after the checkpoint began, before the kill
    assert not chaos._lost_by_design(0, t0 + 4.8, t0 + 5.0, kills, restores)  # the checkpoint holds it: a loss
    assert not chaos._lost_by_design(0, t0 + 8.2, t0 + 8.5, kills, restores)  # sent after the kill, to the next incarnation
    # Sent before the kill and answered once, the answer read after it (the client was stopped
    # with it in its socket): the killed shard applied it.
    assert chaos._lost_by_design(0, t0 + 7.9, t0 + 8.3, kills, restores)
    # The same push retried after a failed attempt at 8.1: the next incarnation applied it.
    assert not chaos._lost_by_design(0, t0 + 8.1, t0 + 8.3, kills, restores)
    assert not chaos._lost_by_design(1, t0 + 6.5, t0 + 7.0, kills, restores)  # another shard, never killed


def test_a_step_checkpoint_is_dated_from_its_shards_log_line(tmp_path: Path) -> None:
    """--data parquet: worker 0 asks for checkpoints step-<clock> (they save the stream positions),
    whose ids carry no time; the ledger dates them from the shard's "checkpoint ID: N bytes in S s"
    line, less S, rather than calling every push acknowledged before the restore lost."""
    chaos = _chaos_module()
    log = tmp_path / "shard-0.log"
    log.write_text(
        "2030-01-01 00:00:00,000 tether.server INFO shard 0/2 serving on 127.0.0.1:1 (plaintext)\n"
        "2030-01-01 00:00:06,250 tether.server.checkpoints.checkpoint INFO checkpoint step-75: 1234 bytes in 0.25s (/x/step-75)\n"
        "2030-01-01 00:00:09,500 tether.server.checkpoints.checkpoint INFO restored checkpoint step-75 (complete, 1 part(s)): ...\n"
        "2030-01-01 00:00:09,600 tether.server INFO shard 0/2 serving on 127.0.0.1:1 (plaintext)\n"
        "2030-01-01 00:00:12,000 tether.server.checkpoints.checkpoint INFO restored checkpoint step-99 (complete, 1 part(s)): ...\n"
        "2030-01-01 00:00:12,100 tether.server INFO shard 0/2 serving on 127.0.0.1:1 (plaintext)\n"
    )
    restores = chaos._restores(log)
    t0 = restores[0][0]
    assert abs(restores[1][1] - (t0 + 5.99)) < 1e-6  # begun 6.25 - 0.25 s, less 0.01 s for rounding
    assert restores[2][1] == t0 + 12.0  # no line for it: dated at its restore, so nothing before it is excused
    kills = [(0, t0 + 8.0)]
    assert chaos._lost_by_design(0, t0 + 6.5, t0 + 7.0, kills, {0: restores})
    assert not chaos._lost_by_design(0, t0 + 4.8, t0 + 5.0, kills, {0: restores})


def test_the_parquet_table_holds_every_workers_steps_in_one_epoch(tmp_path: Path, monkeypatch) -> None:
    """--data parquet: the synthetic click log as a Criteo-shaped table the job reads, with
    row groups enough that each of the workers' shares holds its steps' samples."""
    chaos = _chaos_module()
    monkeypatch.setattr(chaos, "PARQUET_ROW_GROUP_ROWS", 500)
    import argparse

    from tether.worker.data.parquet import HoldOut, ParquetStream, criteo_parquet_columns

    a = argparse.Namespace(steps=10, batch_size=64, workers=3)
    rows = chaos.parquet_rows(a)
    assert rows % (500 * 3) == 0
    path = tmp_path / "ctr.parquet"
    chaos.write_parquet(path, rows, num_sparse=3, vocab_size=100, seed=1)
    dense, ids = criteo_parquet_columns(path)
    assert (len(dense), ids) == (13, ["C1", "C2", "C3"])
    for rank in range(3):
        stream = ParquetStream(path, 64, rank=rank, world_size=3, epochs=1, dense=dense, ids=ids, ctr=True, holdout=HoldOut.every_nth(10))
        assert sum(1 for _ in stream) >= a.steps
