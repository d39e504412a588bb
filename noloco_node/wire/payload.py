"""Payloads on the wire, the receiving side: every received byte checked before it is used (format: frames.py).

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
be complete; values must be finite; a quantized tensor's scales must be finite and not negative and its codes
within the encoder's range, a sparse tensor's records must hold positions inside their chunk in increasing order
and ordered finite scales, a side-coded tensor's records a finite sketch, a finite step >= 0 and code bytes of
base-3 digits (checked chunk by chunk as they arrive; the tensor is decoded to fp32 as soon as it is complete,
except a side-coded one, which stays bytes: only the receiver's own weights read it); and in an exchange, the
end's seal must be the expected sender's signature over the digest of all of it (security/payload_seal.py). Any
failure raises :class:`PayloadError` carrying the gRPC status to answer with and a short reason label for the
rejection metric, and nothing is handed to the caller.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Protocol

import grpc
import numpy as np
import torch

from noloco_node.wire import peer_pb2 as pb
from noloco_node.wire.codecs import DECODED_ON_ARRIVAL, ENCODED_WIRE_DTYPES, ArrivalCheck, decode_into
from noloco_node.wire.frames import (
    _TORCH_DTYPE_OF_WIRE,
    WIRE_DTYPES,
    WIRE_NAME_OF_CODE,
    ChunkView,
    PayloadDigest,
    PayloadError,
    PayloadKind,
    TensorLayout,
    _invalid,
    chunk_checksum,
    decode_frame,
    wire_num_bytes,
)
from noloco_node.wire.receive_buffers import ReceiveBuffers


class ValueObserver(Protocol):
    """Sees a payload's values as they arrive, in order, without holding them (security/payload_guard.py's
    ``RunningGap`` measures the norm bound's distance chunk by chunk, behind the transfer)."""

    def observe(self, name: str, start: int, values: torch.Tensor) -> None:
        """``values`` (wire dtype, or fp32 once a quantized tensor is decoded) are elements ``start`` onwards of
        the tensor called ``name``; valid only during the call."""

    def close(self) -> None:
        """The payload is complete or dropped: let go of what it references. Idempotent."""


class Payload:
    """A complete, verified payload: the sender's manifest and its tensors in manifest order, in the wire dtype
    (bf16, fp32), decoded to fp32 (int8, int4, sparse), or, side-coded, as their checked bytes (flat uint8:
    :attr:`side_coded`)."""

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
        # Set when it arrived before the receiving node could judge its content (no norm bound yet): the trainer
        # judges it before blending it (node/outer_step.py).
        self.unjudged = False
        self.observer: ValueObserver | None = None  # what measured its values on arrival, when anything did
        self._buffers = list(buffers)
        self._pool = pool

    @property
    def peer_id(self) -> str:
        return self.manifest.peer_id

    @property
    def outer_step(self) -> int:
        return self.manifest.outer_step

    @property
    def parts(self) -> list[str]:
        """What it carries per parameter (``theta``, ``phi``, ``delta``, ``progress``), in manifest order."""
        return _parts(self.tensors)

    @property
    def side_coded(self) -> list[str]:
        """The tensors still in the side code, which only the receiver's own weights read (pairing/stream.py)."""
        return [name for name, tensor in self.tensors.items() if tensor.dtype == torch.uint8]

    def hand_over(self) -> tuple[dict[str, torch.Tensor], list[torch.Tensor]]:
        """Its tensors and the buffers behind them, for a payload assembled from this one (a stream run's phase and
        progress payloads); this payload is empty afterwards and its release does nothing."""
        tensors, buffers = self.tensors, self._buffers
        self.tensors, self._buffers = {}, []
        return tensors, buffers

    def release(self) -> None:
        """The tensors will not be read again: their buffers may receive the next payload. Idempotent."""
        buffers, self._buffers, self.tensors = self._buffers, [], {}
        if self._pool is not None and buffers:
            self._pool.give_back(buffers)


# Checks an end frame's seal against the digest of the payload that arrived: returns, or raises PayloadError.
SealCheck = Callable[[bytes, pb.End], None]


