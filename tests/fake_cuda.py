"""A CUDA device for tests of device placement on a CPU-only machine.

Inside ``with FakeCuda():`` a tensor "on the GPU" is a CPU tensor of class ``OnCuda`` that
reports ``device`` ``cuda:0``. It is made the ways a real one is (``.to("cuda")``, ``.cuda()``,
``device="cuda"`` in a factory, any op on one) and leaves by ``.cpu()`` or ``.to("cpu")`` (a
copy, as on a GPU). An op that combines it with a CPU tensor of one dimension or more raises
what CUDA raises, and so does ``.numpy()``; 0-dim CPU tensors combine freely, as CUDA allows.
It is stricter than CUDA in one way (CPU index tensors are refused too) and never laxer, so
code that runs here keeps its tensors on one device.

It also stands in for what overlaps host and device work (issue 26):

- **pinned memory**: ``pin_memory=True`` in a factory and ``Tensor.pin_memory()`` give CPU
  tensors that ``is_pinned()`` (views of them too);
- **streams and events**: ``torch.cuda.Stream``, ``Event``, ``current_stream``, ``stream``,
  ``device``, ``current_device`` and ``synchronize`` work, and ``Tensor.record_stream`` takes
  a fake stream;
- **what waits for the GPU**, in ``syncs``: reading a device tensor's values on the host
  (``item``, ``float``, ``bool``, ``int``, ``tolist``, ``torch.equal``, a blocking copy to the
  host, ops whose output size depends on device values such as ``nonzero``, ``unique`` or a
  boolean mask) and ``synchronize`` of an event, a stream or the device;
- **copies between host and device**, in ``copies`` (direction, bytes, whether the host side is
  pinned, whether it was asked not to block, the stream and the thread). A non-blocking copy
  from the device into pinned memory lands, as on a GPU, only once something waits for it (an
  event recorded after it, or any host read of device values): until then its destination
  holds garbage (NaN, or -7777 for integers), so code that reads it too early fails here.

- **registering host memory** (``torch.cuda.cudart().cudaHostRegister`` / ``cudaHostUnregister``,
  in ``registered``): a registered range counts as pinned; ``FakeCuda(refuse_register=True)``
  answers "operation not supported" (error 801) instead, as a platform that will not pin it does;
- with ``FakeCuda(late_reads=True)``, **when a copy to the device reads its pinned source**: only
  once something waits for it (as copies from the device land), and a source changed before
  then is noted in ``overwritten`` (the device would have read the new bytes), while events
  recorded after such a copy stay unfinished (``query`` false) until then.

Threads started inside the ``with`` see the fake device too. ``FakeCuda(available=True)`` also
makes ``torch.cuda.is_available()`` true (for code that picks its device by it).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves
from typing_extensions import Self

__all__ = ["Copy", "FakeCuda", "FakeCudart", "FakeEvent", "FakeStream", "OnCuda", "on_fake_cuda"]

CUDA = torch.device("cuda", 0)


class OnCuda(torch.Tensor):
    """CPU data that stands for a tensor on ``cuda:0`` (see ``FakeCuda``)."""

    # The mode does all the work; the class only marks the tensor and reports its device.
    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]

    @property
    def device(self) -> torch.device:  # type: ignore[override]
        return CUDA

    @property
    def is_cuda(self) -> bool:  # type: ignore[override]
        return True


class OnCudaParameter(OnCuda, nn.Parameter):
    """A parameter on the fake ``cuda:0``."""


def _mark(t: torch.Tensor) -> torch.Tensor:
    if not isinstance(t, OnCuda):
        # The same tensor object (autograd history and aliasing kept), now reporting cuda:0.
        t.__class__ = OnCudaParameter if isinstance(t, nn.Parameter) else OnCuda
    return t


def on_fake_cuda(module: nn.Module) -> nn.Module:
    """``module`` with every parameter and buffer on the fake ``cuda:0`` (in place)."""
    for m in module.modules():
        for t in [*m._parameters.values(), *m._buffers.values()]:
            if t is not None:
                _mark(t)
    return module


def _is_cuda(device: Any) -> bool:
    return device is not None and torch.device(device).type == "cuda"


@dataclass(frozen=True)
class Copy:
    """One copy between host and device."""

    direction: str  # "h2d" or "d2h"
    nbytes: int
    dtype: torch.dtype
    pinned: bool  # the host side is pinned memory
    non_blocking: bool
    stream: str  # the stream it was queued on
    thread: str  # the name of the thread that queued it
    host_ptr: int  # where the host side's bytes start


class FakeStream(torch.Stream):
    """A CUDA stream of the fake device (a ``torch.Stream``, so ``record_stream`` takes it)."""

    def __new__(cls, device: Any = None, priority: int = 0, name: str = "") -> Self:
        return super().__new__(cls, device="cpu")

    def __init__(self, device: Any = None, priority: int = 0, name: str = "") -> None:
        self.name = name or f"stream-{id(self):x}"
        self.waited: list[FakeEvent] = []

    def wait_event(self, event: Any) -> None:
        self.waited.append(event)

    def wait_stream(self, stream: torch.Stream) -> None:
        pass

    def record_event(self, event: Any = None) -> Any:
        event = event or FakeEvent()
        event.record(self)
        return event

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        _active().sync("Stream.synchronize")

    def __repr__(self) -> str:
        return f"FakeStream({self.name})"


class FakeEvent:
    """A CUDA event of the fake device: ``synchronize`` lands the copies queued before ``record``."""

    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False) -> None:
        self._mark: int | None = None

    def record(self, stream: FakeStream | None = None) -> None:
        self._mark = _active().queued()

    def query(self) -> bool:
        return self._mark is None or not _active().pending(self._mark)

    def synchronize(self) -> None:
        fake = _active()
        fake.sync("Event.synchronize")
        if self._mark is not None:
            fake.land(self._mark)

    def wait(self, stream: FakeStream | None = None) -> None:
        pass


_ACTIVE: list[FakeCuda] = []


def _active() -> FakeCuda:
    if not _ACTIVE:
        raise RuntimeError("a fake CUDA stream or event used outside 'with FakeCuda()'")
    return _ACTIVE[-1]


# Ops whose output size depends on device values: CUDA copies a count back and waits for it.
_SIZED_BY_VALUES = {torch.nonzero, torch.Tensor.nonzero, torch.unique, torch.Tensor.unique, torch.masked_select,
                    torch.Tensor.masked_select, torch.unique_consecutive, torch.argwhere}
# Host reads of a device tensor's values.
_READS = {torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.__bool__, torch.Tensor.__float__, torch.Tensor.__int__,
          torch.Tensor.__index__, torch.equal}
_FACTORIES_PINNED = "pin_memory"


class FakeCudart:
    """``torch.cuda.cudart()`` of the fake device: registering host memory (see ``FakeCuda``)."""

    NOT_SUPPORTED = 801

    def __init__(self, fake: FakeCuda) -> None:
        self._fake = fake

    def cudaHostRegister(self, ptr: int, size: int, flags: int) -> int:
        fake = self._fake
        with fake._lock:
            fake.register_calls.append(("register", ptr, size))
            if fake.refuse_register:
                return self.NOT_SUPPORTED
            fake.registered[ptr] = size
        return 0

    def cudaHostUnregister(self, ptr: int) -> int:
        fake = self._fake
        with fake._lock:
            fake.register_calls.append(("unregister", ptr, 0))
            return 0 if fake.registered.pop(ptr, None) is not None else 712  # cudaErrorHostMemoryNotRegistered

    def cudaGetErrorString(self, err: int) -> str:
        return {self.NOT_SUPPORTED: "operation not supported", 712: "part or all of the requested memory range is not mapped"}.get(
            err, f"error {err}")


class FakeCuda(TorchFunctionMode):
    """Torch calls see ``OnCuda`` tensors as on another device than the CPU's."""

    def __init__(self, available: bool = False, refuse_register: bool = False, late_reads: bool = False) -> None:
        super().__init__()
        self.available = available
        self.refuse_register = refuse_register
        self.late_reads = late_reads
        # Registered host memory (start -> bytes), and every register/unregister call (what, start, bytes).
        self.registered: dict[int, int] = {}
        self.register_calls: list[tuple[str, int, int]] = []
        self.cudart = FakeCudart(self)
        # Copies to the device whose pinned source was changed before anything waited for them.
        self.overwritten: list[Copy] = []
        # Copies to the device not waited for yet (late_reads): (sequence number, source, its bytes then, the copy).
        self._reads: list[tuple[int, torch.Tensor, torch.Tensor, Copy]] = []
        self.syncs: list[str] = []
        self.copies: list[Copy] = []
        self.pin_calls = 0  # Tensor.pin_memory(): a host copy into pinned memory
        self._lock = threading.RLock()
        self._pinned: dict[int, torch.UntypedStorage] = {}
        # Non-blocking copies from the device not landed yet: (sequence number, destination, source).
        self._pending: list[tuple[int, torch.Tensor, torch.Tensor]] = []
        self._seq = 0
        self._local = threading.local()
        self.default_stream = FakeStream(name="default")
        self._saved: dict[str, Any] = {}
        self._saved_run: Callable[[threading.Thread], None] = threading.Thread.run
        self._depth = 0

    # -- what the tests read ------------------------------------------------------------------

    def sync(self, what: str) -> None:
        """Note a wait for the device; everything queued before it lands."""
        with self._lock:
            self.syncs.append(what)
            self.land(self._seq)

    def queued(self) -> int:
        with self._lock:
            return self._seq

    def pending(self, mark: int) -> bool:
        with self._lock:
            return any(seq < mark for seq, _, _ in self._pending) or any(seq < mark for seq, _, _, _ in self._reads)

    def land(self, mark: int) -> None:
        """Finish the non-blocking copies queued before ``mark``."""
        with self._lock:
            keep = []
            for seq, dst, src in self._pending:
                if seq < mark:
                    torch.Tensor.copy_(dst, src)
                else:
                    keep.append((seq, dst, src))
            self._pending = keep
            reads = []
            for seq, src, then, copy in self._reads:
                if seq >= mark:
                    reads.append((seq, src, then, copy))
                elif not torch.Tensor.equal(src, then):
                    self.overwritten.append(copy)
            self._reads = reads

    def is_pinned(self, t: torch.Tensor) -> bool:
        if isinstance(t, OnCuda):
            return False
        if t.untyped_storage().data_ptr() in self._pinned:
            return True
        ptr = t.data_ptr()
        return any(start <= ptr < start + size for start, size in self.registered.items())

    def _read_later(self, copy: Copy, src: torch.Tensor) -> None:
        """With ``late_reads``: ``copy`` to the device reads ``src`` only once something waits for it."""
        with self._lock:
            if self.late_reads and copy.pinned and copy.non_blocking:
                self._reads.append((self._seq, src, torch.Tensor.clone(src), copy))
                self._seq += 1

    def current_stream(self) -> FakeStream:
        return getattr(self._local, "stream", None) or self.default_stream

    # -- entering: torch.cuda's stream API and threads ----------------------------------------

    def __enter__(self) -> Self:
        if self._depth == 0:
            self._patch()
        self._depth += 1
        return super().__enter__()

    def __exit__(self, *exc: object) -> None:
        super().__exit__(*exc)
        self._depth -= 1
        if self._depth == 0:
            self._unpatch()

    def _patch(self) -> None:
        fake = self
        cuda = torch.cuda

        @contextlib.contextmanager
        def stream(s: FakeStream | None) -> Iterator[None]:
            before = getattr(fake._local, "stream", None)
            fake._local.stream = s
            try:
                yield
            finally:
                fake._local.stream = before

        @contextlib.contextmanager
        def device(d: Any) -> Iterator[None]:
            yield

        run = threading.Thread.run

        def run_faked(thread: threading.Thread) -> None:
            # The mode only (torch's mode stack is per thread); patching is the owner's.
            TorchFunctionMode.__enter__(fake)
            try:
                run(thread)
            finally:
                TorchFunctionMode.__exit__(fake, None, None, None)

        replaced: dict[str, Any] = {
            "Stream": FakeStream,
            "Event": FakeEvent,
            "current_stream": lambda device=None: fake.current_stream(),
            "stream": stream,
            "device": device,
            "current_device": lambda: 0,
            "synchronize": lambda device=None: fake.sync("torch.cuda.synchronize"),
            "cudart": lambda: fake.cudart,
        }
        if self.available:
            replaced.update(is_available=lambda: True, device_count=lambda: 1)
        self._saved = {name: getattr(cuda, name) for name in replaced}
        for name, value in replaced.items():
            setattr(cuda, name, value)
        self._saved_run = run
        setattr(threading.Thread, "run", run_faked)  # noqa: B010 - a method mypy would not let be assigned
        _ACTIVE.append(self)

    def _unpatch(self) -> None:
        setattr(threading.Thread, "run", self._saved_run)  # noqa: B010
        for name, value in self._saved.items():
            setattr(torch.cuda, name, value)
        self._saved = {}
        _ACTIVE.remove(self)

    # -- the mode -------------------------------------------------------------------------------

    def _copy(self, direction: str, host: torch.Tensor, nbytes: int, dtype: torch.dtype, pinned: bool, non_blocking: bool) -> Copy:
        copy = Copy(direction, nbytes, dtype, pinned, non_blocking, self.current_stream().name, threading.current_thread().name,
                    host.data_ptr())
        with self._lock:
            self.copies.append(copy)
        return copy

    def _later(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """A non-blocking copy from the device into pinned memory: lands when something waits."""
        # The garbage is written before the copy is queued, under the lock: another thread's wait
        # that lands the copy must not be overwritten by it.
        with self._lock:
            if dst.is_floating_point():
                torch.Tensor.fill_(dst, float("nan"))
            elif dst.dtype == torch.bool:
                torch.Tensor.fill_(dst, False)
            else:
                torch.Tensor.fill_(dst, -7777)
            self._pending.append((self._seq, dst, torch.Tensor.clone(src)))
            self._seq += 1

    def __torch_function__(self, func: Callable[..., Any], types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = dict(kwargs or {})
        tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        gpu = any(isinstance(t, OnCuda) for t in tensors)
        name = getattr(func, "__name__", str(func))
        if func is torch.Tensor.numpy and gpu:
            raise TypeError("can't convert cuda:0 device type tensor to numpy. Use Tensor.cpu() to copy the tensor to host memory first.")
        if gpu and (func in _READS or func in _SIZED_BY_VALUES):
            self.sync(name)
        elif gpu and func is torch.Tensor.__getitem__ and any(isinstance(t, OnCuda) and t.dtype == torch.bool for t in tensors[1:]):
            self.sync("boolean mask")
        if func is torch.Tensor.pin_memory:
            self.pin_calls += 1
            out = torch.Tensor.clone(args[0])
            self._pinned[out.untyped_storage().data_ptr()] = out.untyped_storage()
            return out
        if func is torch.Tensor.is_pinned:
            return self.is_pinned(args[0])
        if func is torch.Tensor.record_stream:
            if not isinstance(args[0], OnCuda) or not isinstance(args[1], FakeStream):
                raise RuntimeError("record_stream takes a CUDA tensor and a CUDA stream")
            return None
        if kwargs.pop(_FACTORIES_PINNED, False):
            out = func(*args, **kwargs)
            self._pinned[out.untyped_storage().data_ptr()] = out.untyped_storage()
            return out
        if func is torch.Tensor.copy_ and gpu:
            dst, src = args[0], args[1]
            non_blocking = bool(kwargs.get("non_blocking", args[2] if len(args) > 2 else False))
            if isinstance(dst, OnCuda) and not isinstance(src, OnCuda):
                copy = self._copy("h2d", src, src.numel() * src.element_size(), src.dtype, self.is_pinned(src), non_blocking)
                self._read_later(copy, src)
                torch.Tensor.copy_(dst, src)
                return dst
            if not isinstance(dst, OnCuda):
                pinned = self.is_pinned(dst)
                self._copy("d2h", dst, src.numel() * src.element_size(), src.dtype, pinned, non_blocking)
                if non_blocking and pinned:
                    self._later(dst, src)
                else:
                    self.sync("blocking copy to the host")
                    torch.Tensor.copy_(dst, src)
                return dst
            return func(*args, **kwargs)
        if func is torch.Tensor.cpu:
            if gpu:
                self._copy("d2h", args[0], args[0].numel() * args[0].element_size(), args[0].dtype, False, False)
                self.sync("cpu()")
                return torch.Tensor.clone(args[0])
            return func(*args, **kwargs)
        if func is torch.Tensor.cuda:
            if gpu:
                return args[0]
            copy = self._copy("h2d", args[0], args[0].numel() * args[0].element_size(), args[0].dtype, self.is_pinned(args[0]),
                              bool(kwargs.get("non_blocking", False)))
            self._read_later(copy, args[0])
            return _mark(torch.Tensor.clone(args[0]))
        if func is torch.Tensor.to:
            src = args[0]
            if len(args) > 1 and isinstance(args[1], torch.Tensor):  # .to(other): other's device and dtype
                device, dtype, non_blocking = (CUDA if isinstance(args[1], OnCuda) else torch.device("cpu")), args[1].dtype, False
            else:
                device, dtype, non_blocking, _ = torch._C._nn._parse_to(*args[1:], **kwargs)
            src_gpu = isinstance(src, OnCuda)
            if device is not None and _is_cuda(device) != src_gpu:
                nbytes = src.numel() * src.element_size()
                if src_gpu:
                    # As torch does, a non-blocking copy to the host goes into pinned memory.
                    out = torch.empty(src.shape, dtype=dtype or src.dtype)
                    self._copy("d2h", out, nbytes, src.dtype, bool(non_blocking), bool(non_blocking))
                    if non_blocking:
                        self._pinned[out.untyped_storage().data_ptr()] = out.untyped_storage()
                        self._later(out, torch.Tensor.to(src, dtype=dtype or src.dtype))
                    else:
                        self.sync("blocking copy to the host")
                        torch.Tensor.copy_(out, src)
                    return out
                self._read_later(self._copy("h2d", src, nbytes, src.dtype, self.is_pinned(src), bool(non_blocking)), src)
                return _mark(torch.Tensor.to(src, dtype=dtype or src.dtype, copy=True))
            out = torch.Tensor.to(src, dtype=dtype or src.dtype)
            return _mark(out) if src_gpu else out
        if _is_cuda(kwargs.get("device")):
            kwargs["device"] = "cpu"
            gpu = True
        elif gpu and any(not isinstance(t, OnCuda) and t.dim() > 0 for t in tensors):
            shapes = [("cuda:0" if isinstance(t, OnCuda) else "cpu", tuple(t.shape)) for t in tensors]
            raise RuntimeError(f"Expected all tensors to be on the same device, but found at least two devices, cuda:0 and cpu! ({name}: {shapes})")
        out = func(*args, **kwargs)
        if gpu:
            plain_inputs = {id(t) for t in tensors if not isinstance(t, OnCuda)}
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor) and id(t) not in plain_inputs:
                    _mark(t)
        return out
