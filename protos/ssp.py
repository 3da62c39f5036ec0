"""The ssp clock protocol's two fixed facts, shared by workers and shards (``Clock`` in
tether.proto): which shard coordinates the workers' clocks, and how long it holds a Clock call."""

from __future__ import annotations

__all__ = ["COORDINATOR_SHARD", "MAX_CLOCK_HOLD_S"]

# The shard the workers wait on in ssp and sync (every shard is told each clock, as a lease;
# only this one is asked to wait), and so the one that measures a push's clock staleness.
COORDINATOR_SHARD = 0

# Longest the coordinator holds a Clock call before answering ready=false (it caps what a client
# asks for); clients ask for no longer and call again, so a coordinator that stopped answering is
# noticed within about this, not after the whole ssp wait.
MAX_CLOCK_HOLD_S = 5.0
