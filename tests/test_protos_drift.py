"""The checked-in stubs must be exactly what protos/generate.py makes from tether.proto."""

from pathlib import Path

import pytest

from tether.protos import generate

PROTOS = Path(generate.__file__).parent


def test_generated_stubs_match_proto(tmp_path: Path) -> None:
    pytest.importorskip("grpc_tools", reason="grpcio-tools missing: pip install -e '.[test]'")
    written = generate.generate(tmp_path)
    assert {p.name for p in written} == set(generate.GENERATED)
    for path in written:
        checked_in = PROTOS / path.name
        assert checked_in.exists(), f"{path.name} is missing; run python protos/generate.py"
        assert checked_in.read_bytes() == path.read_bytes(), f"{path.name} drifted from tether.proto; run python protos/generate.py"


def test_proto_carries_tensors_as_bytes() -> None:
    lines = (PROTOS / "tether.proto").read_text().splitlines()
    text = "\n".join(line.split("//")[0] for line in lines)
    assert "repeated float" not in text and "repeated double" not in text
    assert "bytes data = 3;" in text
