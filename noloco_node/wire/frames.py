"""Payloads on the wire, the sending side and the format: manifests, chunk frames, checksums, decoding.

A payload is a Manifest (run fingerprint, sender, outer step, and for each tensor its name, shape, wire dtype and
byte size), then Chunks of at most ``chunk_bytes`` of one tensor each with an XXH3-64 checksum of their bytes, then
an End. The sender converts one chunk at a time to the wire dtype (bf16 by default, fp32 selectable) unless the
tensors already are in it (a node's published copies are), so it never builds a second copy of the whole model.
The encoded wire dtypes (int8, int4: blockwise absmax; sparse: top-k per chunk; side: a modulo code read against the
receiver's own copy; wire/codecs.py) travel as their encoded bytes; a tensor given as values is encoded whole, one
tensor at a time. A payload's tensors may travel in different dtypes (a tensor's layout may name its own).

Frames travel as bytes, not as protobuf objects: chunk frames are written and read by hand in protobuf's own wire
format (so the .proto stays the contract, and any protobuf client interoperates), because the objects' copies of
every chunk's data cost more CPU than the transfer itself. Manifest and end frames use protobuf as usual. The
receiving side, which trusts nothing, is wire/payload.py.
"""

from __future__ import annotations

import hashlib
import math
import struct
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import grpc
import torch
import xxhash

from noloco_node.errors import NolocoError
from noloco_node.wire import peer_pb2 as pb
from noloco_node.wire.codecs import ENCODED_WIRE_DTYPES, encode_into, wire_num_bytes

MAX_MESSAGE_BYTES = 4 * 2**20  # gRPC message limit on both ends: a chunk plus framing, never a whole model
DEFAULT_CHUNK_BYTES = 2**20
MAX_CHUNK_BYTES = MAX_MESSAGE_BYTES - 64 * 1024

# Each wire dtype: its code in the manifest and the dtype of its bytes in a buffer (encoded tensors travel as their
# bytes: wire/codecs.py).
WIRE_DTYPES: dict[str, tuple[int, torch.dtype]] = {
    "bf16": (pb.WIRE_DTYPE_BFLOAT16, torch.bfloat16),
    "fp32": (pb.WIRE_DTYPE_FLOAT32, torch.float32),
    "int8": (pb.WIRE_DTYPE_INT8_BLOCK256, torch.uint8),
    "int4": (pb.WIRE_DTYPE_INT4_BLOCK256, torch.uint8),
    "sparse": (pb.WIRE_DTYPE_SPARSE_TOPK4096, torch.uint8),
    "side": (pb.WIRE_DTYPE_SIDE_MOD3, torch.uint8),
}
_TORCH_DTYPE_OF_WIRE = {code: dtype for code, dtype in WIRE_DTYPES.values()}
WIRE_NAME_OF_CODE = {code: name for name, (code, _) in WIRE_DTYPES.items()}


# A seal that fails (security/payload_seal.py) is what a relay or proxy that altered, stripped or replaced the
# payload looks like as much as a lying sender: held against the sender, it would let anyone on the path get honest
# members quarantined.
SEAL_FAILURES = ("unsealed", "wrong_signer", "bad_seal")
NOT_THE_SENDERS_FAULT = ("incomplete", "not_ready", "not_reserved", "round_step", *SEAL_FAILURES)


