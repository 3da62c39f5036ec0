"""A consistency mode, parsed once: ``async``, ``ssp:S`` or ``sync`` as a ``Mode`` (its text, kind
and bound). ``TrainingConfig.mode`` holds one; the launcher, ``tether compare``/``sweep`` and the
worker's policy (``tether.worker.training.policies``) read its ``kind`` and ``bound``."""

from __future__ import annotations

__all__ = ["Mode", "parse_mode"]


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
