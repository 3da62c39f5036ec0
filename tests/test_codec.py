import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from tether.protos import tether_pb2 as pb
from tether.protos.codec import CodecError, decode_ids, decode_tensor, encode_ids, encode_tensor
from tether.protos.errors import InvalidArgument


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.int64])
def test_round_trip(dtype: torch.dtype) -> None:
    t = (torch.arange(24, dtype=torch.float32).view(2, 3, 4) - 7).to(dtype)
    back = decode_tensor(encode_tensor(t))
    assert back.dtype == dtype and back.shape == t.shape
    assert torch.equal(back, t)


def test_wire_cast_and_upcast() -> None:
    t = torch.tensor([1.5, -2.25, 3.0])
    msg = encode_tensor(t, dtype=torch.bfloat16)
    assert msg.dtype == pb.BFLOAT16 and len(msg.data) == 6
    assert torch.equal(decode_tensor(msg, torch.float32), t)


def test_decode_is_zero_copy() -> None:
    msg = encode_tensor(torch.ones(1000))
    t = decode_tensor(msg)
    assert t.numpy().base is not None or not t.numpy().flags.owndata


# A fresh process's first decode of a message read off the wire (gRPC: a parsed message whose
# bytes field is immutable), with every warning recorded.
_FIRST_DECODE = textwrap.dedent("""
    import warnings
    import torch
    filters = list(warnings.filters)
    from tether.protos import tether_pb2 as pb
    from tether.protos.codec import decode_tensor, encode_tensor
    assert warnings.filters == filters  # no process-wide filter: a user's own warnings still show

    values = torch.arange(12.0).view(3, 4) - 5.5
    wire = pb.Tensor.FromString(encode_tensor(values, dtype=torch.bfloat16).SerializeToString())
    plain = pb.Tensor.FromString(encode_tensor(values).SerializeToString())
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        got, up = decode_tensor(plain), decode_tensor(wire, torch.float32)
    assert torch.equal(got, values) and torch.equal(up, values), (got, up)
    print(len(seen), [str(w.message)[:60] for w in seen])
""")


def test_a_processes_first_grpc_decode_warns_nothing() -> None:
    """Decoded tensors are read-only views (zero copy); torch's one warning about that, which every
    worker printed at its first gRPC decode, is not given, and the values are right."""
    done = subprocess.run([sys.executable, "-c", _FIRST_DECODE], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "0 []"
    assert "not writable" not in done.stderr


def test_decoding_warns_nothing(recwarn: pytest.WarningsRecorder) -> None:
    t = decode_tensor(pb.Tensor.FromString(encode_tensor(torch.ones(2, 2)).SerializeToString()))
    assert torch.equal(t, torch.ones(2, 2))
    assert [str(w.message) for w in recwarn] == []


def test_payload_length_mismatch() -> None:
    msg = pb.Tensor(dtype=pb.FLOAT32, shape=[2, 3], data=b"\0" * 20)
    with pytest.raises(CodecError, match="20 bytes but shape"):
        decode_tensor(msg)
    assert issubclass(CodecError, InvalidArgument)


def test_bad_dtype_and_shape() -> None:
    with pytest.raises(CodecError, match="unsupported wire dtype"):
        decode_tensor(pb.Tensor(dtype=pb.DTYPE_UNSPECIFIED, shape=[1], data=b"\0" * 4))
    with pytest.raises(CodecError, match="negative"):
        decode_tensor(pb.Tensor(dtype=pb.FLOAT32, shape=[-1, 2], data=b""))
    with pytest.raises(CodecError, match="cannot be sent"):
        encode_tensor(torch.ones(2, dtype=torch.float64))
    with pytest.raises(CodecError, match=r"expected a torch.float32"):
        decode_tensor(encode_tensor(torch.ones(2, dtype=torch.int64)), torch.float32)


def test_ids() -> None:
    ids = np.array([0, 5, 2**62], dtype=np.int64)
    assert np.array_equal(decode_ids(encode_ids(ids)), ids)
    assert np.array_equal(decode_ids(encode_ids(torch.from_numpy(ids))), ids)
    with pytest.raises(CodecError, match="whole number"):
        decode_ids(b"\0" * 7)


@pytest.mark.parametrize("wire", [None, torch.bfloat16])
def test_payload_rows_are_gathered_when_written(wire: torch.dtype | None) -> None:
    from tether.protos import framing as dp

    source = torch.arange(40, dtype=torch.float32).view(10, 4)
    index = torch.tensor([7, 0, 3])
    out = dp.PayloadWriter()
    first, second = pb.Tensor(), pb.Tensor()
    out.add(torch.ones(2), first)
    out.add(source, second, dtype=wire, rows=index)
    assert list(second.shape) == [3, 4] and second.payload_offset == dp.ALIGN
    expect = source.index_select(0, index)
    # Into a region (the shared-memory path) and as socket buffers: the same bytes.
    region = bytearray(out.nbytes)
    out.copy_into(memoryview(region))
    sent = b"".join(out.buffers())
    for payload in (memoryview(region), memoryview(sent)):
        got = decode_tensor(second, torch.float32, payload)
        assert torch.equal(got, expect if wire is None else expect.to(wire).float())
        assert torch.equal(decode_tensor(first, None, payload), torch.ones(2))
