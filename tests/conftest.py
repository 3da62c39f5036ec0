"""Shared fixtures: real shard processes on 127.0.0.1 and in-process shards."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tether.deploy.launch import LocalCluster
from tether.server.config import ShardConfig
from tether.server.serving.serve import RunningShard, start_shard
from tether.worker.client.config import ClientConfig
from tether.worker.client.ps_client import PSClient


@pytest.fixture
def cluster(tmp_path) -> Iterator[LocalCluster]:
    """A local cluster whose processes are stopped at the end of the test."""
    c = LocalCluster(log_dir=tmp_path / "logs", grace_s=5.0)
    try:
        yield c
    finally:
        c.stop()


@pytest.fixture
def two_shards(cluster: LocalCluster) -> list[str]:
    """Two shard processes; their addresses."""
    return cluster.start_shards(2, timeout_s=60)


@pytest.fixture
def inproc_shard() -> Iterator[RunningShard]:
    """One shard served in this process (real gRPC on loopback)."""
    running = start_shard(ShardConfig(host="127.0.0.1", port=0, max_message_bytes=4 * 1024 * 1024))
    try:
        yield running
    finally:
        running.stop(0)


# Tests of about 18 s or more in CI, slowest first (CI's runs of 2026-12-06 under -n 2, and a run at
# c155c15 that reached half the suite for the tests those runs' --durations=15 did not show). They
# run first: pytest-xdist hands out the rest as workers free up, so the run ends on short tests, not
# with one worker still in a long one (tests/test_worker_restarts.py, alphabetically last, was) and
# the other idle. A test missing here only runs in its file's place; refresh the list from a full
# run's --durations=40 when the slow tests change.
SLOW_FIRST = (
    "tests/test_docs_commands.py::test_the_page_commands_run[docs/choosing-a-consistency-mode.md]",
    "tests/test_chaos.py::test_a_job_under_chaos_recovers_loses_nothing_it_should_not_and_leaks_nothing",
    "tests/test_docs_commands.py::test_the_page_commands_run[docs/data.md]",
    "tests/test_worker_restarts.py::test_a_worker_killed_after_another_finished_is_restarted_and_the_job_succeeds",
    "tests/test_docs_commands.py::test_the_page_commands_run[docs/your-model.md]",
    "tests/test_docs_commands.py::test_the_page_commands_run[docs/security-and-faults.md]",
    "tests/test_examples.py::test_dlrm_on_gzipped_criteo_files_beats_the_constant_click_rate",
    "tests/test_docs_commands.py::test_the_page_commands_run[docs/modes.md]",
    "tests/test_parquet.py::test_dlrm_example_trains_from_parquet_and_leaves_each_workers_position",
    "tests/test_examples.py::test_two_tower_beats_the_mean_rating_in_every_mode[ssp:2]",
    "tests/test_incarnations.py::test_pushes_of_a_new_incarnation_survive_a_shard_kill_and_restore",
    "tests/test_compare.py::test_a_scripts_repeats_vary_its_data_order_alone",
    "tests/test_worker_restarts.py::test_an_async_worker_killed_mid_job_is_restarted_and_the_job_succeeds",
    "tests/test_compare.py::test_compare_runs_a_users_script_in_every_mode_and_compares_its_records",
    "tests/test_sync_user_script.py::test_sync_ranks_train_disjoint_slices_and_same_seed_runs_end_equal",
    "tests/test_docs_commands.py::test_the_page_commands_run[docs/export.md]",
    "tests/test_modes.py::test_sync_ranks_hold_identical_dense_parameters",
    "tests/test_modes.py::test_sweep_recommends_a_bound",
    "tests/test_integration.py::test_launch_restarts_a_killed_shard_from_its_checkpoint",
    "tests/test_docs_commands.py::test_the_page_commands_run[docs/running.md]",
    "tests/test_modes.py::test_compare_writes_its_files",
    "tests/test_compare.py::test_sweep_of_a_script_without_eval_loss_says_so_in_one_line",
    "tests/test_prometheus_scrape.py::test_shipped_local_config_scrapes_the_documented_cluster",
    "tests/test_examples.py::test_two_tower_beats_the_mean_rating_in_every_mode[async]",
    "tests/test_checkpoint.py::test_a_writer_killed_before_its_manifest_leaves_the_previous_checkpoint",
    "tests/test_examples.py::test_two_tower_beats_the_mean_rating_in_every_mode[sync]",
    "tests/test_cli_errors.py::test_launch_malformed_criteo_line_stops_with_the_workers_line",
    "tests/test_integration.py::test_criteo_file_end_to_end",
    "tests/test_modes.py::test_killed_worker_does_not_deadlock_ssp",
    "tests/test_modes.py::test_async_straggler_goes_past_the_bound",
    "tests/test_examples.py::test_session_bags_beat_the_constant_click_rate",
    "tests/test_modes.py::test_ssp_bound_holds_with_a_straggler[0]",
    "tests/test_modes.py::test_ssp_bound_holds_with_a_straggler[2]",
    "tests/test_any_ids.py::test_ids_at_the_edges_of_int64_pull_push_and_pull_again_on_shard_processes",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """``SLOW_FIRST`` first, in its order; the others after them in their own order."""
    rank = {nodeid: i for i, nodeid in enumerate(SLOW_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid, len(rank)))


def make_client(addresses: list[str], worker_id: str = "test", **kw: object) -> PSClient:
    """A client with short deadlines for tests."""
    kw.setdefault("timeout_s", 10.0)
    kw.setdefault("retries", 2)
    return PSClient(ClientConfig(addresses=tuple(addresses), worker_id=worker_id, **kw))
