"""The wire dtypes as codecs: what a tensor costs on the wire, how the encoded ones (int8 and int4 of
wire/quantize.py, sparse of wire/sparse.py) are written, checked as their bytes arrive, and decoded.

bf16 and fp32 travel as their values (the receiver checks them for NaN and infinities itself); the encoded dtypes
travel as uint8 bytes, checked piece by piece while the rest of the payload is still on its way, and decoded to fp32
once the tensor is complete. Nothing here knows about frames or payloads: it is the one place a fourth codec plugs
in.
"""

from __future__ import annotations

import torch

from noloco_node.wire import quantize, sparse

ENCODED_WIRE_DTYPES = ("int8", "int4", "sparse")  # tensors that travel as their encoded bytes, decoded on arrival
_VALUE_BYTES = {"bf16": 2, "fp32": 4}


def wire_num_bytes(numel: int, wire_dtype: str) -> int:
    """Bytes of a tensor of ``numel`` values on the wire."""
    if wire_dtype == "sparse":
        return sparse.encoded_bytes(numel)
    if quantize.is_quantized(wire_dtype):
        return quantize.encoded_bytes(numel, wire_dtype)
    return numel * _VALUE_BYTES[wire_dtype]


def encode_into(values: torch.Tensor, wire_dtype: str, out: torch.Tensor) -> None:
    """Write ``values`` into ``out`` (uint8, ``wire_num_bytes`` long) in an encoded wire dtype; values already
    encoded (uint8: a sparse sender with error feedback encodes them itself) are copied."""
    if values.dtype == torch.uint8:
        out.copy_(values.reshape(-1))
    elif wire_dtype == "sparse":
        out.copy_(sparse.encode(values))
    else:
        quantize.quantize_into(values, wire_dtype, out)


def decode_into(encoded: torch.Tensor, numel: int, wire_dtype: str, out: torch.Tensor) -> None:
    """The fp32 values of a complete, checked encoded tensor, into ``out``."""
    if wire_dtype == "sparse":
        sparse.decode(encoded, numel, out=out)
    else:
        quantize.dequantize(encoded, numel, wire_dtype, out=out)


class ArrivalCheck:
    """Checks one encoded tensor's bytes as they arrive, in order, in a buffer of its whole encoding: a quantized
    tensor's scales (finite, not negative) and codes (within the encoder's range) chunk by chunk, a sparse
    tensor's records as each one is complete (wire/sparse.py ``bad_records``). Returns (reason, what is wrong) for
    the first bad piece, so the receiver refuses the payload before the rest of it arrives."""

    def __init__(self, wire_dtype: str, numel: int, buffer: torch.Tensor) -> None:
        self.wire_dtype = wire_dtype
        self.numel = numel
        self.buffer = buffer
        self._records_checked = 0  # sparse: the records checked so far

    def splits_a_value(self, offset: int, size: int, total: int) -> bool:
        """A quantized tensor's chunks may not split one of its fp32 scales (a sparse record may be split: it is
        checked once complete)."""
        if not quantize.is_quantized(self.wire_dtype):
            return False
        return bool(offset % 4 or (size % 4 and offset + size != total))

    def check(self, offset: int, size: int) -> tuple[str, str] | None:
        """The bytes [offset, offset + size) have just arrived (after every byte before them)."""
        if self.wire_dtype == "sparse":
            return self._check_records(offset + size)
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
