"""A consistency mode, parsed once: ``async``, ``ssp:S`` or ``sync`` as a ``Mode`` (its text, kind
and bound). ``TrainingConfig.mode`` holds one; the launcher, ``tether compare``/``sweep`` and the
worker's policy (``tether.worker.training.policies``) read its ``kind`` and ``bound``."""

from __future__ import annotations

from tether.protos.errors import UsageError

__all__ = ["Mode", "check_window", "parse_mode"]


def parse_mode(mode: str) -> tuple[str, int | None]:
    """Split a consistency mode into its kind and bound: ``async``, ``ssp:S`` or ``sync`` (``Mode`` keeps the result).

    Raises:
        ValueError: anything else, or a negative S.
    """
    if isinstance(mode, str):
        if mode in ("async", "sync"):
            return mode, None
        kind, _, bound = mode.partition(":")
        if kind == "ssp" and bound.isdigit():
            return "ssp", int(bound)
    raise ValueError(f"mode must be 'async', 'ssp:S' (S >= 0) or 'sync', got {mode!r}")


class Mode(str):
    """A consistency mode, parsed: the text (a ``str``, so it compares, prints and is written to
    JSON as the text) with its ``kind`` and ``bound``. ``TrainingConfig.mode`` holds one, which
    its copies (``dataclasses.replace``) share: a process parses its mode once."""

    kind: str
    bound: int | None

    def __new__(cls, text: str) -> Mode:
        kind, bound = parse_mode(text)
        mode = super().__new__(cls, text)
        mode.kind, mode.bound = kind, bound
        return mode

    def __deepcopy__(self, memo: dict[int, object]) -> Mode:
        return self  # immutable, as the text is: ``dataclasses.asdict``'s copy is not parsed again

    @classmethod
    def ssp(cls, bound: int) -> Mode:
        """``ssp:<bound>``, made from the bound (nothing to parse: ``tether sweep``'s bounds).

        Raises:
            ValueError: not an int >= 0.
        """
        if isinstance(bound, bool) or not isinstance(bound, int) or bound < 0:
            raise ValueError(f"an ssp bound must be an integer >= 0, got {bound!r}")
        mode = super().__new__(cls, f"ssp:{bound}")
        mode.kind, mode.bound = "ssp", bound
        return mode

    @classmethod
    def of(cls, mode: str) -> Mode:
        """``mode`` as a ``Mode``: one already parsed as it is, a text parsed (once, here)."""
        return mode if isinstance(mode, Mode) else cls(mode)


def check_window(window: object, prefetch: bool, mode: str) -> int:
    """``push_window`` as a count of pushes in flight, refused (one line) where it means nothing.

    Raises:
        UsageError: not an int >= 1; or > 1 where every push lands before the next pull (ssp,
            sync, --no-prefetch).
    """
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise UsageError(f"push_window (--push-window) must be an int >= 1 (1: one push in flight, the default), got {window!r}")
    if window == 1 or prefetch:
        return window
    kind = mode.split(":")[0]
    why = {
        "sync": "sync pushes in lock step, each landing before the barrier",
        "ssp": f"{mode} lands every push before the next step reads, which is what holds every read to the bound; K pushes in "
               "flight would let a worker's reads miss K more of each worker's steps (the shards would see clock staleness "
               "up to S + K); use async with --push-window, or a larger S",
    }.get(kind, "--no-prefetch lands every push before the next pull: drop one of the two")
    raise UsageError(f"--push-window {window}: pushes in flight are for async with prefetching; {why}")
