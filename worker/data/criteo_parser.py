"""Criteo-format lines parsed a block at a time with numpy (SWAR: a few integer operations per
field, nothing per byte), and the one-line message that names a malformed line."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np

from tether.protos.partition import mix64
from tether.worker.data.synthetic import ID_MASK, MalformedLineError

__all__ = ["CriteoParser"]

# Missing categorical values are stored as this raw value (so each field gets one reserved id).
_MISSING = (1 << 64) - 1
# Dense counts are clamped here before log1p; far beyond any real count, and float64-safe.
_DENSE_CAP = 1 << 62

_U64 = np.uint64
_ONES = _U64(0x0101010101010101)
_HIGH = _U64(0x8080808080808080)
_LOW7 = _ONES * _U64(127)
_ZEROS = _U64(0x3030303030303030)  # eight ASCII '0'
_CASE = _U64(0x2020202020202020)
# _KEEP[k]: the last k bytes (the most significant, little-endian) of an 8-byte word.
_KEEP = np.array([0] + [((1 << 64) - 1) ^ ((1 << (8 * (8 - k))) - 1) for k in range(1, 9)], dtype=np.uint64)
_PAD = 16  # '0' bytes before a block, so the two words ending at any field's end can be read
_INT = re.compile(rb"[+-]?[0-9]+")
_HEX = re.compile(rb"[0-9a-fA-F]{1,16}")


def _between(w: np.ndarray, lo: int, hi: int) -> np.ndarray:
    """0x80 in each byte of ``w`` strictly between ``lo`` and ``hi`` (never in a byte >= 0x80)."""
    w7 = w & _LOW7
    return (_ONES * _U64(127 + hi) - w7) & ~w & (w7 + _ONES * _U64(127 - lo)) & _HIGH


def _all_digits(w: np.ndarray) -> np.ndarray:
    return _between(w, 0x2F, 0x3A) == _HIGH


def _all_hex(w: np.ndarray) -> np.ndarray:
    return (_between(w, 0x2F, 0x3A) | _between(w | _CASE, 0x60, 0x67)) == _HIGH


def _decimal8(w: np.ndarray) -> np.ndarray:
    """The value of eight ASCII digits, the first in the lowest byte (SWAR: three multiplies)."""
    v = w - _ZEROS
    v = (v * _U64(10) + (v >> _U64(8))) & _U64(0x00FF00FF00FF00FF)
    v = (v * _U64(100) + (v >> _U64(16))) & _U64(0x0000FFFF0000FFFF)
    return (v * _U64(10000) + (v >> _U64(32))) & _U64(0xFFFFFFFF)


def _hex8(w: np.ndarray) -> np.ndarray:
    """The value of eight ASCII hex digits (either case), the first in the lowest byte."""
    n = (w & _U64(0x0F0F0F0F0F0F0F0F)) + _U64(9) * ((w >> _U64(6)) & _ONES)
    n = ((n << _U64(4)) + (n >> _U64(8))) & _U64(0x00FF00FF00FF00FF)
    n = ((n << _U64(8)) + (n >> _U64(16))) & _U64(0x0000FFFF0000FFFF)
    return ((n << _U64(16)) + (n >> _U64(32))) & _U64(0xFFFFFFFF)


class CriteoParser:
    """Parses blocks of whole Criteo lines at once with numpy.

    Each field is read as the 8-byte word that ends where the field ends (and the word before
    it, for 9-16 characters), its bytes before the field masked to ASCII '0'; the digits are
    checked and converted within the word (SWAR), so the work per field is a few integer
    operations whatever its content, and nothing is done per byte of the block but finding the
    tabs. Any line that fails a check sends the block to ``_explain``, which finds the first bad
    line with the plain rules and names it.
    """

    def __init__(self, num_dense: int, num_sparse: int) -> None:
        self.num_dense = num_dense
        self.num_sparse = num_sparse
        self.num_cols = 1 + num_dense + num_sparse
        self._field_salts = mix64(np.arange(num_sparse, dtype=np.uint64)[None, :] + _U64(0xC817E0))

    def parse(self, block: bytes, path: Path, linenos: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Labels (float32 [n]), dense (float32 [n, num_dense]) and ids (int64 [n, num_sparse])
        of ``block``, whole lines each ending in ``\\n`` (no ``\\r``); ``linenos[i]`` is line
        ``i``'s number in ``path`` (for messages).

        Raises:
            MalformedLineError: the first bad line of the block.
        """
        padded = np.empty(len(block) + _PAD, np.uint8)
        padded[:_PAD] = 0x30
        a = padded[_PAD:]
        a[:] = np.frombuffer(block, np.uint8)
        words = np.ndarray((padded.size - 7,), dtype="<u8", buffer=padded, strides=(1,))
        cols = self.num_cols
        sep = np.flatnonzero(a <= 10)  # tabs and newlines, and any other control byte below
        kinds = a[sep]
        n = int(np.count_nonzero(kinds == 10))
        if sep.size != n * cols or not ((kinds.reshape(n, cols)[:, :-1] == 9).all() and (kinds[cols - 1 :: cols] == 10).all()):
            self._explain(block, path, linenos)
        lens = (np.diff(sep, prepend=-1) - 1).reshape(n, cols)
        ends = sep.reshape(n, cols)
        label = a[ends[:, 0] - 1]
        ok = (lens[:, 0] == 1) & ((label == 0x30) | (label == 0x31))

        nd = self.num_dense
        d_end, d_len = ends[:, 1 : 1 + nd], lens[:, 1 : 1 + nd]
        first = a[d_end - d_len]  # a field's first byte (its tab when empty)
        negative = (d_len > 0) & (first == 0x2D)
        digits = d_len - (negative | ((d_len > 0) & (first == 0x2B)))
        ok &= ((d_len == 0) | (digits > 0)).all(1)
        longest = int(digits.max(initial=0))
        w = self._word(words, d_end, np.minimum(digits, 8))
        ok &= _all_digits(w).all(1)
        counts = _decimal8(w)
        if longest > 8:
            w = self._word(words, d_end - 8, np.clip(digits - 8, 0, 8))
            ok &= _all_digits(w).all(1)
            counts += _decimal8(w) * _U64(100_000_000)
        if longest > 16:  # beyond 16 digits: rare enough for Python ints
            for i, j in zip(*np.nonzero(digits > 16), strict=False):
                text = bytes(a[d_end[i, j] - d_len[i, j] : d_end[i, j]])
                if _INT.fullmatch(text):
                    counts[i, j] = min(max(int(text), 0), _DENSE_CAP)
                else:
                    ok[i] = False
        counts[negative] = 0

        c_end, c_len = ends[:, 1 + nd :], lens[:, 1 + nd :]
        ok &= (c_len <= 16).all(1)
        w = self._word(words, c_end, np.minimum(c_len, 8))
        ok &= _all_hex(w).all(1)
        raw = _hex8(w)
        if int(c_len.max(initial=0)) > 8:
            w = self._word(words, c_end - 8, np.clip(c_len - 8, 0, 8))
            ok &= _all_hex(w).all(1)
            raw |= _hex8(w) << _U64(32)
        if not ok.all():
            self._explain(block, path, linenos)
        raw[c_len == 0] = _U64(_MISSING)
        raw ^= self._field_salts
        ids = (mix64(raw) & ID_MASK).view(np.int64)
        dense = np.log1p(counts.astype(np.float64)).astype(np.float32)
        return (label == 0x31).astype(np.float32), dense, ids

    @staticmethod
    def _word(words: np.ndarray, ends: np.ndarray, keep: np.ndarray) -> np.ndarray:
        """The 8 bytes before each of ``ends``, all but the last ``keep`` set to ASCII '0'."""
        w = words[ends + (_PAD - 8)]
        k = _KEEP[keep]
        return (w & k) | (_ZEROS & ~k)

    def _explain(self, block: bytes, path: Path, linenos: np.ndarray) -> None:
        """Raise for the first bad line of ``block``, checked one line at a time.

        Raises:
            MalformedLineError: always.
        """
        lines = block.split(b"\n")[:-1]
        for line, lineno in zip(lines, linenos.tolist(), strict=False):
            problem = self._problem(line)
            if problem:
                raise MalformedLineError(f"{path}:{lineno}: {problem}")
        raise MalformedLineError(f"{path}:{int(linenos[0])}: a malformed line in the {len(lines)} lines from here")  # not reached

    def _problem(self, line: bytes) -> str | None:
        """What is wrong with one line (no newline), or None."""
        cols = line.split(b"\t")
        if len(cols) != self.num_cols:
            return f"expected {self.num_cols} tab-separated columns, got {len(cols)}"

        def text(v: bytes) -> str:
            return v.decode("utf-8", "backslashreplace")

        if cols[0] not in (b"0", b"1"):
            return f"label must be 0 or 1, got {text(cols[0])!r}"
        for j, v in enumerate(cols[1 : 1 + self.num_dense]):
            if v and not _INT.fullmatch(v):
                return f"integer column {j + 1} is not an integer: {text(v)!r}"
        for j, v in enumerate(cols[1 + self.num_dense :]):
            if v and not _HEX.fullmatch(v):
                return f"categorical column {j + 1} is not hex (1-16 digits): {text(v)!r}"
        return None
