"""Parquet streams (tether.worker.data.parquet): row groups dealt to ranks, bags and offsets, the seeded
shuffle, epochs, held-out rules, exact resume, bad files as one line and exit 2 from the CLI,
memory that does not grow with the data, and the built-in job trained from ``--data parquet:``."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

from tether.worker.data.criteo import CriteoStream, criteo_eval_set, write_criteo_sample  # noqa: E402
from tether.worker.data.parquet import HoldOut, ParquetStream, hash_strings, parquet_files, write_criteo_parquet  # noqa: E402
from tether.worker.data.synthetic import Batch, DataError  # noqa: E402


def _table(n: int, seed: int = 0, start: int = 0) -> Any:
    """``n`` rows: row (a unique int id), user (a string key), label, two floats, a bag of 0-5 ids."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(0, 6, n)
    flat = rng.integers(0, 1000, int(lengths.sum()))
    bags = np.split(flat, np.cumsum(lengths)[:-1])
    return pa.table({
        "row": np.arange(start, start + n, dtype=np.int64),
        "user": [f"u{(start + i) % 97}" for i in range(n)],
        "label": rng.integers(0, 2, n).astype(np.int8),
        "x": rng.random(n),
        "y": rng.random(n).astype(np.float32),
        "hist": pa.array([b.tolist() for b in bags], type=pa.list_(pa.int64())),
    })


@pytest.fixture
def files(tmp_path: Path) -> list[Path]:
    """Two files, 1,000 and 700 rows, in row groups of 100 (so 17 row groups)."""
    out = []
    for i, (n, start) in enumerate([(1000, 0), (700, 1000)]):
        path = tmp_path / f"part-{i}.parquet"
        pq.write_table(_table(n, seed=i, start=start), path, row_group_size=100)
        out.append(path)
    return out


def _rows(batches: list[dict[str, torch.Tensor]]) -> np.ndarray:
    return np.concatenate([b["row"].numpy() for b in batches]) if batches else np.zeros(0, np.int64)


def _stream(files: list[Path], bs: int = 64, **kw: Any) -> ParquetStream:
    kw.setdefault("ids", ["row"])
    kw.setdefault("bags", ["hist"])
    kw.setdefault("dense", ["x", "y"])
    kw.setdefault("read_rows", 40)
    return ParquetStream(files, bs, **kw)


def _same(a: list[dict[str, torch.Tensor]], b: list[dict[str, torch.Tensor]]) -> bool:
    return len(a) == len(b) and all(x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x) for x, y in zip(a, b, strict=False))


# -- files, columns and batches ----------------------------------------------------------------------