class PayloadReceiver:
    """Assembles one peer's payload from frames, checking each one; :meth:`finish` returns it only if all is well.

    ``expected`` is the exact list of tensors this receiver accepts, in order, in one of ``allowed_dtypes``; or,
    with ``kinds``, the payload's parts choose one of those kinds (a stream run's phase or progress payload), which
    then sets both. ``max_total_bytes`` caps the whole payload before anything is allocated. With ``seal_check``
    the payload is digested as it arrives and its end must carry a seal that passes the check.
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
        kinds: Sequence[PayloadKind] = (),
        observer: ValueObserver | None = None,
        seal_check: SealCheck | None = None,
    ) -> None:
        self.observer = observer
        self.seal_check = seal_check
        self._digest: PayloadDigest | None = None
        self.expected = list(expected)
        self.kinds = list(kinds)
        self.kind: PayloadKind | None = None  # the kind the manifest turned out to be, with ``kinds``
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
        self._checks: list[ArrivalCheck | None] = []  # per tensor: its encoded dtype's check, None for bf16/fp32
        self._decoded: dict[int, torch.Tensor] = {}  # encoded tensors, decoded to fp32 once complete
        self._ended = False
        self.bytes_received = 0

    @property
    def ended(self) -> bool:
        """The payload's end has arrived (what follows it, if anything, is the exchange's verdict)."""
        return self._ended

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
        sent = _parts(spec.name for spec in manifest.tensors)
        if self.kinds:
            self.kind = next((kind for kind in self.kinds if kind.parts == sent), self.kinds[0])
            self.expected = list(self.kind.layout)
            self.allowed_codes = {WIRE_DTYPES[self.kind.wire_dtype][0]}
        accepted = [kind.parts for kind in self.kinds] or [_parts(want.name for want in self.expected)]
        if sent not in accepted and set(sent) <= EXCHANGED_PARTS:
            # A well-formed payload of another configuration (--mode, --blend-momenta, --gamma): say which, not
            # "malformed".
            raise PayloadError(
                grpc.StatusCode.FAILED_PRECONDITION,
                "payload_layout",
                f"the payload carries {'+'.join(sent)} per parameter; this node's run exchanges "
                f"{' or '.join('+'.join(parts) for parts in accepted)} (--mode, --blend-momenta and --gamma must be "
                "the same on every node of a run)",
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
            if spec.dtype not in WIRE_NAME_OF_CODE:
                raise _invalid("tensor_dtype", f"tensor {spec.name!r} has an unknown wire dtype {spec.dtype}")
            allowed = {WIRE_DTYPES[want.wire_dtype][0]} if want.wire_dtype else self.allowed_codes
            if spec.dtype not in allowed:
                raise PayloadError(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    "wire_dtype",
                    f"tensor {spec.name!r} is sent in {WIRE_NAME_OF_CODE[spec.dtype]}; this node's run exchanges "
                    f"{' or '.join(WIRE_NAME_OF_CODE[code] for code in sorted(allowed))} (--wire-dtype)",
                )
            size = wire_num_bytes(want.numel, WIRE_NAME_OF_CODE[spec.dtype])
            if spec.num_bytes != size:
                raise _invalid(
                    "tensor_size",
                    f"tensor {spec.name!r} declares {spec.num_bytes} bytes, its shape and dtype make {size}",
                )
            total += spec.num_bytes
        if total > self.max_total_bytes:
            raise PayloadError(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                "too_large",
                f"payload declares {total} bytes, the limit is {self.max_total_bytes}",
            )
        # Only now, with every size checked, is memory committed: one buffer per tensor, of its wire bytes.
        for index, given in enumerate(self.prefilled):
            if given.dtype != _TORCH_DTYPE_OF_WIRE[manifest.tensors[index].dtype]:
                raise _invalid("tensor_dtype", f"tensor {manifest.tensors[index].name!r} changed dtype on resume")
        self._buffers = [
            self.prefilled[index].view(-1)
            if index < len(self.prefilled)
            else self._allocate(dtype := _TORCH_DTYPE_OF_WIRE[spec.dtype], spec.num_bytes // dtype.itemsize)
            for index, spec in enumerate(manifest.tensors)
        ]
        self._byte_views = [buffer.view(torch.uint8).numpy() for buffer in self._buffers]
        self._itemsizes = [buffer.element_size() for buffer in self._buffers]
        self._checks = [
            ArrivalCheck(name, want.numel, buffer)
            if (name := WIRE_NAME_OF_CODE[spec.dtype]) in ENCODED_WIRE_DTYPES
            else None
            for spec, want, buffer in zip(manifest.tensors, self.expected, self._buffers, strict=True)
        ]
        self._filled = [
            spec.num_bytes if index < len(self.prefilled) else 0 for index, spec in enumerate(manifest.tensors)
        ]
        if self.prefilled and self.prefilled_partial_bytes:
            self._filled[len(self.prefilled) - 1] = self.prefilled_partial_bytes
        if self.seal_check is not None:
            self._digest = PayloadDigest(manifest)
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

    def release_observer(self) -> None:
        """The call is over, however it ended: the observer lets go of what it references (its results stay with
        a finished payload). Idempotent; safe while a reader thread still feeds (it then measures nothing)."""
        if self.observer is not None:
            self.observer.close()

    def discard(self) -> None:
        """The payload will not be finished (refused, cut): its buffers go back to the pool. Idempotent."""
        buffers = self._buffers + list(self._decoded.values())
        self._buffers, self._byte_views, self._decoded = [], [], {}
        if self.observer is not None:
            self.observer.close()
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
        check = self._checks[index]
        if size % self._itemsizes[index] or (
            check is not None and check.splits_a_value(chunk.offset, size, spec.num_bytes)
        ):
            raise _invalid("chunk_alignment", f"chunk of {size} bytes splits a value of tensor {spec.name!r}")
        if chunk_checksum(chunk.data) != chunk.checksum:
            raise _invalid("checksum", f"checksum mismatch in tensor {spec.name!r} at offset {chunk.offset}")
        # One copy, straight from the frame's bytes into the tensor's storage; the finiteness test reads the values
        # while they are still in cache, and refuses a bad payload before the rest of it has to arrive.
        target = self._byte_views[index][chunk.offset : chunk.offset + size]
        target[:] = np.frombuffer(chunk.data, dtype=np.uint8)
        if check is not None:
            if (bad := check.check(chunk.offset, size)) is not None:
                raise _invalid(bad[0], f"tensor {spec.name!r} {bad[1]}")
        elif _has_non_finite(target, self._buffers[index].dtype):
            raise _invalid("not_finite", f"tensor {spec.name!r} holds NaN or infinite values")
        elif self.observer is not None:  # while the next chunk is on its way
            start, itemsize = chunk.offset // self._itemsizes[index], self._itemsizes[index]
            self.observer.observe(spec.name, start, self._buffers[index][start : start + size // itemsize])
        if self._digest is not None:
            self._digest.chunk(index, chunk.offset, chunk.data)
        self._filled[index] += size
        self.bytes_received += size
        if check is not None and check.wire_dtype in DECODED_ON_ARRIVAL and self._filled[index] == spec.num_bytes:
            # Decoded as soon as its last byte is in, while the next tensor's bytes are on their way.
            decoded = self._allocate(torch.float32, check.numel)
            decode_into(self._buffers[index], check.numel, check.wire_dtype, decoded)
            self._decoded[index] = decoded
            if self.observer is not None:
                self.observer.observe(spec.name, 0, decoded)

    def _on_end(self, end: pb.End) -> None:
        if self.manifest is None:
            raise _invalid("end_before_manifest", "the payload ended before its manifest")
        for spec, filled in zip(self.manifest.tensors, self._filled, strict=True):
            if filled != spec.num_bytes:
                raise _invalid("incomplete", f"tensor {spec.name!r} ended at {filled} of {spec.num_bytes} bytes")
        if end.total_bytes != self.bytes_received:
            raise _invalid("total_bytes", f"end declares {end.total_bytes} bytes, {self.bytes_received} arrived")
        if self.seal_check is not None and self._digest is not None:
            self.seal_check(self._digest.digest(), end)
        self._ended = True

    def finish(self) -> Payload:
        """The verified payload (every chunk was checked on arrival); raises PayloadError if it is incomplete."""
        if self.manifest is None or not self._ended:
            raise _invalid("incomplete", "the payload stopped before its end")
        tensors = {
            spec.name: buffer if spec.dtype == SIDE_CODE else self._decoded.get(index, buffer).view(want.shape)
            for index, (spec, want, buffer) in enumerate(
                zip(self.manifest.tensors, self.expected, self._buffers, strict=True)
            )
        }
        payload = Payload(self.manifest, tensors, buffers=self._buffers + list(self._decoded.values()), pool=self.pool)
        self._buffers, self._byte_views, self._decoded = [], [], {}  # the payload owns them now
        if self.observer is not None:
            self.observer.close()
            payload.observer = self.observer
        return payload


SIDE_CODE = WIRE_DTYPES["side"][0]  # stays its flat bytes in a payload: it has no values before it is read

# What an exchange payload may carry per parameter (node/run_layout.py): fast weights, slow weights, outer
# momentum, and a stream run's progress Delta = theta - phi.
EXCHANGED_PARTS = {"theta", "phi", "delta", "progress"}


def _parts(names: Iterable[str]) -> list[str]:
    """The parts of a payload in order of first appearance: ``theta/w``, ``phi/w`` -> [theta, phi]."""
    return list(dict.fromkeys(name.split("/", 1)[0] for name in names))


# IEEE exponent bits: a value is NaN or infinite exactly when all of them are set.
_EXPONENT_MASKS = {torch.bfloat16: (np.uint16, 0x7F80), torch.float32: (np.uint32, 0x7F800000)}


def _has_non_finite(raw: np.ndarray, dtype: torch.dtype) -> bool:
    """Bit-pattern test on the raw integers of one chunk: the masked exponent reaches the mask exactly when some
    value is NaN or infinite. One pass and one reduction: twice as fast as comparing every element, ten times
    faster than torch.isfinite on bf16."""
    int_type, mask = _EXPONENT_MASKS[dtype]
    return int((raw.view(int_type) & mask).max()) == mask
