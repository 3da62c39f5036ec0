"""The words a process says before it compiles tether's kernels (``tether.rules.kernel_cache``),
importable without numba or torch: ``tether launch`` shows the first such line of its children
on its console (``tether.deploy.children``)."""

from __future__ import annotations

__all__ = ["COMPILE_NOTICE"]

COMPILE_NOTICE = "compiling tether's kernels:"