def test_files_by_folder_glob_and_list(files: list[Path], tmp_path: Path) -> None:
    assert parquet_files(str(tmp_path)) == files
    assert parquet_files(f"parquet:{tmp_path}/part-*.parquet") == files
    assert parquet_files(",".join(map(str, files))) == files
    with pytest.raises(DataError, match="no file matches"):
        parquet_files(str(tmp_path / "nothing-*.parquet"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match=r"no .parquet file"):
        parquet_files(str(tmp_path / "empty"))


def test_columns_become_tensors_bags_become_ids_and_offsets(files: list[Path]) -> None:
    table = pa.concat_tables([pq.read_table(f) for f in files])
    batches = list(_stream(files, bs=128))
    assert [len(b["label"]) for b in batches] == [128] * 13 + [1700 - 13 * 128]
    b = batches[0]
    assert b["label"].dtype == torch.float32 and b["dense"].shape == (128, 2) and b["dense"].dtype == torch.float32
    assert b["row"].dtype == torch.int64 and b["hist"].dtype == torch.int64 and b["hist_offsets"].shape == (128,)
    assert np.array_equal(_rows(batches), np.arange(1700))
    # The bags, cut back at the offsets, are the lists of the table.
    hist = table.column("hist").to_pylist()
    for batch in batches:
        offsets = [*batch["hist_offsets"].tolist(), len(batch["hist"])]
        for i, r in enumerate(batch["row"].tolist()):
            assert batch["hist"][offsets[i] : offsets[i + 1]].tolist() == hist[r]
    assert np.allclose(np.concatenate([b["dense"][:, 0].numpy() for b in batches]), table.column("x").to_numpy().astype(np.float32))


def test_bags_survive_shuffle_and_holdout(files: list[Path]) -> None:
    table = pa.concat_tables([pq.read_table(f) for f in files])
    hist = table.column("hist").to_pylist()
    for batch in _stream(files, bs=50, shuffle_rows=300, seed=5, holdout=HoldOut.every_nth(4)):
        offsets = [*batch["hist_offsets"].tolist(), len(batch["hist"])]
        for i, r in enumerate(batch["row"].tolist()):
            assert r % 4 != 3
            assert batch["hist"][offsets[i] : offsets[i + 1]].tolist() == hist[r]


def test_inferred_columns_string_ids_and_nulls(tmp_path: Path) -> None:
    path = tmp_path / "nulls.parquet"
    pq.write_table(pa.table({
        "label": [1.0, 0.0, 1.0, 0.0],
        "f": pa.array([0.5, None, 2.0, 3.0], type=pa.float32()),
        "item": ["a", None, "b", "a"],
        "n": pa.array([7, None, -3, 2**40], type=pa.int64()),
        "tags": pa.array([["x", "y"], None, [], ["y"]], type=pa.list_(pa.string())),
    }), path)
    b = next(iter(ParquetStream(path, 4)))
    assert sorted(b) == ["dense", "item", "label", "n", "tags", "tags_offsets"]
    assert b["dense"][:, 0].tolist() == [0.5, 0.0, 2.0, 3.0]  # a null float reads as 0
    item = b["item"].tolist()
    assert item[0] == item[3] != item[2] and min(item) >= 0  # strings hashed, same string same id
    assert item[1] == int(hash_strings(pa.array(["item"]))[0] & np.uint64((1 << 62) - 1))  # a null: the column's reserved id
    assert b["n"].tolist()[::2] == [7, -3] and b["n"][3] == 2**40
    assert b["tags_offsets"].tolist() == [0, 2, 2, 2] and len(b["tags"]) == 3  # null and empty bags are empty
    assert b["tags"][1] == b["tags"][2]


def test_null_label_names_the_file_and_column(tmp_path: Path) -> None:
    path = tmp_path / "nolabel.parquet"
    pq.write_table(pa.table({"label": [1.0, None], "x": [1.0, 2.0], "id": [1, 2]}), path)
    with pytest.raises(DataError, match=r"nolabel.parquet: column 'label' \(the label\) has 1 null"):
        list(ParquetStream(path, 2))


def test_ctr_layout_is_the_criteo_readers_batches(tmp_path: Path) -> None:
    """``write_criteo_parquet`` then ``ParquetStream(ctr=True)`` yields what ``CriteoStream`` yields,
    and ``HoldOut.every_nth(10)`` holds out the lines ``holdout_every=10`` does."""
    tsv, out = tmp_path / "day.tsv", tmp_path / "day.parquet"
    write_criteo_sample(tsv, 3000, seed=4)
    assert write_criteo_parquet(tsv, out, row_group_rows=700) == 3000
    assert pq.ParquetFile(out).metadata.num_row_groups == 5
    ours = list(ParquetStream(out, 256, ctr=True, holdout=HoldOut.every_nth(10)))
    theirs = list(CriteoStream(tsv, 256, holdout_every=10))
    assert len(ours) == len(theirs) and all(isinstance(b, Batch) for b in ours)
    for a, b in zip(ours, theirs, strict=False):
        assert all(torch.equal(x, y) for x, y in zip(a, b, strict=False))
    held = next(iter(ParquetStream(out, 250, ctr=True, holdout=HoldOut.every_nth(10), held_out=True)))
    assert all(torch.equal(x, y) for x, y in zip(held, criteo_eval_set(tsv, 250, holdout_every=10), strict=False))


# -- ranks, shuffle, epochs, held out ----------------------------------------------------------------


def test_ranks_read_disjoint_row_groups_that_cover_every_row(files: list[Path]) -> None:
    world = 3
    shares = [_rows(list(_stream(files, bs=32, rank=r, world_size=world, shuffle_rows=200, seed=1))) for r in range(world)]
    together = np.concatenate(shares)
    assert np.array_equal(np.sort(together), np.arange(1700))  # every row once: disjoint and complete
    for share in shares:
        assert 500 <= len(share) <= 600  # 17 row groups of 100: 6, 6 and 5 of them
        first = share[share < 1000]
        assert 0 < len(first) < 1000  # no rank reads all of the first file
        assert all(np.isin(np.arange(g * 100, g * 100 + 100), share).all() for g in np.unique(share // 100))  # whole row groups


def test_too_few_row_groups_for_the_ranks(tmp_path: Path) -> None:
    path = tmp_path / "one.parquet"
    pq.write_table(_table(50), path)
    with pytest.raises(DataError, match=r"1 non-empty row group.* for 2 workers: worker 1 would read nothing"):
        ParquetStream(path, 8, rank=0, world_size=2)


def test_shuffle_is_deterministic_per_seed_and_mixes_row_groups(files: list[Path]) -> None:
    a = _rows(list(_stream(files, shuffle_rows=300, seed=7)))
    b = _rows(list(_stream(files, shuffle_rows=300, seed=7)))
    c = _rows(list(_stream(files, shuffle_rows=300, seed=8)))
    assert np.array_equal(a, b) and not np.array_equal(a, c)
    assert np.array_equal(np.sort(a), np.arange(1700)) and np.array_equal(np.sort(c), np.arange(1700))
    assert not np.array_equal(a, np.arange(1700))
    # A buffer of 300 rows holds rows of several row groups, interleaved.
    assert len(np.unique(a[:64] // 100)) >= 3


def test_epochs_run_on_and_reshuffle(files: list[Path]) -> None:
    rows = _rows(list(_stream(files, bs=100, epochs=3, shuffle_rows=300, seed=2)))
    assert len(rows) == 3 * 1700
    epochs = [rows[i * 1700 : (i + 1) * 1700] for i in range(3)]
    assert all(np.array_equal(np.sort(e), np.arange(1700)) for e in epochs)
    assert not np.array_equal(epochs[0], epochs[1])
    plain = _rows(list(_stream(files, bs=128, epochs=2)))  # batches run across the epoch boundary
    assert np.array_equal(plain, np.concatenate([np.arange(1700)] * 2))
    endless = iter(_stream(files, bs=500, epochs=None))
    assert sum(len(next(endless)["label"]) for _ in range(20)) == 10_000
    assert len(list(_stream(files, bs=500, epochs=None, max_batches=4))) == 4
    assert len(list(_stream(files, bs=128, drop_last=True))) == 13


def test_held_out_every_nth_and_by_key(files: list[Path]) -> None:
    rule = HoldOut.every_nth(5)
    train = _rows(list(_stream(files, shuffle_rows=200, holdout=rule)))
    held = _rows(list(_stream(files, holdout=rule, held_out=True)))
    assert np.array_equal(held, np.arange(4, 1700, 5))
    assert np.array_equal(np.sort(np.concatenate([train, held])), np.arange(1700))
    by_user = HoldOut.by_key("user", 0.2)
    train = _rows(list(_stream(files, holdout=by_user)))
    held = _rows(list(_stream(files, holdout=by_user, held_out=True)))
    assert np.array_equal(np.sort(np.concatenate([train, held])), np.arange(1700))
    users_train, users_held = {r % 97 for r in train.tolist()}, {r % 97 for r in held.tolist()}
    assert not users_train & users_held  # every row of a user on one side
    assert 5 <= len(users_held) <= 35  # about 20% of 97 users
    with pytest.raises(ValueError, match="exactly one of every= and column="):
        HoldOut()
    with pytest.raises(DataError, match="column 'x' is double, but a key column must be integer or string"):
        _stream(files, holdout=HoldOut.by_key("x"))


# -- resume -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("cut", [1, 7, 26, 33, 40])
def test_resume_continues_exactly_where_it_was(files: list[Path], cut: int) -> None:
    """Read ``cut`` batches, save the position (through JSON), open a new stream there: the two
    reads together are one uninterrupted read, shuffle, held-out rule, bags and epochs on."""
    settings: dict[str, Any] = dict(bs=100, epochs=3, shuffle_rows=250, seed=11, holdout=HoldOut.by_key("user", 0.1))
    whole = list(_stream(files, **settings))
    assert 40 < len(whole) < 50
    first = _stream(files, **settings)
    it = iter(first)
    head = [next(it) for _ in range(cut)]
    position = json.loads(json.dumps(first.state_dict()))
    assert {"epoch", "file", "row_group", "row", "skip", "seed"} <= set(position)
    tail = list(_stream(files, resume=position, **settings))
    assert _same(head + tail, whole)


def test_position_after_the_batches_a_consumer_took(files: list[Path]) -> None:
    """A consumer that reads ahead (Trainer.fit) asks for the position after the batches it trained on."""
    settings: dict[str, Any] = dict(bs=64, shuffle_rows=300, seed=3)
    whole = list(_stream(files, **settings))
    stream = _stream(files, **settings)
    it = iter(stream)
    for _ in range(12):  # read ahead of the 9 trained on
        next(it)
    position = stream.state_dict(batches=9)
    assert _same(list(_stream(files, resume=position, **settings)), whole[9:])
    with pytest.raises(ValueError, match=r"keeps the positions after batches 0..12"):
        stream.state_dict(batches=13)
    assert stream.state_dict(batches=0)["epoch"] == 0
    # Past the end: a resumed stream has nothing left.
    ended = _stream(files, **settings)
    assert len(list(ended)) == len(whole)
    assert list(_stream(files, resume=ended.state_dict(), **settings)) == []


def test_resume_refuses_a_position_from_another_setup(files: list[Path]) -> None:
    stream = _stream(files, rank=0, world_size=2, shuffle_rows=100)
    next(iter(stream))
    position = stream.state_dict()
    with pytest.raises(DataError, match="world_size 2, this stream has 3"):
        _stream(files, rank=0, world_size=3, shuffle_rows=100, resume=position)
    with pytest.raises(DataError, match="seed 0, this stream has 4"):
        _stream(files, rank=0, world_size=2, shuffle_rows=100, seed=4, resume=position)
    with pytest.raises(DataError, match="not a ParquetStream position"):
        _stream(files, resume={"epoch": 1})


# -- bad files through the CLI: one line, exit 2 -----------------------------------------------------


def _tether(args: list[str], cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tether.deploy.cli", *args], capture_output=True, text=True, timeout=timeout, cwd=cwd)


def _one_line(proc: subprocess.CompletedProcess, prog: str, *names: str) -> str:
    assert proc.returncode == 2, (proc.returncode, proc.stdout[-2000:], proc.stderr[-3000:])
    assert "Traceback" not in proc.stderr + proc.stdout, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"{prog}: error: "), proc.stderr[-3000:]
    for name in names:
        assert name in lines[0], (name, lines[0])
    return lines[0]


@pytest.fixture
def criteo_parquet(tmp_path: Path) -> Path:
    tsv, out = tmp_path / "day.tsv", tmp_path / "day.parquet"
    write_criteo_sample(tsv, 6000, seed=3)
    assert _tether(["convert", f"criteo:{tsv}", str(out), "--row-group-rows", "1000"], tmp_path).returncode == 0
    return out


def test_bad_files_stop_the_cli_with_one_line(criteo_parquet: Path, tmp_path: Path) -> None:
    table = pq.read_table(criteo_parquet)
    pq.write_table(table.drop_columns(["C7"]), tmp_path / "no-c7.parquet", row_group_size=1000)
    pq.write_table(table.set_column(table.schema.get_field_index("label"), "label", pa.array(["x"] * len(table))),
                   tmp_path / "text-label.parquet", row_group_size=1000)
    data = criteo_parquet.read_bytes()
    (tmp_path / "cut.parquet").write_bytes(data[: len(data) // 2])
    small = ["--steps", "2", "--batch-size", "32", "--eval-samples", "100", "--device", "cpu"]
    # A file lacking a column the others have: named with the column, before any process starts.
    proc = _tether(["launch", "--num-shards", "1", "--num-workers", "1", "--data", f"parquet:{criteo_parquet},{tmp_path / 'no-c7.parquet'}",
                    *small, "--out", str(tmp_path / "out")], tmp_path)
    _one_line(proc, "tether launch", "no-c7.parquet", "'C7'")
    assert not (tmp_path / "out").exists()
    proc = _tether(["launch", "--data", f"parquet:{tmp_path / 'text-label.parquet'}", *small, "--out", str(tmp_path / "out")], tmp_path)
    _one_line(proc, "tether launch", "text-label.parquet", "'label'", "string")
    assert not (tmp_path / "out").exists()
    proc = _tether(["worker", "--shards", "127.0.0.1:1", "--data", f"parquet:{tmp_path / 'cut.parquet'}", *small], tmp_path)
    _one_line(proc, "tether worker", "cut.parquet", "truncated")
    proc = _tether(["launch", "--num-workers", "7", "--data", f"parquet:{criteo_parquet}", *small], tmp_path)
    _one_line(proc, "tether launch", "6 non-empty row group(s) for 7 workers")
    (tmp_path / "bad.tsv").write_text("1\t2\n")
    _one_line(_tether(["convert", "criteo:bad.tsv", "x.parquet"], tmp_path), "tether convert", "bad.tsv")
    assert not list(tmp_path.glob("*x.parquet*"))  # a failed conversion leaves nothing behind


def test_launch_trains_the_builtin_job_from_parquet(criteo_parquet: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    proc = _tether(["launch", "--num-shards", "1", "--num-workers", "2", "--data", f"parquet:{criteo_parquet}", "--steps", "20",
                    "--batch-size", "64", "--eval-samples", "500", "--device", "cpu", "--out", str(out)], tmp_path, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["total_samples"] == 2 * 20 * 64
    assert 0 < summary["eval_loss"] < 1.5 and "baseline_loss" in summary


def test_launch_resumes_each_workers_stream_from_a_checkpoints_positions(criteo_parquet: Path, tmp_path: Path) -> None:
    """20 steps with a checkpoint every 10 leave each worker's position at step 10; a job resumed
    there for 10 steps ends where the first one ended (the same stream, read on, not re-read)."""
    common = ["launch", "--num-shards", "1", "--num-workers", "2", "--data", f"parquet:{criteo_parquet}", "--batch-size", "64",
              "--eval-samples", "500", "--device", "cpu", "--checkpoint-every", "600"]
    first = _tether([*common, "--steps", "20", "--checkpoint-every-steps", "10", "--out", str(tmp_path / "a")], tmp_path, timeout=240)
    assert first.returncode == 0, first.stderr[-3000:]
    saved = tmp_path / "a" / "positions" / "step-10"
    assert sorted(p.name for p in saved.iterdir()) == ["worker-0.json", "worker-1.json"]
    again = _tether([*common, "--steps", "10", "--resume-data", str(saved), "--out", str(tmp_path / "b")], tmp_path, timeout=240)
    assert again.returncode == 0, again.stderr[-3000:]
    for i in (0, 1):
        ended = json.loads((tmp_path / "a" / f"worker-{i}.json").read_text())["data_position"]
        resumed = json.loads((tmp_path / "b" / f"worker-{i}.json").read_text())["data_position"]
        assert resumed == ended
    wrong = _tether([*common, "--steps", "5", "--resume-data", str(tmp_path / "nowhere"), "--out", str(tmp_path / "c")], tmp_path)
    assert wrong.returncode == 2 and "--resume-data" in wrong.stderr and "no such directory" in wrong.stderr


# -- memory -----------------------------------------------------------------------------------------

_PROBE = textwrap.dedent("""
    import sys
    from tether.worker.data.parquet import ParquetStream
    n = 0
    for b in ParquetStream(sys.argv[1], 4096, ctr=True, shuffle_rows=65536, epochs=1):
        n += len(b.labels)
    hwm = [line for line in open("/proc/self/status") if line.startswith("VmHWM")][0].split()[1]
    print(n, int(hwm) // 1024)
""")


def test_memory_does_not_grow_with_the_data(tmp_path: Path) -> None:
    """Streaming 10x the rows (1.5M Criteo-shaped rows, ~380 MiB decoded) peaks within 100 MiB of
    150,000 rows, shuffle on: both runs are past their first shuffle buffers (65,536 rows), so the
    difference is what grows with the data."""
    rng = np.random.default_rng(0)
    group = 30_000
    schema = pa.schema([("label", pa.float32())] + [(f"I{j}", pa.float32()) for j in range(13)] + [(f"C{j}", pa.int64()) for j in range(26)])
    cols = [pa.array(rng.integers(0, 2, group).astype(np.float32))]
    cols += [pa.array(rng.random(group, dtype=np.float32)) for _ in range(13)]
    cols += [pa.array(rng.integers(0, 20_000, group) * 7919) for _ in range(26)]  # skewed enough to dictionary-encode: a small file
    block = pa.Table.from_arrays(cols, schema=schema)
    peaks = {}
    for n in (150_000, 1_500_000):
        path = tmp_path / f"rows-{n}.parquet"
        with pq.ParquetWriter(path, schema) as w:
            for _ in range(n // group):
                w.write_table(block, row_group_size=group)
        out = subprocess.run([sys.executable, "-c", _PROBE, str(path)], capture_output=True, text=True, check=True, timeout=120).stdout.split()
        path.unlink()
        assert int(out[0]) == n
        peaks[n] = int(out[1])
    assert peaks[1_500_000] - peaks[150_000] < 100, peaks


# -- the example ------------------------------------------------------------------------------------


def test_dlrm_example_trains_from_parquet_and_leaves_each_workers_position(tmp_path: Path) -> None:
    """examples/dlrm_criteo --parquet under tether launch: it learns, and the position each worker
    wrote (after the batches fit trained on, though fit reads ahead) is where its stream goes on."""
    script = Path(__file__).resolve().parents[1] / "examples" / "dlrm_criteo" / "train.py"
    pattern = str(tmp_path / "day_*.parquet")
    gen = subprocess.run([sys.executable, str(script), "--parquet", "--generate", "3", "--lines", "20000", "--data", pattern],
                         capture_output=True, text=True, timeout=120)
    assert gen.returncode == 0, gen.stderr
    steps, out, positions = 100, tmp_path / "run", tmp_path / "positions"
    proc = _tether(["launch", "--script", str(script), "--script-args", f"--parquet --data '{pattern}' --position {positions} --eval-samples 2000",
                    "--num-workers", "2", "--steps", str(steps), "--log-every", "100", "--out", str(out)], tmp_path, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["eval_loss"] < summary["eval_baseline_loss"], summary
    for rank in (0, 1):
        position = json.loads((positions / f"worker-{rank}.json").read_text())
        settings: dict[str, Any] = dict(ctr=True, rank=rank, world_size=2, epochs=None, shuffle_rows=65_536, holdout=HoldOut.every_nth(10))
        whole = iter(ParquetStream(pattern, 256, **settings))
        for _ in range(steps):
            next(whole)
        resumed = next(iter(ParquetStream(pattern, 256, resume=position, **settings)))
        assert all(torch.equal(a, b) for a, b in zip(next(whole), resumed, strict=False))


def test_the_trainer_records_the_streams_position_and_writes_it_beside_checkpoints(files: list[Path], tmp_path: Path) -> None:
    """Trainer.fit puts the stream's position after its last trained batch in the record, and every
    checkpoint_every_steps writes it to out/positions/step-<clock>/worker-<i>.json: resuming there
    reads on from the batch after."""
    from torch import nn

    from tether.worker.config import TrainingConfig
    from tether.worker.training.embedding_bag import ShardedEmbeddingBag
    from tether.worker.training.trainer import Trainer

    settings: dict[str, Any] = dict(bs=64, shuffle_rows=300, seed=3)
    whole = list(_stream(files, **settings))

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.rows = ShardedEmbeddingBag("rows", 4)
            self.hist = ShardedEmbeddingBag("hist", 4)
            self.out = nn.Linear(10, 1)

        def forward(self, b: dict[str, torch.Tensor]) -> torch.Tensor:
            return self.out(torch.cat([self.rows(b["row"]), self.hist(b["hist"], b["hist_offsets"]), b["dense"]], 1)).squeeze(1)

    torch.manual_seed(0)
    config = TrainingConfig(shards=(), local=True, steps=7, checkpoint_every_steps=3, out=str(tmp_path / "out"), device="cpu")
    with Trainer(Model(), config, loss=lambda m, b: nn.functional.binary_cross_entropy_with_logits(m(b), b["label"]),
                 sparse=lambda b: {"rows": b["row"], "hist": b["hist"]}, printer=lambda line: None) as trainer:
        record = trainer.fit(_stream(files, **settings))
    assert _same(list(_stream(files, resume=record["data_position"], **settings)), whole[7:])
    saved = json.loads((tmp_path / "out" / "positions" / "step-3" / "worker-0.json").read_text())
    assert saved["step"] == 3
    assert _same(list(_stream(files, resume=saved["position"], **settings)), whole[3:])


def test_a_trainer_given_resume_data_reads_on_where_the_saved_position_says(files: list[Path], tmp_path: Path) -> None:
    """``TrainingConfig.resume_data`` (what ``tether launch`` sets on a restarted script worker,
    ``TETHER_RESUME_DATA``): ``Trainer.fit`` loads ``DIR/worker-<i>.json``, as the run before
    wrote it to ``OUT/positions/latest``, into the stream, so 3 steps and then 4 more train the
    batches 7 steps of one stream do; data that cannot take a position, or a folder without this
    worker's, is one line."""
    from torch import nn

    from tether.protos.errors import UsageError
    from tether.worker.config import TrainingConfig
    from tether.worker.training.embedding_bag import ShardedEmbeddingBag
    from tether.worker.training.trainer import Trainer

    settings: dict[str, Any] = dict(bs=64, shuffle_rows=300, seed=3)
    whole = list(_stream(files, **settings))

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.rows = ShardedEmbeddingBag("rows", 4)
            self.out = nn.Linear(6, 1)

        def forward(self, b: dict[str, torch.Tensor]) -> torch.Tensor:
            return self.out(torch.cat([self.rows(b["row"]), b["dense"]], 1)).squeeze(1)

    trained: list[dict[str, torch.Tensor]] = []

    def loss(m: nn.Module, b: dict[str, torch.Tensor]) -> torch.Tensor:
        trained.append(b)
        return nn.functional.binary_cross_entropy_with_logits(m(b), b["label"])

    def fit(data: Any, **kw: Any) -> Any:
        torch.manual_seed(0)
        config = TrainingConfig(shards=(), local=True, out=str(tmp_path / "out"), device="cpu", **kw)
        with Trainer(Model(), config, loss=loss, sparse=lambda b: {"rows": b["row"]}, printer=lines.append) as trainer:
            return trainer.fit(data)

    lines: list[str] = []
    fit(_stream(files, **settings), steps=3)
    latest = tmp_path / "out" / "positions" / "latest"
    record = fit(_stream(files, **settings), steps=4, resume_data=str(latest))
    assert _same(trained, whole[:7])
    assert _same(list(_stream(files, resume=record.data_position, **settings)), whole[7:])
    assert any(f"data resumed from {latest / 'worker-0.json'}, after the 3 steps" in line for line in lines)
    with pytest.raises(UsageError, match=r"the training data \(list\) has no load_state_dict"):
        fit(whole, steps=1, resume_data=str(latest))
    with pytest.raises(UsageError, match=r"cannot read worker 0's position .*worker-0.json"):
        fit(_stream(files, **settings), steps=1, resume_data=str(tmp_path))


# -- pandas' Parquet as it comes (issue 40 item 2) ------------------------------------------------


def _reserved(column: str) -> int:
    return int(hash_strings(pa.array([column]))[0] & np.uint64((1 << 62) - 1))


def test_pandas_nullable_narrow_ids_and_bags_with_nulls_read_the_reserved_id(tmp_path: Path) -> None:
    """pandas' nullable Int32/Int16/UInt32 columns and a list<int32> bag, each with a null: the
    reserved id (a 62-bit value) does not fit the narrow type, so the column is widened first."""
    pd = pytest.importorskip("pandas")
    df = pd.DataFrame({
        "label": [1.0, 0.0, 1.0, 0.0],
        "a": pd.array([5, None, -7, 2**31 - 1], dtype="Int32"),
        "b": pd.array([None, 3, 4, 5], dtype="Int16"),
        "c": pd.array([2**32 - 1, 1, None, 0], dtype="UInt32"),
        "bag": [[1, 2], [None, 3], [], None],
    })
    path = tmp_path / "narrow.parquet"
    df.to_parquet(path, schema=pa.schema([("label", pa.float64()), ("a", pa.int32()), ("b", pa.int16()), ("c", pa.uint32()),
                                          ("bag", pa.list_(pa.int32()))]))
    (batch,) = list(ParquetStream(path, 4, ids=["a", "b", "c"], bags=["bag"]))
    assert batch["a"].tolist() == [5, _reserved("a"), -7, 2**31 - 1]
    assert batch["b"].tolist() == [_reserved("b"), 3, 4, 5]
    assert batch["c"].tolist() == [2**32 - 1, 1, _reserved("c"), 0]
    # A null inside a bag is the bag column's reserved id, one of the bag's ids; a null bag is empty.
    assert batch["bag"].tolist() == [1, 2, _reserved("bag"), 3] and batch["bag_offsets"].tolist() == [0, 2, 4, 4]
    # The CTR layout reads them the same.
    ctr = next(iter(ParquetStream(path, 4, ids=["a", "b"], dense=["c"], ctr=True)))
    assert ctr.sparse[:, 0].tolist() == batch["a"].tolist()


def test_pandas_nan_in_dense_columns_is_counted_said_once_and_filled_as_asked(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    pd = pytest.importorskip("pandas")
    df = pd.DataFrame({"label": [1.0, 0.0, 1.0, 0.0, 1.0, 0.0], "price": [1.0, np.nan, 3.0, np.nan, 8.0, 0.0],
                       "clicks": [1.0, 2.0, 3.0, 4.0, 5.0, np.nan], "full": [1.0] * 6})
    path = tmp_path / "nan.parquet"
    df.to_parquet(path, row_group_size=3)  # pandas writes NaN as a Parquet null
    dense = ["price", "clicks", "full"]
    with caplog.at_level("WARNING"):
        stream = ParquetStream(path, 6, dense=dense, epochs=2)
        batches = list(stream)
    assert [b["dense"][:, 0].tolist() for b in batches] == [[1.0, 0.0, 3.0, 0.0, 8.0, 0.0]] * 2
    warned = [r.getMessage() for r in caplog.records if "dense column" in r.getMessage()]
    assert len(warned) == 1, warned  # once, with each column's count, not once per row group or epoch
    assert "'price' 2 of 6 rows" in warned[0] and "'clicks' 1 of 6 rows" in warned[0] and "'full'" not in warned[0]
    assert "dense_nulls" in warned[0] and "'mean'" in warned[0]
    # The column's mean over the files (nulls left out).
    mean = ParquetStream(path, 6, dense=dense, dense_nulls="mean")
    assert mean.dense_fill == {"price": 3.0, "clicks": 3.0, "full": 1.0}
    got = next(iter(mean))["dense"]
    assert got[:, 0].tolist() == [1.0, 3.0, 3.0, 3.0, 8.0, 0.0] and got[5, 1] == 3.0
    # Values given; a held-out stream takes the training stream's (columns not named: 0).
    given = next(iter(ParquetStream(path, 6, dense=dense, dense_nulls={"price": -1.0})))["dense"]
    assert given[:, 0].tolist() == [1.0, -1.0, 3.0, -1.0, 8.0, 0.0] and given[5, 1] == 0.0
    assert next(iter(ParquetStream(path, 6, dense=dense, dense_nulls=mean.dense_fill)))["dense"].equal(got)
    # Refused up front, in one line naming the columns and counts.
    with pytest.raises(DataError, match=r"nan.parquet: null\(s\) in dense column\(s\) 'price' 2 of 6 rows, 'clicks' 1 of 6 rows") as err:
        ParquetStream(path, 6, dense=dense, dense_nulls="error")
    assert "\n" not in str(err.value)
    assert len(list(ParquetStream(path, 6, dense=["full"], dense_nulls="error"))) == 1
    for bad, match in [("median", "dense_nulls must be one of 'zero', 'mean', 'error'"), ({"nope": 1.0}, "not dense columns"),
                       ({"price": float("nan")}, "must be a finite number")]:
        with pytest.raises(ValueError, match=match):
            ParquetStream(path, 6, dense=dense, dense_nulls=bad)


def test_nan_values_that_are_not_nulls_are_filled_and_said_once_too(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """pyarrow keeps a NaN as a value (statistics do not count it): read, filled and said once."""
    path = tmp_path / "nan_values.parquet"
    pq.write_table(pa.table({"label": [1.0, 0.0, 1.0, 0.0], "x": pa.array([1.0, float("nan"), 3.0, float("nan")])}), path, row_group_size=2)
    with caplog.at_level("WARNING"):
        b = list(ParquetStream(path, 4, dense=["x"], dense_nulls="mean"))
    assert b[0]["dense"][:, 0].tolist() == [1.0, 2.0, 3.0, 2.0]
    assert len([r for r in caplog.records if "'x'" in r.getMessage()]) == 1
    with pytest.raises(DataError, match=r"nan_values.parquet: dense column 'x' has 1 null or NaN value\(s\) in row group 0"):
        list(ParquetStream(path, 4, dense=["x"], dense_nulls="error"))


def test_one_row_group_from_pandas_names_how_to_write_more(tmp_path: Path) -> None:
    pd = pytest.importorskip("pandas")
    df = pd.DataFrame({"label": [1.0, 0.0] * 50, "u": np.arange(100)})
    one = tmp_path / "one.parquet"
    df.to_parquet(one)  # pandas' default: one row group
    with pytest.raises(DataError) as err:
        ParquetStream(one, 10, ids=["u"], rank=1, world_size=2)
    msg = str(err.value)
    assert "df.to_parquet(path, row_group_size=N)" in msg and "pyarrow.parquet.write_table(table, path, row_group_size=N)" in msg
    assert "tether convert --row-group-rows" in msg and "\n" not in msg
    several = tmp_path / "several.parquet"
    df.to_parquet(several, row_group_size=25)  # what the message says
    ranks = [np.concatenate([b["u"].numpy() for b in ParquetStream(several, 10, ids=["u"], rank=r, world_size=2)]) for r in (0, 1)]
    assert sorted(np.concatenate(ranks).tolist()) == list(range(100))


def test_a_column_of_the_wrong_type_is_named_with_its_role_in_plain_words(files: list[Path]) -> None:
    with pytest.raises(DataError, match=r"column 'x' is double, but an id column must be integer or string"):
        ParquetStream(files, 8, ids=["x"])
    with pytest.raises(DataError, match=r"column 'user' is string, but a dense column must be"):
        ParquetStream(files, 8, dense=["user"])
