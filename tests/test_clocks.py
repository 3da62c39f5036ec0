import threading
import time

import pytest

from tether.server.storage.clocks import WorkerClocks


class FakeTime:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_min_max_and_monotonic_clocks() -> None:
    clocks = WorkerClocks(lease_s=10)
    clocks.update("a", 3)
    clocks.update("b", 7)
    clocks.update("a", 2)  # late message: clocks never go back
    s = clocks.state()
    assert (s.min_clock, s.max_clock, s.live_workers) == (3, 7, 2)
    assert clocks.lag(8) == 4


def test_expired_lease_drops_worker_and_return_re_registers() -> None:
    now = FakeTime()
    clocks = WorkerClocks(lease_s=5, now=now)
    clocks.update("slow", 1)
    clocks.update("fast", 9)
    now.t = 3
    clocks.update("fast", 10)
    now.t = 6  # slow's lease (last seen at 0) has expired
    assert clocks.state().min_clock == 10 and clocks.state().live_workers == 1
    clocks.update("slow", 2)
    assert clocks.state().min_clock == 2


def test_leave_removes_worker() -> None:
    clocks = WorkerClocks()
    clocks.update("a", 1)
    clocks.update("b", 5)
    clocks.update("a", 1, leave=True)
    assert clocks.state().min_clock == 5


def test_wait_blocks_until_bound_holds() -> None:
    clocks = WorkerClocks(lease_s=30)
    clocks.update("slow", 0)
    clocks.update("fast", 5)
    ok, _ = clocks.wait(5, bound=2, timeout_s=0.2)
    assert not ok
    threading.Timer(0.2, lambda: clocks.update("slow", 3)).start()
    start = time.monotonic()
    ok, state = clocks.wait(5, bound=2, timeout_s=10)
    assert ok and state.min_clock == 3 and time.monotonic() - start < 5


def test_wait_ends_when_the_straggler_lease_expires() -> None:
    clocks = WorkerClocks(lease_s=0.4)
    clocks.update("dead", 0)
    clocks.update("alive", 4)

    def keep_alive() -> None:
        for _ in range(10):
            clocks.update("alive", 4)
            time.sleep(0.1)

    threading.Thread(target=keep_alive, daemon=True).start()
    ok, state = clocks.wait(4, bound=1, timeout_s=5)
    assert ok and state.live_workers == 1


def test_bad_lease() -> None:
    with pytest.raises(ValueError, match="lease_s must be > 0, got 0"):
        WorkerClocks(lease_s=0)


def test_pushes_do_not_move_clocks_of_workers_that_report_them() -> None:
    clocks = WorkerClocks()
    clocks.update("ssp", 3)  # a Clock call: this worker reports its clock itself
    clocks.update("ssp", 9, from_push=True)
    clocks.update("async", 5, from_push=True)  # async workers' clocks come with their pushes
    state = clocks.state()
    assert (state.min_clock, state.max_clock) == (3, 5)


def test_workers_that_trained_and_left_while_one_waited_at_start_count_for_it() -> None:
    """The start-up barrier's race (seen with 4 fast workers on 2 busy cores): two workers see the
    job whole, train and leave between two polls of the others, who must not wait forever."""
    now = FakeTime()
    clocks = WorkerClocks(lease_s=10, now=now)
    for i, w in enumerate("abcd"):
        now.t = float(i)
        clocks.update(w, 0, join=True)
    assert clocks.state().live_workers == 4
    now.t = 5
    for w in "bc":
        clocks.update(w, 12, from_push=True)
        clocks.update(w, 12, leave=True)
    assert clocks.state().live_workers == 2
    assert clocks.finished_since("a") == 2 and clocks.finished_since("d") == 2
    clocks.update("a", 0, join=True)  # a's next poll: joining again does not move when it joined
    assert clocks.finished_since("a") == 2
    # A worker of a later job on the same shards does not count those that left before it joined.
    for w in "ad":
        clocks.update(w, 12, leave=True)
    now.t = 9
    clocks.update("e", 0, join=True)
    assert clocks.finished_since("e") == 0 and clocks.finished_since("gone") == 0


def test_the_start_barrier_counts_finished_workers(monkeypatch: pytest.MonkeyPatch) -> None:
    from types import SimpleNamespace

    from tether.worker.client.results import ClockReply
    from tether.worker.training.policies import AsyncPolicy

    replies = iter([ClockReply(0, 0, 3, True), ClockReply(0, 0, 2, True, 0, 2)])
    trainer = SimpleNamespace(config=SimpleNamespace(num_workers=4, wait_timeout_s=5.0),
                              client=SimpleNamespace(clock=lambda clock: next(replies)))
    monkeypatch.delenv("TETHER_RESTART_COUNT", raising=False)
    assert AsyncPolicy().start(trainer) == 0  # type: ignore[arg-type]


