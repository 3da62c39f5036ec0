"""Shared regions registered with CUDA as pinned memory, so that a GPU worker's copy to the device
reads pulled rows from the region itself (issue 41 item 4), and the fence that keeps a region
from being written again before that copy has read it.

A data connection's region (``tether.protos.framing.SharedRegion``) holds one call at a time: the
connection's next request, and the shard's answer to it, overwrite the last answer. A CUDA
worker's pull (``tether.worker.client.device_pull``) registers the region's pages once
(``cudaHostRegister``, portable: pinned for every CUDA context), queues the copy of the answer's
rows to the device on the transfer stream straight from the region, and records an event after
it: the region's *fence*. Before the connection writes the region again (its next call through
the region) or unmaps it, it waits for that fence (``settle``, ``release``). The copy was queued
as soon as the answer arrived, so the wait is nearly always over before it starts.

Registration is tried once per region and given up for the process at the first refusal (no CUDA,
a platform that will not pin shared memory): rows then go through pinned memory with one copy,
as before, and the log says so once. CUDA's "last error" of a refused call is per host thread:
the calls run on a short-lived thread of their own, so a refusal never surfaces later as the
error of an unrelated kernel launch.

A process that never pulls onto a GPU registers nothing, and every function here returns at once.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import threading
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

__all__ = ["Pinned", "fence", "pinned", "refused", "registered", "release", "settle"]

log = logging.getLogger(__name__)

# cudaHostRegisterPortable: the pages count as pinned for every CUDA context of the process.
_PORTABLE = 1


@dataclass
class Pinned:
    """One registered region: where it is mapped, and the event recorded after the last copy
    that reads it (None: nothing reads it now)."""

    base: int
    size: int
    fence: Any = None

    def holds(self, address: int) -> bool:
        return self.base <= address < self.base + self.size


_lock = threading.Lock()
_regions: dict[int, Pinned] = {}  # base address -> the registered region mapped there
_refused: str | None = None  # why regions are not registered in this process (said once)


def _address(view: memoryview) -> int:
    """Where ``view``'s first byte is (it holds at least one)."""
    return int(np.frombuffer(view, dtype=np.uint8, count=1).ctypes.data)


def _find(address: int) -> Pinned | None:
    with _lock:
        for p in _regions.values():
            if p.holds(address):
                return p
    return None


def _cuda_call(name: str, *args: int, device: torch.device | None = None) -> str | None:
    """``torch.cuda.cudart().<name>(*args)`` on a thread of its own: None if it succeeded, else why not."""
    out: list[str | None] = []

    def run() -> None:
        try:
            with torch.cuda.device(device) if device is not None else contextlib.nullcontext():
                rt = torch.cuda.cudart()
                err = getattr(rt, name)(*args)
            out.append(None if int(err) == 0 else f"{name}: {rt.cudaGetErrorString(err)} (error {int(err)})")
        except Exception as exc:  # noqa: BLE001 - any failure means: no pinned region here
            out.append(f"{name}: {type(exc).__name__}: {exc}")

    thread = threading.Thread(target=run, name="tether-pin", daemon=True)
    thread.start()
    thread.join()
    return out[0] if out else f"{name} did not return"


def registered() -> int:
    """How many regions are registered now."""
    with _lock:
        return len(_regions)


def refused() -> str | None:
    """Why shared regions are not registered in this process (None: they are, or none was tried)."""
    return _refused


def pinned(payload: memoryview, device: torch.device) -> Pinned | None:
    """The registered region ``payload`` lies in, registering that region first if it is one
    (a slice of a ``SharedRegion``'s view); None where the payload is not in a region (the
    socket's receive buffer) or regions cannot be registered here (said once in the log)."""
    global _refused
    mapping = payload.obj
    if not payload.nbytes or not isinstance(mapping, mmap.mmap):
        return None
    address = _address(payload)
    found = _find(address)
    if found is not None or _refused is not None:
        return found
    whole = memoryview(mapping)
    try:
        base, size = _address(whole), whole.nbytes
    finally:
        whole.release()
    why = _cuda_call("cudaHostRegister", base, size, _PORTABLE, device=device)
    if why is not None:
        with _lock:
            told, _refused = _refused is not None, why
        if not told:
            log.info("rows pulled through a shard's shared region are copied once into pinned memory before the GPU: "
                     "the region cannot be registered as pinned memory here (%s)", why)
        return None
    region = Pinned(base, size)
    with _lock:
        _regions[base] = region
    return region if region.holds(address) else None


def fence(region: Pinned, event: Any) -> None:
    """``event`` (recorded after a copy that reads ``region``) must be over before the region is written again."""
    region.fence = event


def _wait(region: Pinned) -> None:
    event, region.fence = region.fence, None
    if event is not None and not event.query():
        event.synchronize()


def settle(view: memoryview) -> None:
    """Wait until every copy that reads the region ``view`` maps has read it (before it is written
    again); at once where it is not registered."""
    if not _regions:
        return
    found = _find(_address(view))
    if found is not None:
        _wait(found)


def release(view: memoryview) -> None:
    """``settle``, then unregister the region (before it is unmapped); at once where it is not registered."""
    if not _regions:
        return
    found = _find(_address(view))
    if found is None:
        return
    _wait(found)
    with _lock:
        _regions.pop(found.base, None)
    why = _cuda_call("cudaHostUnregister", found.base)
    if why is not None:
        log.warning("could not unregister a shared region's pinned pages (%s)", why)
