"""Tensors to chunked protobuf frames and back, with every received byte checked before it is used.

A payload is a Manifest (run fingerprint, sender, outer step, and for each tensor its name, shape, wire dtype and
byte size), then Chunks of at most ``chunk_bytes`` of one tensor each with an XXH3-64 checksum of their bytes, then
an End.
The sender converts one chunk at a time to the wire dtype (bf16 by default, fp32 selectable), so it never builds
a second copy of the whole model; the receiver allocates one buffer per declared tensor only after the manifest
has matched what it expects, which is the one extra model-sized buffer an exchange costs.

Frames travel as bytes, not as protobuf objects: chunk frames are written and read by hand in protobuf's own wire
format (so the .proto stays the contract, and any protobuf client interoperates), because the objects' copies of
every chunk's data cost more CPU than the transfer itself. Manifest and end frames use protobuf as usual.

Nothing received is trusted: the fingerprint must be the run's; names, shapes, dtypes and sizes must match the
expected manifest exactly; chunks must arrive in order, inside their tensor, with a matching checksum; the payload must
be complete; values must be finite. Any failure raises :class:`PayloadError` carrying the gRPC status to answer
with and a short reason label for the rejection metric, and nothing is handed to the caller.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import grpc
import numpy as np
import torch
import xxhash

from noloco_node.errors import NolocoError
from noloco_node.rpc import peer_pb2 as pb

MAX_MESSAGE_BYTES = 4 * 2**20  # gRPC message limit on both ends: a chunk plus framing, never a whole model
DEFAULT_CHUNK_BYTES = 2**20
MAX_CHUNK_BYTES = MAX_MESSAGE_BYTES - 64 * 1024

WIRE_DTYPES: dict[str, tuple[int, torch.dtype]] = {
    "bf16": (pb.WIRE_DTYPE_BFLOAT16, torch.bfloat16),
    "fp32": (pb.WIRE_DTYPE_FLOAT32, torch.float32),
}
_TORCH_DTYPE_OF_WIRE = {code: dtype for code, dtype in WIRE_DTYPES.values()}


class PayloadError(NolocoError):
    """A received payload that must not be used: the gRPC status to answer with and a metric label."""

    def __init__(self, code: grpc.StatusCode, reason: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.reason = reason
        self.message = message


def _invalid(reason: str, message: str) -> PayloadError:
    return PayloadError(grpc.StatusCode.INVALID_ARGUMENT, reason, message)


@dataclass(frozen=True)
class TensorLayout:
    """A tensor a receiver expects: its name and shape."""

    name: str
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def layout_of(named_tensors: Sequence[tuple[str, torch.Tensor]]) -> list[TensorLayout]:
    return [TensorLayout(name, tuple(tensor.shape)) for name, tensor in named_tensors]


# ---------------------------------------------------------------------------------------------------- sending


def build_manifest(
    named_tensors: Sequence[tuple[str, torch.Tensor]],
    *,
    wire_dtype: str,
    run_fingerprint: str,
    peer_id: str,
    outer_step: int,
    metadata_json: str = "",
) -> pb.Manifest:
    code, dtype = WIRE_DTYPES[wire_dtype]
    itemsize = torch.empty((), dtype=dtype).element_size()
    return pb.Manifest(
        run_fingerprint=run_fingerprint,
        peer_id=peer_id,
        outer_step=outer_step,
        metadata_json=metadata_json,
        tensors=[
            pb.TensorSpec(name=name, shape=list(t.shape), dtype=code, num_bytes=t.numel() * itemsize)  # type: ignore[arg-type]
            for name, t in named_tensors
        ],
    )


def chunk_checksum(data: memoryview | bytes) -> int:
    """XXH3-64 of a chunk: catches corruption and reassembly bugs (authenticity is the security layer's job)."""
    return xxhash.xxh3_64_intdigest(data)


def _varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


# Protobuf tags (field number << 3 | wire type) of the fields a chunk frame carries.
_TAG_FRAME_CHUNK = _varint(2 << 3 | 2)
_TAG_CHUNK_INDEX = _varint(1 << 3 | 0)
_TAG_CHUNK_OFFSET = _varint(2 << 3 | 0)
_TAG_CHUNK_DATA = _varint(3 << 3 | 2)
_TAG_CHUNK_CHECKSUM = _varint(4 << 3 | 0)


def encode_chunk_frame(tensor_index: int, offset: int, data: memoryview | bytes, checksum: int) -> bytes:
    """``Frame{chunk: Chunk{...}}`` in protobuf's wire format, built with one copy of ``data``.

    The bytes are exactly a valid serialization of the proto message (any protobuf parser reads them), but building
    a ``pb.Chunk`` and serializing it would copy the data twice more; at model sizes those copies were a third of
    an exchange's CPU time.
    """
    header = b"".join(
        (
            _TAG_CHUNK_INDEX,
            _varint(tensor_index),
            _TAG_CHUNK_OFFSET,
            _varint(offset),
            _TAG_CHUNK_CHECKSUM,
            _varint(checksum),
            _TAG_CHUNK_DATA,
            _varint(len(data)),
        )
    )
    return b"".join((_TAG_FRAME_CHUNK, _varint(len(header) + len(data)), header, data))


def iter_frames(
    manifest: pb.Manifest,
    tensors: Sequence[torch.Tensor],
    *,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    on_chunk: Callable[[int], None] | None = None,
    from_tensor: int = 0,
    from_offset: int = 0,
) -> Iterator[bytes]:
    """The encoded frames of one payload: the manifest, every tensor's chunks in order, the end.

    CPU tensors are converted to the wire dtype one chunk at a time into a small reused staging buffer (no second
    copy of the model, and the converted bytes are still in cache when the checksum and the frame read them). A
    tensor on an accelerator is converted there and copied to the host whole, one tensor at a time. With
    ``from_tensor`` and ``from_offset`` the manifest still lists every tensor but only the bytes from that point on
    are sent (a resumed state download); the end frame counts the bytes actually sent.
    """
    if not 0 < chunk_bytes <= MAX_CHUNK_BYTES or chunk_bytes % 4:
        raise ValueError(f"chunk_bytes must be a multiple of 4 in (0, {MAX_CHUNK_BYTES}], got {chunk_bytes}")
    if len(tensors) != len(manifest.tensors):
        raise ValueError("tensors do not match the manifest")
    yield pb.Frame(manifest=manifest).SerializeToString()
    total = 0
    staging: dict[torch.dtype, torch.Tensor] = {}
    for index, (spec, tensor) in enumerate(zip(manifest.tensors, tensors, strict=True)):
        if index < from_tensor:
            continue
        dtype = _TORCH_DTYPE_OF_WIRE[spec.dtype]
        itemsize = torch.empty((), dtype=dtype).element_size()
        skip = from_offset if index == from_tensor else 0
        if skip % itemsize or (skip and skip >= spec.num_bytes):
            raise ValueError(f"cannot resume tensor {spec.name} at byte {skip}")
        if (size := tensor.numel() * itemsize) != spec.num_bytes:
            raise ValueError(f"tensor {spec.name} has {size} bytes, manifest says {spec.num_bytes}")
        flat = tensor.detach()
        if flat.device.type != "cpu":
            flat = flat.to(dtype=dtype).cpu()
        flat = flat.contiguous().view(-1)
        direct = flat.dtype == dtype  # already in the wire dtype: send straight from its storage
        if direct:
            raw = flat.view(torch.uint8).numpy().data
        else:
            if dtype not in staging:
                staging[dtype] = torch.empty(chunk_bytes // itemsize, dtype=dtype)
            buffer = staging[dtype]
            buffer_bytes = buffer.view(torch.uint8).numpy().data
        step = chunk_bytes // itemsize
        for start in range(skip // itemsize, flat.numel(), step):
            count = min(step, flat.numel() - start)
            if direct:
                data = raw[start * itemsize : (start + count) * itemsize]
            else:
                buffer[:count].copy_(flat[start : start + count])
                data = buffer_bytes[: count * itemsize]
            if on_chunk is not None:
                on_chunk(len(data))
            yield encode_chunk_frame(index, start * itemsize, data, chunk_checksum(data))
        total += spec.num_bytes - skip
    yield pb.Frame(end=pb.End(total_bytes=total)).SerializeToString()


@dataclass(frozen=True)
class ChunkView:
    """A received chunk; ``data`` is a view into the frame's bytes, not a copy."""

    tensor_index: int
    offset: int
    data: memoryview
    checksum: int


def _read_varint(raw: bytes, pos: int, end: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= end or shift > 63:
            raise _invalid("malformed_frame", "a truncated or overlong varint in a frame")
        byte = raw[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7


def _fields(raw: bytes, pos: int, end: int) -> Iterator[tuple[int, int, int, int]]:
    """Protobuf fields in raw[pos:end]: (field number, wire type, value or start, end of a length-delimited one)."""
    while pos < end:
        key, pos = _read_varint(raw, pos, end)
        number, wire_type = key >> 3, key & 7
        if wire_type == 0:
            value, pos = _read_varint(raw, pos, end)
            yield number, wire_type, value, pos
        elif wire_type == 2:
            length, pos = _read_varint(raw, pos, end)
            if pos + length > end:
                raise _invalid("malformed_frame", "a length-delimited field runs past the end of its frame")
            yield number, wire_type, pos, pos + length
            pos += length
        elif wire_type in (1, 5):
            width = 8 if wire_type == 1 else 4
            if pos + width > end:
                raise _invalid("malformed_frame", "a fixed-width field runs past the end of its frame")
            yield number, wire_type, int.from_bytes(raw[pos : pos + width], "little"), pos + width
            pos += width
        else:
            raise _invalid("malformed_frame", f"unsupported protobuf wire type {wire_type}")


def decode_frame(raw: bytes) -> pb.Manifest | ChunkView | pb.End | None:
    """One received frame: a manifest, a chunk (read without copying its data), an end, or None for an empty frame.

    Chunk frames, which carry all the bytes, are read here by hand; the small manifest and end frames go through
    protobuf. Any valid protobuf encoding is accepted (fields in any order, unknown fields skipped); a frame with
    two bodies is refused, since a conforming sender never writes one.
    """
    bodies = [(number, start, stop) for number, wire_type, start, stop in _fields(raw, 0, len(raw)) if wire_type == 2]
    bodies = [body for body in bodies if body[0] in (1, 2, 3)]
    if not bodies:
        return None
    if len(bodies) > 1:
        raise _invalid("malformed_frame", "a frame with more than one body")
    number, start, stop = bodies[0]
    if number != 2:
        try:
            frame = pb.Frame.FromString(raw)
        except Exception as error:  # protobuf's DecodeError; the message says what was wrong
            raise _invalid("malformed_frame", f"a frame protobuf cannot parse: {error}") from None
        return frame.manifest if number == 1 else frame.end
    tensor_index = offset = checksum = 0
    data = memoryview(b"")
    for field, wire_type, value, value_end in _fields(raw, start, stop):
        if field == 1 and wire_type == 0:
            tensor_index = value
        elif field == 2 and wire_type == 0:
            offset = value
        elif field == 3 and wire_type == 2:
            data = memoryview(raw)[value:value_end]
        elif field == 4 and wire_type == 0:
            checksum = value
        elif field in (1, 2, 3, 4):
            raise _invalid("malformed_frame", f"chunk field {field} has wire type {wire_type}")
    return ChunkView(tensor_index, offset, data, checksum)


# ---------------------------------------------------------------------------------------------------- receiving


class ReceiveBuffers:
    """Receive buffers kept from one exchange to the next; thread-safe.

    A fresh payload-sized buffer costs the first touch of every one of its pages: 0.09 s of kernel time for a
    227 MB payload on this machine, a quarter of a loopback exchange, and seconds per outer step at billion-parameter
    sizes. A node exchanges at every outer step, so it keeps the buffers of its last payload (at most
    ``max_idle_bytes``) and reuses them. Buffers come back only through :meth:`Payload.release`, called by whoever
    consumed the payload; a payload never released is garbage-collected as usual.
    """

    def __init__(self, max_idle_bytes: int) -> None:
        self.max_idle_bytes = max_idle_bytes
        self._lock = threading.Lock()
        self._idle: dict[tuple[torch.dtype, int], list[torch.Tensor]] = {}
        self._idle_bytes = 0
        self.reused = 0

    def take(self, dtype: torch.dtype, numel: int) -> torch.Tensor:
        with self._lock:
            free = self._idle.get((dtype, numel))
            if free:
                buffer = free.pop()
                self._idle_bytes -= buffer.nbytes
                self.reused += 1
                return buffer
        return torch.empty(numel, dtype=dtype)

    def give_back(self, buffers: Sequence[torch.Tensor]) -> None:
        with self._lock:
            for buffer in buffers:
                if self._idle_bytes + buffer.nbytes > self.max_idle_bytes:
                    return
                self._idle.setdefault((buffer.dtype, buffer.numel()), []).append(buffer)
                self._idle_bytes += buffer.nbytes


class Payload:
    """A complete, verified payload: the sender's manifest and its tensors in wire dtype, in manifest order."""

    def __init__(
        self,
        manifest: pb.Manifest,
        tensors: dict[str, torch.Tensor],
        *,
        buffers: Sequence[torch.Tensor] = (),
        pool: ReceiveBuffers | None = None,
    ) -> None:
        self.manifest = manifest
        self.tensors = tensors
        self._buffers = list(buffers)
        self._pool = pool

    @property
    def peer_id(self) -> str:
        return self.manifest.peer_id

    @property
    def outer_step(self) -> int:
        return self.manifest.outer_step

    def release(self) -> None:
        """The tensors will not be read again: their buffers may receive the next payload. Idempotent."""
        buffers, self._buffers, self.tensors = self._buffers, [], {}
        if self._pool is not None and buffers:
            self._pool.give_back(buffers)


class PayloadReceiver:
    """Assembles one peer's payload from frames, checking each one; :meth:`finish` returns it only if all is well.

    ``expected`` is the exact list of tensors this receiver accepts, in order; ``max_total_bytes`` caps the whole
    payload before anything is allocated.
    """

    def __init__(
        self,
        expected: Sequence[TensorLayout],
        *,
        run_fingerprint: str,
        max_total_bytes: int,
        allowed_dtypes: Sequence[str] = ("bf16", "fp32"),
        buffers: ReceiveBuffers | None = None,
        prefilled: Sequence[torch.Tensor] = (),
        prefilled_partial_bytes: int = 0,
    ) -> None:
        self.expected = list(expected)
        self.pool = buffers
        # Leading tensors already received from another sender (a resumed state download), the last one only up
        # to ``prefilled_partial_bytes`` when that is not 0: the manifest must still match all of them, but what
        # arrived is not sent again.
        self.prefilled = list(prefilled)
        self.prefilled_partial_bytes = prefilled_partial_bytes
        self.run_fingerprint = run_fingerprint
        self.max_total_bytes = max_total_bytes
        self.allowed_codes = {WIRE_DTYPES[name][0] for name in allowed_dtypes}
        self.manifest: pb.Manifest | None = None
        self._buffers: list[torch.Tensor] = []
        self._byte_views: list[np.ndarray] = []
        self._itemsizes: list[int] = []
        self._filled: list[int] = []
        self._ended = False
        self.bytes_received = 0

    def feed(self, raw: bytes) -> None:
        """One encoded frame (see :func:`decode_frame`), checked and applied, or PayloadError."""
        body = decode_frame(raw)
        if self._ended:
            raise _invalid("frame_after_end", "a frame arrived after the end of the payload")
        if isinstance(body, ChunkView):
            self._on_chunk(body)
        elif isinstance(body, pb.Manifest):
            self._on_manifest(body)
        elif isinstance(body, pb.End):
            self._on_end(body)
        else:
            raise _invalid("empty_frame", "a frame with no body")

    def _on_manifest(self, manifest: pb.Manifest) -> None:
        if self.manifest is not None:
            raise _invalid("duplicate_manifest", "a second manifest in one payload")
        if manifest.run_fingerprint != self.run_fingerprint:
            raise PayloadError(
                grpc.StatusCode.FAILED_PRECONDITION,
                "wrong_run",
                f"payload is for run {manifest.run_fingerprint!r}, this node trains run {self.run_fingerprint!r}",
            )
        if len(manifest.tensors) != len(self.expected):
            raise _invalid(
                "tensor_count", f"manifest lists {len(manifest.tensors)} tensors, expected {len(self.expected)}"
            )
        total = 0
        for spec, want in zip(manifest.tensors, self.expected, strict=True):
            if spec.name != want.name:
                raise _invalid("tensor_name", f"manifest tensor {spec.name!r} where {want.name!r} was expected")
            if tuple(spec.shape) != want.shape:
                raise _invalid(
                    "tensor_shape", f"tensor {spec.name!r} has shape {list(spec.shape)}, expected {list(want.shape)}"
                )
            if spec.dtype not in self.allowed_codes:
                raise _invalid(
                    "tensor_dtype", f"tensor {spec.name!r} has wire dtype {spec.dtype}, not one of the accepted dtypes"
                )
            itemsize = torch.empty((), dtype=_TORCH_DTYPE_OF_WIRE[spec.dtype]).element_size()
            if spec.num_bytes != want.numel * itemsize:
                raise _invalid(
                    "tensor_size",
                    f"tensor {spec.name!r} declares {spec.num_bytes} bytes, its shape and "
                    f"dtype make {want.numel * itemsize}",
                )
            total += spec.num_bytes
        if total > self.max_total_bytes:
            raise PayloadError(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                "too_large",
                f"payload declares {total} bytes, the limit is {self.max_total_bytes}",
            )
        # Only now, with every size checked, is memory committed: one buffer per tensor, in wire dtype.
        for index, given in enumerate(self.prefilled):
            if given.dtype != _TORCH_DTYPE_OF_WIRE[manifest.tensors[index].dtype]:
                raise _invalid("tensor_dtype", f"tensor {manifest.tensors[index].name!r} changed dtype on resume")
        self._buffers = [
            self.prefilled[index].view(-1)
            if index < len(self.prefilled)
            else self._allocate(_TORCH_DTYPE_OF_WIRE[spec.dtype], want.numel)
            for index, (spec, want) in enumerate(zip(manifest.tensors, self.expected, strict=True))
        ]
        self._byte_views = [buffer.view(torch.uint8).numpy() for buffer in self._buffers]
        self._itemsizes = [buffer.element_size() for buffer in self._buffers]
        self._filled = [
            spec.num_bytes if index < len(self.prefilled) else 0 for index, spec in enumerate(manifest.tensors)
        ]
        if self.prefilled and self.prefilled_partial_bytes:
            self._filled[len(self.prefilled) - 1] = self.prefilled_partial_bytes
        self.manifest = manifest

    def _allocate(self, dtype: torch.dtype, numel: int) -> torch.Tensor:
        return torch.empty(numel, dtype=dtype) if self.pool is None else self.pool.take(dtype, numel)

    def received_so_far(self) -> tuple[list[torch.Tensor], int]:
        """What a resumed download keeps: the leading tensors received (flat, in wire dtype), the last of them only
        in part when the second value (its bytes received) is not 0."""
        if self.manifest is None:
            return list(self.prefilled), self.prefilled_partial_bytes
        kept: list[torch.Tensor] = []
        for buffer, filled, spec in zip(self._buffers, self._filled, self.manifest.tensors, strict=True):
            if filled == spec.num_bytes:
                kept.append(buffer)
                continue
            if filled:
                kept.append(buffer)
                return kept, filled
            break
        return kept, 0

    def discard(self) -> None:
        """The payload will not be finished (refused, cut): its buffers go back to the pool. Idempotent."""
        buffers, self._buffers, self._byte_views = self._buffers, [], []
        if self.pool is not None and buffers:
            self.pool.give_back(buffers)

    def _on_chunk(self, chunk: ChunkView) -> None:
        if self.manifest is None:
            raise _invalid("chunk_before_manifest", "a chunk arrived before the manifest")
        index = chunk.tensor_index
        if index >= len(self._buffers):
            raise _invalid("chunk_index", f"chunk for tensor {index}, the manifest has {len(self._buffers)}")
        spec = self.manifest.tensors[index]
        if chunk.offset != self._filled[index]:
            raise _invalid(
                "chunk_order", f"chunk of {spec.name!r} at offset {chunk.offset}, expected {self._filled[index]}"
            )
        size = len(chunk.data)
        if size == 0 or chunk.offset + size > spec.num_bytes:
            raise _invalid(
                "chunk_bounds",
                f"chunk of {size} bytes at offset {chunk.offset} does not fit tensor "
                f"{spec.name!r} of {spec.num_bytes} bytes",
            )
        if size % self._itemsizes[index]:
            raise _invalid("chunk_alignment", f"chunk of {size} bytes splits a value of tensor {spec.name!r}")
        if chunk_checksum(chunk.data) != chunk.checksum:
            raise _invalid("checksum", f"checksum mismatch in tensor {spec.name!r} at offset {chunk.offset}")
        # One copy, straight from the frame's bytes into the tensor's storage; the finiteness test reads the values
        # while they are still in cache, and refuses a bad payload before the rest of it has to arrive.
        target = self._byte_views[index][chunk.offset : chunk.offset + size]
        target[:] = np.frombuffer(chunk.data, dtype=np.uint8)
        if _has_non_finite(target, self._buffers[index].dtype):
            raise _invalid("not_finite", f"tensor {spec.name!r} holds NaN or infinite values")
        self._filled[index] += size
        self.bytes_received += size

    def _on_end(self, end: pb.End) -> None:
        if self.manifest is None:
            raise _invalid("end_before_manifest", "the payload ended before its manifest")
        for spec, filled in zip(self.manifest.tensors, self._filled, strict=True):
            if filled != spec.num_bytes:
                raise _invalid("incomplete", f"tensor {spec.name!r} ended at {filled} of {spec.num_bytes} bytes")
        if end.total_bytes != self.bytes_received:
            raise _invalid("total_bytes", f"end declares {end.total_bytes} bytes, {self.bytes_received} arrived")
        self._ended = True

    def finish(self) -> Payload:
        """The verified payload (every chunk was checked on arrival); raises PayloadError if it is incomplete."""
        if self.manifest is None or not self._ended:
            raise _invalid("incomplete", "the payload stopped before its end")
        tensors = {
            spec.name: buffer.view(want.shape)
            for spec, want, buffer in zip(self.manifest.tensors, self.expected, self._buffers, strict=True)
        }
        payload = Payload(self.manifest, tensors, buffers=self._buffers, pool=self.pool)
        self._buffers, self._byte_views = [], []  # the payload owns them now
        return payload


# IEEE exponent bits: a value is NaN or infinite exactly when all of them are set.
_EXPONENT_MASKS = {torch.bfloat16: (np.uint16, 0x7F80), torch.float32: (np.uint32, 0x7F800000)}


def _has_non_finite(raw: np.ndarray, dtype: torch.dtype) -> bool:
    """Bit-pattern test on the raw integers of one chunk: the masked exponent reaches the mask exactly when some
    value is NaN or infinite. One pass and one reduction: twice as fast as comparing every element, ten times
    faster than torch.isfinite on bf16."""
    int_type, mask = _EXPONENT_MASKS[dtype]
    return int((raw.view(int_type) & mask).max()) == mask
