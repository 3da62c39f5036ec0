"""The contract's names and defaults, declared once and without torch: the update rules' names
and the default rule and rate (``OptimizerConfig``, ``tether.protos.specs``), a new table's
default ``init_scale`` (``TableConfig``), the wire element types (``tether.protos.codec``'s
``WIRE_DTYPES`` maps these names to torch dtypes) and the data-plane transports
(``tether.protos.framing``). Those modules and the job's flags (``tether.worker.config``) take
them from here, so the launcher's help, flag parsing and usage errors import no torch.

The rules themselves are registered in ``tether.rules.optimizers``, which refuses to import if
its registry's names are not these, in this order."""

from __future__ import annotations

__all__ = [
    "INIT_SCALE", "OPTIMIZER", "OPTIMIZERS", "OPTIMIZER_LR", "REMEDY_DECAY", "TRANSPORTS", "WIRE_DTYPE_NAMES", "check_optimizer",
    "check_remedies",
]

# The update rules' names (``OptimizerConfig.name``, ``--optimizer``), in the registry's order.
OPTIMIZERS: tuple[str, ...] = ("sgd", "adagrad", "adam", "rowwise_adagrad", "ftrl")
# OptimizerConfig's default rule and learning rate (and so --optimizer's and --lr's).
OPTIMIZER = "adagrad"
OPTIMIZER_LR = 0.05
# TableConfig's default init_scale: new rows start uniform in [-init_scale, init_scale].
INIT_SCALE = 0.05
# The element types parameters and gradients may travel in, by the names flags and configs use
# (each is torch's dtype of that name).
WIRE_DTYPE_NAMES: tuple[str, ...] = ("float32", "float16", "bfloat16")
# How a worker's pushes and pulls travel (ClientConfig.transport, --transport).
TRANSPORTS: tuple[str, ...] = ("auto", "tcp", "grpc")
# Decay m of the shard's running means behind DC-ASGD-a and gap-aware (PushRequest.remedy_decay,
# --remedy-decay): mean = m * mean + (1 - m) * x; Zheng et al. 2017 use 0.95.
REMEDY_DECAY = 0.95


def check_optimizer(name: str) -> None:
    """Raises ValueError, naming the rules there are, unless ``name`` is one of ``OPTIMIZERS``."""
    if name not in OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {name!r}")


def check_remedies(delay_compensation: float, dc_adaptive: bool, decay: float) -> None:
    """The staleness remedies a push asks for (``PushRequest``'s ``delay_compensation``,
    ``dc_adaptive``, ``remedy_decay``; the flags of the same names) fit together.

    Raises:
        ValueError: a lambda that is not a finite number >= 0, the adaptive variant without a
            lambda0 > 0, or a decay outside (0, 1); naming the flag and the value.
    """
    value = delay_compensation
    if not (isinstance(value, (int, float)) and not isinstance(value, bool) and 0 <= value < float("inf")):
        raise ValueError(f"--delay-compensation must be a finite number >= 0, got {value!r}")
    if dc_adaptive and not delay_compensation > 0:
        raise ValueError("--dc-adaptive needs --delay-compensation LAMBDA0 > 0 (DC-ASGD-a's lambda0; 2 in Zheng et al.'s runs)")
    if not (isinstance(decay, (int, float)) and not isinstance(decay, bool) and 0 < decay < 1):
        raise ValueError(f"--remedy-decay must be a number in (0, 1), got {decay!r}")
