"""wire/frames.py and wire/payload.py: payloads survive the round trip, and every kind of bad payload is refused
with a precise status."""

from __future__ import annotations

import grpc
import pytest
import torch

from noloco_node.wire import peer_pb2 as pb
from noloco_node.wire.frames import (
    MAX_CHUNK_BYTES,
    PayloadError,
    PayloadKind,
    build_manifest,
    chunk_checksum,
    encode_chunk_frame,
    iter_frames,
    layout_of,
)
from noloco_node.wire.payload import PayloadReceiver
from noloco_node.wire.receive_buffers import ReceiveBuffers

RUN = "run-abc"


def named(seed: int = 0) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [
        ("theta/a", torch.randn(300, 7, generator=g)),
        ("theta/b", torch.randn(5, generator=g)),
        ("theta/c", torch.randn(2, 3, 4, generator=g)),
    ]


def encoded(
    tensors: list[tuple[str, torch.Tensor]], *, wire_dtype: str = "fp32", chunk_bytes: int = 1000, run: str = RUN
) -> list[bytes]:
    manifest = build_manifest(tensors, wire_dtype=wire_dtype, run_fingerprint=run, peer_id="peer-1", outer_step=4)
    return list(iter_frames(manifest, [t for _, t in tensors], chunk_bytes=chunk_bytes))


def frames(tensors: list[tuple[str, torch.Tensor]], **kwargs: object) -> list[pb.Frame]:
    """The same payload as protobuf objects (parsed by protobuf itself), for tests that tamper with fields."""
    return [pb.Frame.FromString(raw) for raw in encoded(tensors, **kwargs)]


def receiver(tensors: list[tuple[str, torch.Tensor]] | None = None, **kwargs: object) -> PayloadReceiver:
    options = {"run_fingerprint": RUN, "max_total_bytes": 10**8, **kwargs}
    return PayloadReceiver(layout_of(tensors or named()), **options)


def receive(stream: list[pb.Frame] | list[bytes], rx: PayloadReceiver | None = None):
    """Feed a stream; protobuf objects are serialized by protobuf, so both encoders' output is read."""
    rx = rx or receiver()
    for frame in stream:
        rx.feed(frame if isinstance(frame, bytes) else frame.SerializeToString())
    return rx.finish()


def refused(stream: list[pb.Frame] | list[bytes], rx: PayloadReceiver | None = None) -> PayloadError:
    with pytest.raises(PayloadError) as error:
        receive(stream, rx)
    return error.value


def test_fp32_round_trip_is_exact_and_chunked() -> None:
    tensors = named()
    stream = frames(tensors, chunk_bytes=1000)
    chunks = [f.chunk for f in stream if f.WhichOneof("body") == "chunk"]
    assert all(len(c.data) <= 1000 for c in chunks)
    assert len(chunks) == 9 + 1 + 1  # 8400 bytes -> 9 chunks, 20 -> 1, 96 -> 1
    for fed in (stream, encoded(tensors, chunk_bytes=1000)):  # re-encoded by protobuf, and the hand-written bytes
        payload = receive(fed)
        assert payload.peer_id == "peer-1" and payload.outer_step == 4
        for name, tensor in tensors:
            assert torch.equal(payload.tensors[name], tensor)


def test_hand_encoded_chunk_frames_are_the_protos_encoding() -> None:
    """What protobuf parses from our bytes is what we meant, and protobuf's own encoding reads back the same."""
    data = bytes(range(256)) * 3
    raw = encode_chunk_frame(5, 3 * 2**40, data, 2**64 - 1)
    frame = pb.Frame.FromString(raw)
    assert frame.WhichOneof("body") == "chunk"
    assert (frame.chunk.tensor_index, frame.chunk.offset, frame.chunk.data, frame.chunk.checksum) == (
        5,
        3 * 2**40,
        data,
        2**64 - 1,
    )
    assert pb.Frame.FromString(frame.SerializeToString()) == frame


