"""Regenerate the protobuf and gRPC stubs from ``tether.proto``.

Run ``python protos/generate.py`` after editing the ``.proto``; never edit the stubs by hand.
``tests/test_protos_drift.py`` fails when the checked-in stubs differ from what this makes.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

__all__ = ["generate", "main"]

PROTO_DIR = Path(__file__).resolve().parent
PROTO_NAME = "tether.proto"
GENERATED = ("tether_pb2.py", "tether_pb2.pyi", "tether_pb2_grpc.py")


def generate(out_dir: Path) -> list[Path]:
    """Compile ``tether.proto`` into ``out_dir`` and return the generated files.

    The proto is staged under ``tether/protos/`` so the generated gRPC module imports its
    messages as ``tether.protos.tether_pb2``.

    Raises:
        RuntimeError: if grpcio-tools is missing or protoc fails.
    """
    try:
        from grpc_tools import protoc
    except ImportError as exc:
        raise RuntimeError("grpcio-tools is needed: pip install -e '.[test]'") from exc
    with tempfile.TemporaryDirectory() as tmp:
        staged = Path(tmp) / "tether" / "protos"
        staged.mkdir(parents=True)
        shutil.copy(PROTO_DIR / PROTO_NAME, staged / PROTO_NAME)
        include = Path(protoc.__file__).parent / "_proto"
        rc = protoc.main([
            "protoc",
            f"-I{tmp}",
            f"-I{include}",
            f"--python_out={tmp}",
            f"--pyi_out={tmp}",
            f"--grpc_python_out={tmp}",
            str(staged / PROTO_NAME),
        ])
        if rc != 0:
            raise RuntimeError(f"protoc failed with exit code {rc}")
        out_dir.mkdir(parents=True, exist_ok=True)
        written = []
        for name in GENERATED:
            target = out_dir / name
            shutil.copy(staged / name, target)
            written.append(target)
        return written


def main() -> int:
    for path in generate(PROTO_DIR):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
