"""Tensors to chunked protobuf frames and back, with every received byte checked before it is used.

A payload is a Manifest (run fingerprint, sender, outer step, and for each tensor its name, shape, wire dtype and
byte size), then Chunks of at most ``chunk_bytes`` of one tensor each with a CRC-32 of their bytes, then an End.
The sender converts one tensor at a time to the wire dtype (bf16 by default, fp32 selectable), so it never builds
a second copy of the whole model; the receiver allocates one buffer per declared tensor only after the manifest
has matched what it expects, which is the one extra model-sized buffer an exchange costs.

Nothing received is trusted: the fingerprint must be the run's; names, shapes, dtypes and sizes must match the
expected manifest exactly; chunks must arrive in order, inside their tensor, with a matching CRC; the payload must
be complete; values must be finite. Any failure raises :class:`PayloadError` carrying the gRPC status to answer
with and a short reason label for the rejection metric, and nothing is handed to the caller.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import grpc
import numpy as np
import torch

from noloco_node.rpc import peer_pb2 as pb

MAX_MESSAGE_BYTES = 4 * 2**20  # gRPC message limit on both ends: a chunk plus framing, never a whole model
DEFAULT_CHUNK_BYTES = 2**20
MAX_CHUNK_BYTES = MAX_MESSAGE_BYTES - 64 * 1024

WIRE_DTYPES: dict[str, tuple[int, torch.dtype]] = {
    "bf16": (pb.WIRE_DTYPE_BFLOAT16, torch.bfloat16),
    "fp32": (pb.WIRE_DTYPE_FLOAT32, torch.float32),
}
_TORCH_DTYPE_OF_WIRE = {code: dtype for code, dtype in WIRE_DTYPES.values()}


class PayloadError(Exception):
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
            pb.TensorSpec(name=name, shape=list(t.shape), dtype=code, num_bytes=t.numel() * itemsize)
            for name, t in named_tensors
        ],
    )


def iter_frames(
    manifest: pb.Manifest,
    tensors: Sequence[torch.Tensor],
    *,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    on_chunk: Callable[[int], None] | None = None,
) -> Iterator[pb.Frame]:
    """The frames of one payload: the manifest, every tensor's chunks in order, the end.

    Each tensor is converted to its wire dtype on the CPU just before it is sent, so at most one tensor's wire copy
    exists at a time on the sending side.
    """
    if not 0 < chunk_bytes <= MAX_CHUNK_BYTES:
        raise ValueError(f"chunk_bytes must be in (0, {MAX_CHUNK_BYTES}], got {chunk_bytes}")
    if len(tensors) != len(manifest.tensors):
        raise ValueError("tensors do not match the manifest")
    yield pb.Frame(manifest=manifest)
    total = 0
    for index, (spec, tensor) in enumerate(zip(manifest.tensors, tensors, strict=True)):
        wire = tensor.detach().to(device="cpu", dtype=_TORCH_DTYPE_OF_WIRE[spec.dtype]).contiguous()
        raw = memoryview(wire.view(-1).view(torch.uint8).numpy())
        if len(raw) != spec.num_bytes:
            raise ValueError(f"tensor {spec.name} has {len(raw)} bytes, manifest says {spec.num_bytes}")
        for offset in range(0, len(raw), chunk_bytes):
            data = bytes(raw[offset : offset + chunk_bytes])
            if on_chunk is not None:
                on_chunk(len(data))
            yield pb.Frame(chunk=pb.Chunk(tensor_index=index, offset=offset, data=data, crc32=zlib.crc32(data)))
        total += len(raw)
    yield pb.Frame(end=pb.End(total_bytes=total))


# ---------------------------------------------------------------------------------------------------- receiving


@dataclass(frozen=True)
class Payload:
    """A complete, verified payload: the sender's manifest and its tensors in wire dtype, in manifest order."""

    manifest: pb.Manifest
    tensors: dict[str, torch.Tensor]

    @property
    def peer_id(self) -> str:
        return self.manifest.peer_id

    @property
    def outer_step(self) -> int:
        return self.manifest.outer_step


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
    ) -> None:
        self.expected = list(expected)
        self.run_fingerprint = run_fingerprint
        self.max_total_bytes = max_total_bytes
        self.allowed_codes = {WIRE_DTYPES[name][0] for name in allowed_dtypes}
        self.manifest: pb.Manifest | None = None
        self._buffers: list[torch.Tensor] = []
        self._byte_views: list[np.ndarray] = []
        self._filled: list[int] = []
        self._ended = False
        self.bytes_received = 0

    def feed(self, frame: pb.Frame) -> None:
        kind = frame.WhichOneof("body")
        if self._ended:
            raise _invalid("frame_after_end", f"a {kind} frame arrived after the end of the payload")
        if kind == "manifest":
            self._on_manifest(frame.manifest)
        elif kind == "chunk":
            self._on_chunk(frame.chunk)
        elif kind == "end":
            self._on_end(frame.end)
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
        self._buffers = [
            torch.empty(want.numel, dtype=_TORCH_DTYPE_OF_WIRE[spec.dtype])
            for spec, want in zip(manifest.tensors, self.expected, strict=True)
        ]
        self._byte_views = [buffer.view(torch.uint8).numpy() for buffer in self._buffers]
        self._filled = [0] * len(self._buffers)
        self.manifest = manifest

    def _on_chunk(self, chunk: pb.Chunk) -> None:
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
        data = chunk.data  # each access to a protobuf bytes field copies it: read it once
        size = len(data)
        if size == 0 or chunk.offset + size > spec.num_bytes:
            raise _invalid(
                "chunk_bounds",
                f"chunk of {size} bytes at offset {chunk.offset} does not fit tensor "
                f"{spec.name!r} of {spec.num_bytes} bytes",
            )
        if zlib.crc32(data) != chunk.crc32:
            raise _invalid("checksum", f"CRC-32 mismatch in tensor {spec.name!r} at offset {chunk.offset}")
        # One copy, straight from the message's bytes into the tensor's storage.
        self._byte_views[index][chunk.offset : chunk.offset + size] = np.frombuffer(data, dtype=np.uint8)
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
        """The verified payload; raises PayloadError if it is incomplete or holds a non-finite value."""
        if self.manifest is None or not self._ended:
            raise _invalid("incomplete", "the payload stopped before its end")
        tensors: dict[str, torch.Tensor] = {}
        for spec, want, buffer in zip(self.manifest.tensors, self.expected, self._buffers, strict=True):
            if _has_non_finite(buffer):
                raise _invalid("not_finite", f"tensor {spec.name!r} holds NaN or infinite values")
            tensors[spec.name] = buffer.view(want.shape)
        return Payload(self.manifest, tensors)


# IEEE exponent bits: a value is NaN or infinite exactly when all of them are set.
_EXPONENT_MASKS = {torch.bfloat16: (np.uint16, 0x7F80), torch.float32: (np.uint32, 0x7F800000)}


def _has_non_finite(buffer: torch.Tensor, block: int = 2**20) -> bool:
    """Bit-pattern test on the raw integers, block by block: several times faster than torch.isfinite on bf16."""
    int_type, mask = _EXPONENT_MASKS[buffer.dtype]
    bits = buffer.view(torch.uint8).numpy().view(int_type)
    return any(np.any((bits[i : i + block] & mask) == mask) for i in range(0, len(bits), block))
