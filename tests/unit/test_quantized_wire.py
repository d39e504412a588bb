"""The int8 and int4 wire dtypes (wire/quantize.py): the codec's error bound, the round trip through frames, and
every kind of malformed quantized payload refused with a precise status before it is used."""

from __future__ import annotations

import math
import struct

import grpc
import pytest
import torch

from noloco_node.wire import peer_pb2 as pb
from noloco_node.wire import quantize
from noloco_node.wire.frames import (
    PayloadError,
    build_manifest,
    chunk_checksum,
    decode_frame,
    encode_chunk_frame,
    iter_frames,
    layout_of,
    wire_num_bytes,
)
from noloco_node.wire.payload import PayloadReceiver
from noloco_node.wire.published import BufferPool
from noloco_node.wire.receive_buffers import ReceiveBuffers

RUN = "run-q"


def named(seed: int = 0) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [
        ("theta/a", torch.randn(300, 7, generator=g) * 0.02),  # 2100 values: 9 blocks, the last one short
        ("theta/b", torch.randn(5, generator=g)),  # an odd count: int4's last byte holds one value
        ("theta/c", torch.zeros(2, 256)),  # all-zero blocks: scale 0
    ]


def encoded(tensors: list[tuple[str, torch.Tensor]], wire_dtype: str, chunk_bytes: int = 400) -> list[bytes]:
    manifest = build_manifest(tensors, wire_dtype=wire_dtype, run_fingerprint=RUN, peer_id="peer-1", outer_step=3)
    return list(iter_frames(manifest, [t for _, t in tensors], chunk_bytes=chunk_bytes))


def receiver(wire_dtype: str, pool: ReceiveBuffers | None = None) -> PayloadReceiver:
    return PayloadReceiver(
        layout_of(named()), run_fingerprint=RUN, max_total_bytes=10**8, allowed_dtypes=(wire_dtype,), buffers=pool
    )


def refusal(stream: list[bytes], wire_dtype: str) -> PayloadError:
    rx = receiver(wire_dtype)
    with pytest.raises(PayloadError) as error:
        for raw in stream:
            rx.feed(raw)
        rx.finish()
    return error.value


def retouched(raw: bytes, change) -> bytes:
    """A chunk frame with its data changed by ``change(bytearray)`` and a correct checksum (so only the content
    is wrong, as a sender of malformed values would make it)."""
    chunk = decode_frame(raw)
    data = bytearray(chunk.data)
    change(data)
    return encode_chunk_frame(chunk.tensor_index, chunk.offset, bytes(data), chunk_checksum(bytes(data)))


@pytest.mark.parametrize("wire_dtype", ["int8", "int4"])
@pytest.mark.parametrize("numel", [1, 255, 256, 257, 1001])
def test_each_value_is_within_half_a_step_of_its_block_scale(wire_dtype: str, numel: int) -> None:
    values = torch.randn(numel, generator=torch.Generator().manual_seed(numel)) * 3
    encoded_bytes = quantize.quantize(values, wire_dtype)
    assert encoded_bytes.numel() == quantize.encoded_bytes(numel, wire_dtype)
    decoded = quantize.dequantize(encoded_bytes, numel, wire_dtype)
    scales = quantize.scales_of(encoded_bytes, numel).repeat_interleave(quantize.BLOCK)[:numel]
    assert bool(((decoded - values).abs() <= scales / 2 * (1 + 1e-6)).all())
    # Each block's largest value is exact up to fp32 rounding: it defines the scale.
    assert not quantize.bad_codes(encoded_bytes[4 * quantize.num_blocks(numel) :], wire_dtype)


def test_bytes_on_the_wire() -> None:
    numel = 1000  # 4 blocks
    assert wire_num_bytes(numel, "int8") == 16 + 1000
    assert wire_num_bytes(numel, "int4") == 16 + 500
    assert wire_num_bytes(numel, "bf16") == 2000 and wire_num_bytes(numel, "fp32") == 4000


@pytest.mark.parametrize("wire_dtype", ["int8", "int4"])
def test_round_trip_through_frames_decodes_to_fp32(wire_dtype: str) -> None:
    tensors = named()
    pool = ReceiveBuffers(max_idle_bytes=10**7)
    rx = receiver(wire_dtype, pool)
    for raw in encoded(tensors, wire_dtype):
        rx.feed(raw)
    payload = rx.finish()
    for name, tensor in tensors:
        got = payload.tensors[name]
        assert got.dtype == torch.float32 and got.shape == tensor.shape
        expected = quantize.dequantize(quantize.quantize(tensor, wire_dtype), tensor.numel(), wire_dtype)
        assert torch.equal(got.reshape(-1), expected)
    assert torch.equal(payload.tensors["theta/c"], torch.zeros(2, 256))
    payload.release()
    assert pool._idle  # the wire bytes and the decoded values both go back to the pool


