"""tether.common.allocator: tensors of MiBs stay in the heap instead of being mmap'd per step."""

import subprocess
import sys

import pytest

# Run in a fresh interpreter: the settings are per process and applied once. Prints whether
# they applied, then how many bytes an 8 MiB allocation added to glibc's mmap'd blocks.
_PROBE = """
import ctypes, sys
from tether.common.allocator import tune_malloc
print(tune_malloc())
class Info(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]
libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = Info
before = libc.mallinfo2().hblkhd
block = ctypes.create_string_buffer(8 << 20)
print(libc.mallinfo2().hblkhd - before)
"""


def _probe(env: dict[str, str]) -> tuple[bool, int]:
    out = subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    applied, mmapped = out.stdout.split()
    return applied == "True", int(mmapped)


@pytest.fixture
def glibc() -> None:
    import ctypes

    try:
        ctypes.CDLL("libc.so.6").mallinfo2  # noqa: B018
    except (OSError, AttributeError):
        pytest.skip("needs glibc >= 2.33 (mallinfo2)")


def test_large_blocks_come_from_the_heap(glibc: None) -> None:
    import os

    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "TETHER_MALLOC"}
    applied, mmapped = _probe(env)
    assert applied and mmapped == 0
    # Opted out, glibc's defaults mmap a block this large.
    applied, mmapped = _probe({**env, "TETHER_MALLOC": "default"})
    assert not applied and mmapped >= 8 << 20
    # The user's own glibc settings win.
    applied, _ = _probe({**env, "MALLOC_TRIM_THRESHOLD_": "1000000"})
    assert not applied