def _policy_start(replies: list, monkeypatch: pytest.MonkeyPatch) -> tuple[int, int]:
    """``AsyncPolicy.start`` on a fake client answering ``replies`` in turn, outside ``tether
    launch`` (no TETHER_RESTART_COUNT, as in a pod Kubernetes restarted): (the clock it starts
    from, the Clock calls it made)."""
    from types import SimpleNamespace

    from tether.worker.training.policies import AsyncPolicy

    calls = iter(replies)
    made = []
    trainer = SimpleNamespace(config=SimpleNamespace(num_workers=3, wait_timeout_s=5.0),
                              client=SimpleNamespace(clock=lambda clock: made.append(clock) or next(calls)))
    monkeypatch.delenv("TETHER_RESTART_COUNT", raising=False)
    return AsyncPolicy().start(trainer), len(made)  # type: ignore[arg-type]


def test_a_worker_joining_a_job_under_way_goes_on_from_the_slowest_others_clock(monkeypatch: pytest.MonkeyPatch) -> None:
    """A pod Kubernetes restarted: one other trains (clock 57), the third finished and left
    before it joined, so 2 of 3 are live and the barrier alone would hold it until
    wait_timeout_s; the clock above 0 says the job is under way."""
    from tether.worker.client.results import ClockReply

    assert _policy_start([ClockReply(0, 57, 2, True, 57, 0)], monkeypatch) == (57, 1)


def test_a_late_worker_of_a_fresh_job_still_waits_for_every_worker(monkeypatch: pytest.MonkeyPatch) -> None:
    """The others joined first and wait at clock 0: max_clock 0 says the job has not started,
    so this worker waits with them until the last one joins."""
    from tether.worker.client.results import ClockReply

    replies = [ClockReply(0, 0, 2, True), ClockReply(0, 0, 2, True), ClockReply(0, 0, 3, True)]
    assert _policy_start(replies, monkeypatch) == (0, 3)


def test_the_handler_sets_the_clock_gauges_for_the_clock_call_of_the_service() -> None:
    """``RequestHandler.update_clock_gauges``: a push with a clock and the Clock call set them."""
    from tether.server.metrics import NullShardMetrics
    from tether.server.serving.handler import RequestHandler
    from tether.server.storage.shard import Shard

    class Gauges(NullShardMetrics):
        def clocks(self, live_workers: int, min_clock: int, max_clock: int) -> None:
            self.set = (live_workers, min_clock, max_clock)

    metrics = Gauges()
    handler = RequestHandler(Shard(), metrics)
    handler.shard.clocks.update("a", 3)
    handler.shard.clocks.update("b", 7)
    handler.update_clock_gauges()
    assert metrics.set == (2, 3, 7)


def test_clock_goes_through_the_handler_like_every_other_call() -> None:
    """The handler answers Clock (the gRPC servicer only hands it on): its errors and metrics too."""
    import grpc

    from tether.protos import tether_pb2 as pb
    from tether.server.metrics import NullShardMetrics
    from tether.server.serving.handler import RequestHandler
    from tether.server.storage.shard import Shard

    class Seen(NullShardMetrics):
        def __init__(self) -> None:
            self.requests: list[tuple[str, str]] = []
            self.bound: int | None = None

        def request(self, rpc: str, code: str, seconds: float, nbytes: int) -> None:
            self.requests.append((rpc, code))

        def set_staleness_bound(self, bound: int | None) -> None:
            self.bound = bound

    metrics = Seen()
    handler = RequestHandler(Shard(), metrics)
    response, code, _ = handler.call("Clock", pb.ClockRequest(worker_id="a", clock=0, wait_bound=-1))
    assert code == grpc.StatusCode.OK and (response.live_workers, response.ready) == (1, True)
    response, code, _ = handler.call("Clock", pb.ClockRequest(worker_id="a", clock=2, wait_bound=1, wait_timeout_ms=100))
    assert code == grpc.StatusCode.OK and response.ready and (response.min_clock, response.max_clock) == (2, 2) and metrics.bound == 1
    response, code, message = handler.call("Clock", pb.ClockRequest(clock=1))
    assert (response, code, message) == (None, grpc.StatusCode.INVALID_ARGUMENT, "worker_id must be set on a Clock call")
    assert metrics.requests == [("Clock", "OK"), ("Clock", "OK"), ("Clock", "INVALID_ARGUMENT")]
