"""Dense parameters on a shard: one flat float32 chunk and its optimizer state."""

from __future__ import annotations

import threading
from typing import Any

import torch

from tether.protos.errors import InvalidArgument
from tether.protos.specs import OptimizerConfig
from tether.rules.optimizers import rule
from tether.rules.push_hooks import running_mean

__all__ = ["DenseChunk"]


class DenseChunk:
    """One chunk of a dense parameter (flat float32) and its optimizer state."""

    def __init__(self, name: str, index: int, init: torch.Tensor, optimizer: OptimizerConfig) -> None:
        if init.dim() != 1 or init.numel() == 0:
            raise InvalidArgument(f"dense chunk {name}[{index}] must be a non-empty 1-D tensor, got shape {tuple(init.shape)}")
        self.name = name
        self.index = index
        self.optimizer = optimizer
        self.value = init.to(torch.float32).clone()
        self.version = 0
        self._lock = threading.Lock()
        # Per-element state (a rule's per-row scalar, Adam's step count, is one for the chunk). A
        # rule defined on embedding rows only steps a chunk with its dense form (rowwise_adagrad:
        # adagrad, each element a row of one); the chunk keeps the optimizer it was declared with.
        self._rule = rule(optimizer.name).dense_rule()
        start = self._rule.initial_state(optimizer)
        self._state = {k: torch.full(s, start.get(k, 0.0)) for k, s in self._rule.state_shapes(init.numel()).items()}
        # Per-element running means the push remedies keep (push_hooks: DC-ASGD-a, gap-aware), by
        # name, made on first use; -1: none yet. Not in checkpoints (running statistics).
        self._means: dict[str, torch.Tensor] = {}

    @property
    def numel(self) -> int:
        """Number of elements."""
        return self.value.numel()

    def pull(self) -> tuple[torch.Tensor, int]:
        """The chunk's values (read without a lock) and their version."""
        return self.value, self.version

    def push(self, grad: torch.Tensor, lr_scale: float = 1.0, step_scale: torch.Tensor | None = None) -> int:
        """Apply a gradient with the chunk's optimizer; returns the new version. ``step_scale``
        (one factor per element; gap-aware's ``1 / penalty``) multiplies the step the rule took,
        whatever the rule: the optimizer's state still takes the whole gradient."""
        with self._lock:
            before = None if step_scale is None else self.value.clone()
            self._rule.apply(self.optimizer, self.value, grad, self._state, lr_scale)
            if before is not None and step_scale is not None:
                # One in-place subtraction: a lock-free pull sees each element at its step's
                # whole or its damped value, never the step alone.
                step = self.value - before
                self.value.sub_(step.mul_(1.0 - step_scale.reshape(self.value.shape)))
            self.version += 1
            return self.version

    def running_means(self, name: str, x: torch.Tensor | None = None, decay: float = 0.95) -> torch.Tensor:
        """A per-element running mean kept for a push remedy (``push_hooks``), -1 where none was
        taken yet; with ``x`` (one value per element) it takes ``x`` first
        (``push_hooks.running_mean``). Returns a copy (float32)."""
        with self._lock:
            means = self._means.get(name)
            if means is None:
                means = self._means[name] = torch.full((self.numel,), -1.0)
            if x is not None:
                means.copy_(torch.from_numpy(running_mean(means.numpy(), x.detach().reshape(-1).to(torch.float32).numpy(), decay)))
            return means.clone()

    def snapshot(self) -> dict[str, Any]:
        """Value, optimizer state and version (copies)."""
        with self._lock:
            return {"value": self.value.clone(), "state": {k: t.clone() for k, t in self._state.items()}, "version": self.version}

    def load(self, value: torch.Tensor, state: dict[str, torch.Tensor], version: int) -> None:
        """Replace value, optimizer state and version with restored ones.

        Raises:
            ValueError: a value or state of another shape.
        """
        if tuple(value.shape) != (self.numel,):
            raise ValueError(
                f"dense chunk {self.name}[{self.index}]: restored value has shape {tuple(value.shape)}, expected ({self.numel},)"
            )
        if set(state) != set(self._state) or any(state[k].shape != t.shape for k, t in self._state.items()):
            raise ValueError(f"dense chunk {self.name}[{self.index}]: restored optimizer state does not match {self.optimizer.name}")
        with self._lock:
            self.value = value.to(torch.float32).clone()
            self._state = {k: t.to(torch.float32).clone() for k, t in state.items()}
            self._means = {}
            self.version = int(version)