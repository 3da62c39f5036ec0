"""A CUDA device for tests of device placement on a CPU-only machine.

Inside ``with FakeCuda():`` a tensor "on the GPU" is a CPU tensor of class ``OnCuda`` that
reports ``device`` ``cuda:0``. It is made the ways a real one is (``.to("cuda")``, ``.cuda()``,
``device="cuda"`` in a factory, any op on one) and leaves by ``.cpu()`` or ``.to("cpu")`` (a
copy, as on a GPU). An op that combines it with a CPU tensor of one dimension or more raises
what CUDA raises, and so does ``.numpy()``; 0-dim CPU tensors combine freely, as CUDA allows.
It is stricter than CUDA in one way (CPU index tensors are refused too) and never laxer, so
code that runs here keeps its tensors on one device.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

__all__ = ["FakeCuda", "OnCuda", "on_fake_cuda"]

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


class FakeCuda(TorchFunctionMode):
    """Torch calls see ``OnCuda`` tensors as on another device than the CPU's."""

    def __torch_function__(self, func: Callable[..., Any], types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = dict(kwargs or {})
        tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        gpu = any(isinstance(t, OnCuda) for t in tensors)
        name = getattr(func, "__name__", str(func))
        if func is torch.Tensor.numpy and gpu:
            raise TypeError("can't convert cuda:0 device type tensor to numpy. Use Tensor.cpu() to copy the tensor to host memory first.")
        if func is torch.Tensor.cpu:
            return torch.Tensor.clone(args[0]) if gpu else func(*args, **kwargs)
        if func is torch.Tensor.cuda:
            return args[0] if gpu else _mark(torch.Tensor.clone(args[0]))
        if func is torch.Tensor.to:
            src = args[0]
            if len(args) > 1 and isinstance(args[1], torch.Tensor):  # .to(other): other's device and dtype
                device, dtype = (CUDA if isinstance(args[1], OnCuda) else torch.device("cpu")), args[1].dtype
            else:
                device, dtype, _, _ = torch._C._nn._parse_to(*args[1:], **kwargs)
            src_gpu = isinstance(src, OnCuda)
            if device is not None and _is_cuda(device) != src_gpu:
                out = torch.Tensor.to(src, dtype=dtype or src.dtype, copy=True)
                return _mark(out) if _is_cuda(device) else out
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
