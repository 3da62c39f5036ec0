"""Each consistency policy owns its waits: ssp:S's wait before a step asks the coordinator's clock
with its bound and gives up after wait_timeout_s; async never waits."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest

from tether.protos.errors import DeadlineExceeded
from tether.worker.client.results import ClockReply
from tether.worker.config import TrainingConfig
from tether.worker.training.policies import AsyncPolicy, SSPPolicy


@dataclass
class _Clocks:
    """A client's ``clock``, answering ``ready`` and logging what it was asked."""

    ready: bool
    asked: list[dict[str, Any]] = field(default_factory=list)

    def clock(self, clock: int, **kw: Any) -> ClockReply:
        self.asked.append({"clock": clock, **kw})
        return ClockReply(min_clock=3, max_clock=9, live_workers=2, ready=self.ready)


@dataclass
class _View:
    client: _Clocks
    config: TrainingConfig = field(default_factory=lambda: TrainingConfig(local=True, mode="ssp:2", wait_timeout_s=7.0))
    name: str = "worker 1/2"


def test_ssp_waits_with_its_bound_and_the_configs_timeout() -> None:
    view = _View(_Clocks(ready=True))
    SSPPolicy(2).before_step(view, 8)  # type: ignore[arg-type]
    assert view.client.asked == [{"clock": 8, "wait_bound": 2, "timeout_s": 7.0}]


def test_ssp_gives_up_with_a_deadline_error_naming_the_slowest_clock() -> None:
    view = _View(_Clocks(ready=False))
    with pytest.raises(DeadlineExceeded, match=r"worker 1/2 waited 7s at clock 8 for the slowest live worker \(clock 3, bound 2\)"):
        SSPPolicy(2).before_step(view, 8)  # type: ignore[arg-type]


def test_async_never_asks_the_clock_before_a_step() -> None:
    view = _View(_Clocks(ready=False))
    AsyncPolicy().before_step(view, 8)  # type: ignore[arg-type]
    assert view.client.asked == []