def test_frames_protobuf_would_refuse_are_malformed() -> None:
    stream = encoded(named())
    chunk = stream[1]
    two_bodies = chunk + stream[-1]  # protobuf would merge these; a conforming sender never writes them
    bad_wire_type = bytes([0x12, 2, (3 << 3) | 0, 1])  # a chunk whose data field is a varint
    for frame in (chunk[: len(chunk) // 2], two_bodies, bad_wire_type, b"\x12\xff"):
        error = refused([stream[0], frame])
        assert (error.code, error.reason) == (grpc.StatusCode.INVALID_ARGUMENT, "malformed_frame"), error.message


def test_a_chunk_that_splits_a_value_is_refused() -> None:
    stream = encoded(named())  # fp32: 4 bytes a value
    data = b"\0" * 6
    error = refused([stream[0], encode_chunk_frame(0, 0, data, chunk_checksum(data))])
    assert error.reason == "chunk_alignment"


def test_bf16_is_the_compact_wire_format() -> None:
    tensors = named()
    payload = receive(frames(tensors, wire_dtype="bf16"))
    for name, tensor in tensors:
        assert payload.tensors[name].dtype == torch.bfloat16
        assert torch.equal(payload.tensors[name], tensor.to(torch.bfloat16))
    sizes = lambda s: sum(len(f.chunk.data) for f in s if f.WhichOneof("body") == "chunk")  # noqa: E731
    assert sizes(frames(tensors, wire_dtype="bf16")) * 2 == sizes(frames(tensors, wire_dtype="fp32"))


def test_another_runs_payload_is_a_failed_precondition() -> None:
    error = refused(frames(named(), run="another-run"))
    assert error.code == grpc.StatusCode.FAILED_PRECONDITION and error.reason == "wrong_run"


def manifest_with(mutate) -> list[pb.Frame]:
    stream = frames(named())
    mutate(stream[0].manifest)
    return stream


@pytest.mark.parametrize(
    ("mutate", "reason"),
    [
        (lambda m: setattr(m.tensors[1], "name", "theta/z"), "tensor_name"),
        (lambda m: m.tensors[0].shape.__setitem__(0, 301), "tensor_shape"),
        (lambda m: setattr(m.tensors[2], "num_bytes", 10), "tensor_size"),
        (lambda m: setattr(m.tensors[2], "dtype", pb.WIRE_DTYPE_UNSPECIFIED), "tensor_dtype"),
        (lambda m: m.tensors.pop(), "tensor_count"),
    ],
)
def test_manifests_that_do_not_match_are_invalid(mutate, reason: str) -> None:
    error = refused(manifest_with(mutate))
    assert (error.code, error.reason) == (grpc.StatusCode.INVALID_ARGUMENT, reason)


def test_oversized_payload_is_refused_before_allocation() -> None:
    rx = receiver(max_total_bytes=1000)
    with pytest.raises(PayloadError) as error:
        rx.feed(encoded(named())[0])
    assert error.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert rx._buffers == []  # nothing was allocated


def tamper(index: int, change) -> list[pb.Frame]:
    stream = frames(named())
    change(stream, stream[index])
    return stream


@pytest.mark.parametrize(
    ("stream_fn", "reason"),
    [
        (lambda: frames(named())[1:], "chunk_before_manifest"),
        (lambda: [frames(named())[0], *frames(named())], "duplicate_manifest"),
        (lambda: tamper(1, lambda s, f: setattr(f.chunk, "data", b"x" + f.chunk.data[1:])), "checksum"),
        (lambda: tamper(2, lambda s, f: setattr(f.chunk, "offset", 0)), "chunk_order"),
        (lambda: tamper(1, lambda s, f: setattr(f.chunk, "tensor_index", 9)), "chunk_index"),
        (lambda: [f for i, f in enumerate(frames(named())) if i != 3], "chunk_order"),
        (lambda: [f for i, f in enumerate(frames(named())) if i != 11], "incomplete"),
        (lambda: tamper(-1, lambda s, f: setattr(f.end, "total_bytes", 1)), "total_bytes"),
        (lambda: frames(named())[:-1], "incomplete"),
        (lambda: [*frames(named()), pb.Frame(end=pb.End())], "frame_after_end"),
        (lambda: [frames(named())[0], pb.Frame()], "empty_frame"),
    ],
)
def test_broken_streams_are_invalid(stream_fn, reason: str) -> None:
    error = refused(stream_fn())
    assert (error.code, error.reason) == (grpc.StatusCode.INVALID_ARGUMENT, reason), error.message


def test_a_chunk_that_overflows_its_tensor_is_invalid() -> None:
    stream = frames(named())
    last_b = next(f for f in stream if f.WhichOneof("body") == "chunk" and f.chunk.tensor_index == 1)
    data = last_b.chunk.data + b"\0\0\0\0"
    last_b.chunk.data, last_b.chunk.checksum = data, chunk_checksum(data)
    assert refused(stream).reason == "chunk_bounds"


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_values_are_refused(bad: float) -> None:
    tensors = named()
    tensors[2][1][0, 1, 2] = bad
    error = refused(frames(tensors), receiver(named()))
    assert (error.code, error.reason) == (grpc.StatusCode.INVALID_ARGUMENT, "not_finite")


def test_sender_refuses_impossible_chunk_sizes() -> None:
    manifest = build_manifest(named(), wire_dtype="fp32", run_fingerprint=RUN, peer_id="p", outer_step=0)
    with pytest.raises(ValueError):
        list(iter_frames(manifest, [t for _, t in named()], chunk_bytes=MAX_CHUNK_BYTES + 4))
    with pytest.raises(ValueError):
        list(iter_frames(manifest, [t for _, t in named()], chunk_bytes=1001))  # would split values


def test_released_buffers_take_the_next_payload_and_live_ones_are_never_shared() -> None:
    pool = ReceiveBuffers(max_idle_bytes=10**6)
    first = receive(encoded(named(1)), receiver(buffers=pool))
    second = receive(encoded(named(2)), receiver(buffers=pool))  # the first is still held: fresh buffers
    pointers = lambda p: {t.untyped_storage().data_ptr() for t in p.tensors.values()}  # noqa: E731
    first_pointers = pointers(first)
    assert not first_pointers & pointers(second) and pool.reused == 0
    first.release()
    third = receive(encoded(named(3)), receiver(buffers=pool))
    assert pointers(third) == first_pointers and pool.reused == 3
    for name, tensor in named(3):
        assert torch.equal(third.tensors[name], tensor)
    assert torch.equal(second.tensors["theta/a"], named(2)[0][1])  # untouched by the reuse


def test_a_refused_payload_gives_its_buffers_back_and_the_pool_is_bounded() -> None:
    pool = ReceiveBuffers(max_idle_bytes=8400)  # room for tensor a (8400 bytes in fp32) only
    rx = receiver(buffers=pool)
    stream = tamper(1, lambda s, f: setattr(f.chunk, "checksum", f.chunk.checksum ^ 1))
    with pytest.raises(PayloadError):
        for frame in stream:
            rx.feed(frame.SerializeToString())
    rx.discard()
    assert receive(encoded(named()), receiver(buffers=pool)) is not None and pool.reused == 1


def test_a_payload_of_another_configuration_is_refused_as_such_before_any_buffer() -> None:
    """A peer with --blend-momenta (theta, phi, delta) and one without (theta): a precondition, named, not
    "malformed"; tensors merely missing or extra within the run's own parts stay INVALID_ARGUMENT."""
    theta = named()
    with_momenta = theta + [(f"{part}/{n.split('/')[1]}", t) for part in ("phi", "delta") for n, t in theta]
    error = refused(encoded(with_momenta))
    assert (error.code, error.reason) == (grpc.StatusCode.FAILED_PRECONDITION, "payload_layout")
    assert "theta+phi+delta" in error.message and "exchanges theta " in error.message
    error = refused(encoded(theta), receiver(with_momenta))
    assert (error.code, error.reason) == (grpc.StatusCode.FAILED_PRECONDITION, "payload_layout")
    error = refused(encoded(theta[:2]))
    assert (error.code, error.reason) == (grpc.StatusCode.INVALID_ARGUMENT, "tensor_count")


def test_a_stream_receiver_picks_the_kind_by_the_payloads_parts_and_each_kind_keeps_its_wire_dtype() -> None:
    """A stream run accepts two kinds: phase (phi, bf16) and progress (Delta, the wire dtype). Each is received as
    what it is; a phase payload in int8, or a sync node's theta payload, is refused as another configuration's."""
    theta = named()
    phi = [(f"phi/{n.split('/')[1]}", t) for n, t in theta]
    progress = [(f"progress/{n.split('/')[1]}", t / 100) for n, t in theta]
    kinds = [
        PayloadKind("phase", tuple(layout_of(phi)), "bf16"),
        PayloadKind("progress", tuple(layout_of(progress)), "int8"),
    ]

    def stream_receiver() -> PayloadReceiver:
        return PayloadReceiver((), kinds=kinds, run_fingerprint=RUN, max_total_bytes=10**8)

    rx = stream_receiver()
    got = receive(encoded(phi, wire_dtype="bf16"), rx)
    assert rx.kind is kinds[0] and got.parts == ["phi"]
    assert torch.equal(got.tensors["phi/a"], phi[0][1].to(torch.bfloat16))
    rx = stream_receiver()
    got = receive(encoded(progress, wire_dtype="int8"), rx)
    assert rx.kind is kinds[1] and got.parts == ["progress"] and got.tensors["progress/a"].dtype == torch.float32
    error = refused(encoded(phi, wire_dtype="int8"), stream_receiver())
    assert (error.code, error.reason) == (grpc.StatusCode.FAILED_PRECONDITION, "wire_dtype")
    error = refused(encoded(progress, wire_dtype="bf16"), stream_receiver())
    assert (error.code, error.reason) == (grpc.StatusCode.FAILED_PRECONDITION, "wire_dtype")
    error = refused(encoded(theta, wire_dtype="int8"), stream_receiver())
    assert (error.code, error.reason) == (grpc.StatusCode.FAILED_PRECONDITION, "payload_layout")
    assert "exchanges phi or progress" in error.message and "--mode" in error.message
