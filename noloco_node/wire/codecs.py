"""The wire dtypes as codecs: what a tensor costs on the wire, how the encoded ones (int8 and int4 of
wire/quantize.py, sparse of wire/sparse.py, side of wire/side_info.py) are written, checked as their bytes arrive,
and decoded.

bf16 and fp32 travel as their values (the receiver checks them for NaN and infinities itself); the encoded dtypes
travel as uint8 bytes, checked piece by piece while the rest of the payload is still on its way. int8, int4 and
sparse are decoded to fp32 once the tensor is complete; side is not: only the receiver's own copy of the tensor reads
it (pairing/stream.py decodes it), so it stays bytes in the payload. Nothing here knows about frames or payloads: it
is the one place another codec plugs in.
"""

from __future__ import annotations

import torch

from noloco_node.wire import quantize, side_info, sparse

DECODED_ON_ARRIVAL = ("int8", "int4", "sparse")  # encoded tensors a receiver decodes to fp32 as soon as they are in
ENCODED_WIRE_DTYPES = (*DECODED_ON_ARRIVAL, "side")  # tensors that travel as their encoded bytes
_VALUE_BYTES = {"bf16": 2, "fp32": 4}


def wire_num_bytes(numel: int, wire_dtype: str) -> int:
    """Bytes of a tensor of ``numel`` values on the wire."""
    if wire_dtype == "sparse":
        return sparse.encoded_bytes(numel)
    if wire_dtype == "side":
        return side_info.encoded_bytes(numel)
    if quantize.is_quantized(wire_dtype):
        return quantize.encoded_bytes(numel, wire_dtype)
    return numel * _VALUE_BYTES[wire_dtype]


def encode_into(values: torch.Tensor, wire_dtype: str, out: torch.Tensor) -> None:
    """Write ``values`` into ``out`` (uint8, ``wire_num_bytes`` long) in an encoded wire dtype; values already
    encoded (uint8: the sparse progress, whose sender keeps what the code left out, and the side code, which only its
    sender's seed and gap estimate make) are copied."""
    if values.dtype == torch.uint8:
        out.copy_(values.reshape(-1))
    elif wire_dtype == "side":
        raise ValueError("a side-coded tensor is encoded by its sender (wire/side_info.py), not from its values here")
    elif wire_dtype == "sparse":
        out.copy_(sparse.encode(values))
    else:
        quantize.quantize_into(values, wire_dtype, out)


def decode_into(encoded: torch.Tensor, numel: int, wire_dtype: str, out: torch.Tensor) -> None:
    """The fp32 values of a complete, checked tensor in a dtype of DECODED_ON_ARRIVAL, into ``out``."""
    if wire_dtype == "sparse":
        sparse.decode(encoded, numel, out=out)
    else:
        quantize.dequantize(encoded, numel, wire_dtype, out=out)


class ArrivalCheck:
    """Checks one encoded tensor's bytes as they arrive, in order, in a buffer of its whole encoding: a quantized
    tensor's scales (finite, not negative) and codes (within the encoder's range) chunk by chunk, a sparse or side
    tensor's records as each one is complete (``bad_records`` of wire/sparse.py and wire/side_info.py). Returns
    (reason, what is wrong) for the first bad piece, so the receiver refuses the payload before the rest of it
    arrives."""

    def __init__(self, wire_dtype: str, numel: int, buffer: torch.Tensor) -> None:
        self.wire_dtype = wire_dtype
        self.numel = numel
        self.buffer = buffer
        self._records_checked = 0  # sparse and side: the records checked so far

    def splits_a_value(self, offset: int, size: int, total: int) -> bool:
        """A quantized tensor's chunks may not split one of its fp32 scales (a sparse or side record may be split:
        it is checked once complete)."""
        if not quantize.is_quantized(self.wire_dtype):
            return False
        return bool(offset % 4 or (size % 4 and offset + size != total))

    def check(self, offset: int, size: int) -> tuple[str, str] | None:
        """The bytes [offset, offset + size) have just arrived (after every byte before them)."""
        if self.wire_dtype == "sparse":
            return self._check_records(offset + size)
        if self.wire_dtype == "side":
            return self._check_side_records(offset + size)
        scale_bytes = 4 * quantize.num_blocks(self.numel)
        end = offset + size
        if offset < scale_bytes and quantize.bad_scales(
            self.buffer[offset : min(end, scale_bytes)].view(torch.float32)
        ):
            return "bad_scales", "has a NaN, infinite or negative block scale"
        if end > scale_bytes and quantize.bad_codes(self.buffer[max(offset, scale_bytes) : end], self.wire_dtype):
            return "bad_codes", f"has codes outside the {self.wire_dtype} range"
        return None

    def _check_records(self, filled: int) -> tuple[str, str] | None:
        full, rest = sparse.chunk_lengths(self.numel)
        record = self._records_checked
        while record < full + (1 if rest else 0):
            start, length = sparse.record_span(self.numel, record)
            size = sparse.record_bytes(length)
            count = min(full - record, (filled - start) // size) if record < full else (filled - start) // size
            if count <= 0:
                break
            why = sparse.bad_records(self.buffer[start : start + count * size].view(count, size), length)
            if why is not None:
                return "bad_sparse", f"is not a valid sparse encoding: {why}"
            record += count
        self._records_checked = record
        return None

    def _check_side_records(self, filled: int) -> tuple[str, str] | None:
        size = side_info.RECORD_BYTES
        start, count = self._records_checked * size, filled // size - self._records_checked
        if count > 0:
            why = side_info.bad_records(self.buffer[start : start + count * size].view(count, size))
            if why is not None:
                return "bad_side", f"is not a valid side-information code: {why}"
            self._records_checked += count
        return None
