"""Tensor <-> wire codec: raw little-endian bytes in a protobuf ``bytes`` field.

Decoding never loops over elements: the payload is viewed with ``numpy.frombuffer`` and
handed to torch without a copy (the view is read-only, so callers that keep or mutate the
result copy it themselves). None writes into one: the worker copies pulled values into its own
tensors (``Router.place_pull``), a shard's update rules read gradients and write only their
rows and state, and a dense chunk clones its initial value.
"""

from __future__ import annotations

import warnings

import numpy as np
import torch

from tether.protos import tether_pb2 as pb
from tether.protos.errors import InvalidArgument
from tether.protos.names import WIRE_DTYPE_NAMES

__all__ = [
    "MAX_DIMS",
    "MAX_DIM_SIZE",
    "WIRE_DTYPES",
    "CodecError",
    "decode_ids",
    "decode_tensor",
    "encode_ids",
    "encode_tensor",
    "int64_ids",
    "is_id_dtype",
    "torch_dtype",
    "wire_dtype",
]


# Nothing tether sends has more dims (rows x dim at most), or dims anywhere near this size.
MAX_DIMS = 8
MAX_DIM_SIZE = 1 << 40


class CodecError(InvalidArgument):
    """A payload that cannot be decoded as the tensor it claims to be."""


_TO_TORCH: dict[int, torch.dtype] = {
    pb.FLOAT32: torch.float32,
    pb.FLOAT16: torch.float16,
    pb.BFLOAT16: torch.bfloat16,
    pb.INT64: torch.int64,
}
_FROM_TORCH = {v: k for k, v in _TO_TORCH.items()}
# The element types parameters and gradients may travel in, by the name flags and configs use
# (declared without torch in tether.protos.names: each is torch's dtype of that name).
WIRE_DTYPES: dict[str, torch.dtype] = {name: getattr(torch, name) for name in WIRE_DTYPE_NAMES}
# bfloat16 has no numpy dtype: carry its bits as int16 and reinterpret in torch.
_NUMPY_VIEW: dict[int, np.dtype] = {
    pb.FLOAT32: np.dtype("<f4"),
    pb.FLOAT16: np.dtype("<f2"),
    pb.BFLOAT16: np.dtype("<i2"),
    pb.INT64: np.dtype("<i8"),
}


_READONLY_WARNING = "The given NumPy array is not writable"


