"""The committed gRPC stubs are exactly what proto/noloco/v1 generates: they cannot drift from the .proto files."""

from __future__ import annotations

from noloco_node.wire import generate


def test_committed_stubs_match_the_proto_files() -> None:
    generated = generate.generate()
    assert set(generated) == {"peer_pb2.py", "peer_pb2.pyi", "peer_pb2_grpc.py"}
    for name, content in generated.items():
        committed = (generate.PACKAGE_DIR / name).read_text()
        assert committed == content, f"{name} is out of date: run python -m noloco_node.wire.generate"