def test_a_published_offer_is_encoded_once_and_streamed_as_is() -> None:
    tensors = named()
    pool = BufferPool(
        [(quantize.encoded_bytes(t.numel(), "int4"),) for _, t in tensors],
        torch.uint8,
        encode=lambda buffer, source: quantize.quantize_into(source, "int4", buffer),
    )
    manifest = build_manifest(tensors, wire_dtype="int4", run_fingerprint=RUN, peer_id="peer-1", outer_step=3)
    published = pool.publish([t for _, t in tensors], manifest=manifest)
    from_copy = list(iter_frames(manifest, published.tensors, chunk_bytes=400))
    assert from_copy == encoded(tensors, "int4")  # the same bytes as encoding the values while streaming


def test_a_payload_in_another_wire_dtype_is_a_failed_precondition() -> None:
    error = refusal(encoded(named(), "bf16"), "int8")
    assert error.code == grpc.StatusCode.FAILED_PRECONDITION and error.reason == "wire_dtype"
    assert "bf16" in error.message and "int8" in error.message
    error = refusal(encoded(named(), "int4"), "int8")
    assert error.code == grpc.StatusCode.FAILED_PRECONDITION and error.reason == "wire_dtype"


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -1.0])
@pytest.mark.parametrize("wire_dtype", ["int8", "int4"])
def test_bad_scales_are_refused_on_arrival(bad: float, wire_dtype: str) -> None:
    stream = encoded(named(), wire_dtype)
    stream[1] = retouched(stream[1], lambda data: data.__setitem__(slice(8, 12), struct.pack("<f", bad)))
    error = refusal(stream, wire_dtype)
    assert error.code == grpc.StatusCode.INVALID_ARGUMENT and error.reason == "bad_scales"


@pytest.mark.parametrize(("wire_dtype", "byte"), [("int8", 0x80), ("int4", 0x08), ("int4", 0x80)])
def test_codes_outside_the_encoders_range_are_refused(wire_dtype: str, byte: int) -> None:
    stream = encoded(named(), wire_dtype)
    scale_bytes = 4 * quantize.num_blocks(2100)  # 36: the first chunk (400 bytes) holds codes after them
    stream[1] = retouched(stream[1], lambda data: data.__setitem__(scale_bytes + 5, byte))
    error = refusal(stream, wire_dtype)
    assert error.code == grpc.StatusCode.INVALID_ARGUMENT and error.reason == "bad_codes"


@pytest.mark.parametrize("change", [-4, 4, 1])
def test_a_wrong_block_count_is_refused_before_allocation(change: int) -> None:
    stream = encoded(named(), "int8")
    frame = pb.Frame.FromString(stream[0])
    frame.manifest.tensors[0].num_bytes += change  # one scale fewer or more, or a byte too many
    error = refusal([frame.SerializeToString(), *stream[1:]], "int8")
    assert error.code == grpc.StatusCode.INVALID_ARGUMENT and error.reason == "tensor_size"


def test_a_chunk_that_splits_a_scale_is_refused() -> None:
    manifest = build_manifest(named(), wire_dtype="int8", run_fingerprint=RUN, peer_id="peer-1", outer_step=3)
    data = quantize.quantize(named()[0][1], "int8").numpy().tobytes()
    rx = receiver("int8")
    rx.feed(pb.Frame(manifest=manifest).SerializeToString())
    rx.feed(encode_chunk_frame(0, 0, data[:8], chunk_checksum(data[:8])))  # two whole scales: fine
    with pytest.raises(PayloadError) as error:
        rx.feed(encode_chunk_frame(0, 8, data[8:14], chunk_checksum(data[8:14])))  # one and a half
    assert error.value.reason == "chunk_alignment"


def test_quantized_bytes_are_a_quarter_to_a_half_of_bf16() -> None:
    layout = layout_of(named())
    bf16 = sum(wire_num_bytes(t.numel, "bf16") for t in layout)
    for wire_dtype, ratio in (("int8", 0.5), ("int4", 0.25)):
        size = sum(wire_num_bytes(t.numel, wire_dtype) for t in layout)
        assert ratio < size / bf16 < ratio + 8 / quantize.BLOCK * 2 + 0.01, (wire_dtype, size / bf16)
    assert math.isclose(quantize.encoded_bytes(2**20, "int4") / (2 * 2**20), 0.25 + 4 / (2 * 256))