def _spend_readonly_warning() -> None:
    """torch warns the first time a process wraps a read-only array, and never again (its
    ``TORCH_WARN_ONCE``). Decoded tensors are read-only views of the message (zero copy, by
    design; nothing writes into one), so that first time was every process's first decode (a
    user script's worker, a restarted shard) on the gRPC path. It is spent here, at import,
    with the warning ignored for that one call only: no filter is left behind."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_READONLY_WARNING, category=UserWarning)
        torch.from_numpy(np.frombuffer(bytes(4), dtype=np.float32))


_spend_readonly_warning()


def torch_dtype(dtype: int) -> torch.dtype:
    """Torch dtype of a wire ``DType`` value.

    Raises:
        CodecError: for an unknown or unspecified dtype.
    """
    try:
        return _TO_TORCH[dtype]
    except KeyError:
        raise CodecError(f"unsupported wire dtype {dtype!r}") from None


def wire_dtype(dtype: torch.dtype) -> int:
    """Wire ``DType`` value of a torch dtype.

    Raises:
        CodecError: for a dtype the wire cannot carry.
    """
    try:
        return _FROM_TORCH[dtype]
    except KeyError:
        raise CodecError(f"dtype {dtype} cannot be sent; use float32, float16, bfloat16 or int64") from None


def encode_tensor(t: torch.Tensor, out: pb.Tensor | None = None, dtype: torch.dtype | None = None) -> pb.Tensor:
    """Write ``t`` (on any device) into a ``Tensor`` message, optionally cast to ``dtype``."""
    msg = pb.Tensor() if out is None else out
    if dtype is not None and t.dtype != dtype:
        t = t.to(dtype)
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()
    msg.dtype = wire_dtype(t.dtype)
    msg.shape[:] = t.shape
    if t.dtype == torch.bfloat16:
        t = t.view(torch.int16)
    msg.data = t.numpy().tobytes()
    return msg


def decode_tensor(msg: pb.Tensor, expect_dtype: torch.dtype | None = None, payload: memoryview | None = None) -> torch.Tensor:
    """View a ``Tensor`` message as a torch tensor without copying its payload.

    Args:
        msg: the message.
        expect_dtype: if given, a float payload of another float dtype is upcast to it.
        payload: the data plane's out-of-band bytes that ``payload_offset``/``payload_bytes`` point into.

    Raises:
        CodecError: unknown dtype, negative dims, or a payload whose length does not match
            the shape.
    """
    torch_dt = torch_dtype(msg.dtype)
    np_dt = _NUMPY_VIEW[msg.dtype]
    shape = tuple(msg.shape)
    if len(shape) > MAX_DIMS:
        raise CodecError(f"tensor has {len(shape)} dimensions; at most {MAX_DIMS} are accepted")
    # One pass over the dims (this runs for every block of every call).
    numel = 1
    for d in shape:
        if d < 0:
            raise CodecError(f"tensor shape {shape} has a negative dimension")
        # A zero-size tensor can claim any dims; torch refuses sizes whose product overflows int64.
        if d > MAX_DIM_SIZE:
            raise CodecError(f"tensor shape {shape} has a dimension over {MAX_DIM_SIZE}")
        numel *= d
    if msg.payload_bytes:
        data = _out_of_band(msg, payload, np_dt.itemsize)
    else:
        # Each read of a bytes field builds a new bytes object (a copy): read it once.
        data = msg.data
    if numel * np_dt.itemsize != len(data):
        raise CodecError(
            f"tensor payload is {len(data)} bytes but shape {shape} of {torch_dt} needs {numel * np_dt.itemsize}"
        )
    arr = np.frombuffer(data, dtype=np_dt) if numel else np.empty(0, dtype=np_dt)
    t = torch.from_numpy(arr)
    if msg.dtype == pb.BFLOAT16:
        t = t.view(torch.bfloat16)
    if len(shape) != 1:  # the flat view is already the 1-D tensor
        try:
            t = t.reshape(shape)
        except RuntimeError as exc:  # e.g. zero-size dims whose running product overflows
            raise CodecError(f"tensor shape {shape} cannot be built: {exc}") from exc
    if expect_dtype is not None and t.dtype != expect_dtype:
        if not (t.is_floating_point() and expect_dtype.is_floating_point):
            raise CodecError(f"expected a {expect_dtype} tensor, got {t.dtype}")
        t = t.to(expect_dtype)
    return t


def _out_of_band(msg: pb.Tensor, payload: memoryview | None, itemsize: int) -> memoryview:
    if payload is None:
        raise CodecError("tensor names an out-of-band payload, which only the data plane carries")
    start, n = msg.payload_offset, msg.payload_bytes
    if start + n > len(payload):
        raise CodecError(f"tensor payload [{start}, {start + n}) runs past the {len(payload)} bytes sent")
    if start % itemsize:
        raise CodecError(f"tensor payload offset {start} is not a multiple of its element size {itemsize}")
    return payload[start : start + n]


# Tensors that may carry ids: every integer dtype this torch has (bool is not an integer here).
_ID_DTYPES = frozenset(
    d for d in (getattr(torch, n, None) for n in ("uint8", "int8", "int16", "int32", "int64", "uint16", "uint32", "uint64"))
    if isinstance(d, torch.dtype)
)


def is_id_dtype(dtype: torch.dtype) -> bool:
    """Whether tensors of ``dtype`` may carry ids: integers of any width, not bool or floats."""
    return dtype in _ID_DTYPES


def int64_ids(ids: torch.Tensor, table: str, error: type[Exception] = InvalidArgument) -> torch.Tensor:
    """``ids`` as int64: integer ids of any width are widened (``ids`` itself when int64).

    uint64 ids keep their 64 bits (read as int64), so distinct ids stay distinct.

    Raises:
        error: float, bool or complex ids (one line naming the table and the dtype).
    """
    if ids.dtype == torch.int64:
        return ids
    if ids.dtype not in _ID_DTYPES:
        raise error(f"table {table!r}: ids must be integers, got a {ids.dtype} tensor")
    if ids.dtype == getattr(torch, "uint64", None):
        return ids.view(torch.int64)
    return ids.to(torch.int64)


def encode_ids(ids: torch.Tensor | np.ndarray) -> bytes:
    """Raw little-endian int64 bytes of a 1-D id array."""
    if isinstance(ids, torch.Tensor):
        ids = ids.detach().cpu().numpy()
    return np.ascontiguousarray(ids, dtype="<i8").tobytes()


def decode_ids(data: bytes) -> np.ndarray:
    """View raw id bytes as a read-only int64 array (no copy).

    Raises:
        CodecError: if the length is not a multiple of 8.
    """
    if len(data) % 8:
        raise CodecError(f"id payload of {len(data)} bytes is not a whole number of int64 ids")
    return np.frombuffer(data, dtype="<i8")