class PayloadError(NolocoError):
    """A received payload that must not be used: the gRPC status to answer with and a metric label."""

    def __init__(self, code: grpc.StatusCode, reason: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.reason = reason
        self.message = message

    @property
    def blames_sender(self) -> bool:
        """Whether the payload says something bad about its sender. A stream that ended early is what a peer
        killed mid-exchange looks like, a receiver with no bound yet judges nobody, and a stream run's progress
        that finds this node's phase already closed (or another phase's) is this node's own timing: none of them
        is held against the peer (a restarted node must not find itself quarantined)."""
        return self.reason not in NOT_THE_SENDERS_FAULT


def _invalid(reason: str, message: str) -> PayloadError:
    return PayloadError(grpc.StatusCode.INVALID_ARGUMENT, reason, message)


@dataclass(frozen=True)
class TensorLayout:
    """A tensor a receiver expects: its name, shape, and the wire dtype it travels in when that is not its payload
    kind's."""

    name: str
    shape: tuple[int, ...]
    wire_dtype: str = ""  # "": the payload kind's

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class PayloadKind:
    """One kind of exchange payload a run accepts: its tensors in order and the wire dtype they travel in.

    A run in ``overlap`` mode exchanges one kind, ``weights`` (theta, with phi and delta when the run needs them);
    a ``sync`` run two: ``meet`` (the reservation, :data:`MEETING`) and ``weights``; a ``stream`` run two:
    ``phase`` (phi, fixed during the inner phase, in bf16) and ``progress`` (Delta = theta - phi at the outer step,
    in the run's wire dtype). The receiver tells them apart by their parts
    (the prefix of every tensor name)."""

    name: str
    layout: tuple[TensorLayout, ...]
    wire_dtype: str

    @property
    def parts(self) -> list[str]:
        return list(dict.fromkeys(item.name.split("/", 1)[0] for item in self.layout))

    def dtype_of(self, item: TensorLayout) -> str:
        return item.wire_dtype or self.wire_dtype

    def wire_bytes(self) -> int:
        return sum(wire_num_bytes(item.numel, self.dtype_of(item)) for item in self.layout)


# A sync run's reservation payload (pairing/sync.py): one value, the seconds until its sender's outer step.
MEET_DUE = "meet/due"
MEETING = PayloadKind("meet", (TensorLayout(MEET_DUE, (1,)),), "fp32")


def layout_of(named_tensors: Sequence[tuple[str, torch.Tensor]]) -> list[TensorLayout]:
    return [TensorLayout(name, tuple(tensor.shape)) for name, tensor in named_tensors]


# ---------------------------------------------------------------------------------------------------- sending


def build_manifest(
    tensors: Sequence[tuple[str, torch.Tensor]] | Sequence[TensorLayout],
    *,
    wire_dtype: str,
    run_fingerprint: str,
    peer_id: str,
    outer_step: int,
    metadata_json: str = "",
    phase_tokens: int = 0,
) -> pb.Manifest:
    """The manifest of ``tensors`` in ``wire_dtype``: named values (their shapes are what the receiver checks), or
    their layout (a publisher whose buffers hold the encoded bytes; an item that names its own dtype travels in it)."""
    layout = [
        item if isinstance(item, TensorLayout) else TensorLayout(item[0], tuple(item[1].shape)) for item in tensors
    ]
    return pb.Manifest(
        run_fingerprint=run_fingerprint,
        peer_id=peer_id,
        outer_step=outer_step,
        metadata_json=metadata_json,
        phase_tokens=phase_tokens,
        tensors=[
            pb.TensorSpec(
                name=item.name,
                shape=list(item.shape),
                dtype=WIRE_DTYPES[item.wire_dtype or wire_dtype][0],  # type: ignore[arg-type]
                num_bytes=wire_num_bytes(item.numel, item.wire_dtype or wire_dtype),
            )
            for item in layout
        ],
    )


class PayloadDigest:
    """SHA-256 over everything a payload says, in order: its manifest's fields, then each chunk's tensor index,
    offset and bytes. What a seal signs (security/payload_seal.py): unlike the chunks' XXH3 checksums, nobody can
    make other bytes with the same digest. Fields are length-prefixed, so no two payloads share an encoding."""

    def __init__(self, manifest: pb.Manifest) -> None:
        self._hash = hashlib.sha256(b"noloco-payload-digest-v1")
        self._text(manifest.run_fingerprint)
        self._text(manifest.peer_id)
        self._text(manifest.metadata_json)
        self._hash.update(struct.pack("<QQ", manifest.outer_step, len(manifest.tensors)))
        for spec in manifest.tensors:
            self._text(spec.name)
            shape = struct.pack(f"<Q{len(spec.shape)}q", len(spec.shape), *spec.shape)
            self._hash.update(struct.pack("<QQ", spec.dtype, spec.num_bytes) + shape)

    def _text(self, text: str) -> None:
        data = text.encode()
        self._hash.update(struct.pack("<Q", len(data)))
        self._hash.update(data)

    def chunk(self, tensor_index: int, offset: int, data: memoryview | bytes) -> None:
        self._hash.update(struct.pack("<QQQ", tensor_index, offset, len(data)))
        self._hash.update(data)  # hashlib lets go of the GIL while it reads a chunk

    def digest(self) -> bytes:
        return self._hash.digest()


# Signs a payload's digest for its end frame: (signature, the signer's public key).
Signer = Callable[[bytes], tuple[bytes, bytes]]


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
    signer: Signer | None = None,
) -> Iterator[bytes]:
    """The encoded frames of one payload: the manifest, every tensor's chunks in order, the end.

    CPU tensors are converted to the wire dtype one chunk at a time into a small reused staging buffer (no second
    copy of the model, and the converted bytes are still in cache when the checksum and the frame read them). A
    tensor on an accelerator is converted there and copied to the host whole, one tensor at a time. With
    ``from_tensor`` and ``from_offset`` the manifest still lists every tensor but only the bytes from that point on
    are sent (a resumed state download); the end frame counts the bytes actually sent. With ``signer`` the end
    frame is sealed: it carries the signer's signature over the payload's :class:`PayloadDigest`.
    """
    if not 0 < chunk_bytes <= MAX_CHUNK_BYTES or chunk_bytes % 4:
        raise ValueError(f"chunk_bytes must be a multiple of 4 in (0, {MAX_CHUNK_BYTES}], got {chunk_bytes}")
    if len(tensors) != len(manifest.tensors):
        raise ValueError("tensors do not match the manifest")
    yield pb.Frame(manifest=manifest).SerializeToString()
    digest = PayloadDigest(manifest) if signer is not None else None
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
        flat = tensor.detach()
        wire_name = WIRE_NAME_OF_CODE[spec.dtype]
        if wire_name in ENCODED_WIRE_DTYPES and flat.dtype != torch.uint8:  # values given: encoded here, one at a time
            encoded = torch.empty(wire_num_bytes(flat.numel(), wire_name), dtype=torch.uint8)
            encode_into(flat, wire_name, encoded)
            flat = encoded
        if (size := flat.numel() * itemsize) != spec.num_bytes:
            raise ValueError(f"tensor {spec.name} has {size} bytes, manifest says {spec.num_bytes}")
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
            if digest is not None:
                digest.chunk(index, start * itemsize, data)
            yield encode_chunk_frame(index, start * itemsize, data, chunk_checksum(data))
        total += spec.num_bytes - skip
    end = pb.End(total_bytes=total)
    if signer is not None and digest is not None:
        end.signature, end.signer_key = signer(digest.digest())
    yield pb.Frame(end=end).SerializeToString()


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


def verdict_frame(commit: bool, reason: str = "", receipt_signature: bytes = b"", receipt_time: int = 0) -> bytes:
    """The encoded commit (or refusal, with its reason) that ends an exchange, with this side's signature over the
    exchange's receipt when it signs one: see proto Verdict."""
    verdict = pb.Verdict(
        commit=commit, reason=reason[:200], receipt_signature=receipt_signature, receipt_time=receipt_time
    )
    return pb.Frame(verdict=verdict).SerializeToString()


def read_verdict(raw: bytes) -> pb.Verdict:
    """A verdict frame, or PayloadError: what follows a payload's end must be the other side's verdict."""
    try:
        frame = pb.Frame.FromString(raw)
    except Exception as error:  # protobuf's DecodeError
        raise _invalid("malformed_verdict", f"a frame protobuf cannot parse: {error}") from None
    if frame.WhichOneof("body") != "verdict":
        raise _invalid("malformed_verdict", "the frame after a payload's end must be a verdict")
    return frame.verdict


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
