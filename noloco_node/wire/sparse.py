"""The ``sparse`` wire dtype: top-k per chunk, 2-bit values, 12-bit indices (SparseLoCo's compression, arXiv
2508.15706, as a codec for one tensor).

A tensor is flattened and cut into chunks of ``CHUNK`` values (the last one may be shorter). Of each chunk only its
``k`` values of largest magnitude travel, ``k = ceil(KEEP * length)`` rounded up to even (64 of 4096, 1.56%). Each
chunk is one fixed-size *record*:

- two bf16 scales, ``low`` then ``high`` (0 <= low <= high, finite): the mean magnitude of the smaller and of the
  larger half of the kept values;
- the kept positions within the chunk, strictly increasing, 12 bits each, two in three bytes, little end first;
- one 2-bit code per kept value in position order, four to a byte, lowest bits first: bit 0 the sign (1 negative),
  bit 1 the magnitude (1 high, 0 low).

So a chunk of 4096 values costs 4 + 96 + 16 = 116 bytes, 0.028 bytes per value (``encoded_bytes``): the sizes are
fixed by the tensor's shape, so a manifest declares them and a receiver checks them before anything arrives, as it
does for the dense wire dtypes. Every record is checked as soon as its bytes are in (``bad_records``): a position
out of its chunk, repeated or out of order, a scale that is not finite, negative, or a low above the high, and any
padding bit set are refused.

The codec drops what it does not send: a stream run's sender has applied its whole progress to itself, and blends
what the code left out as part of its estimate of the partner's (pairing/stream.py). The simulator's error-feedback
methods keep it for the next progress instead (simulate/wire_views.py ``ErrorFeedback``).
"""

from __future__ import annotations

import math

import torch

CHUNK = 4096
KEEP = 1 / 64  # the kept fraction of each chunk: SparseLoCo's 1.56%
SCALE_BYTES = 4  # two bf16 scales


def kept(length: int) -> int:
    """How many values a chunk of ``length`` values keeps: at least 2 (one scale pair needs two values), even, and
    never more than the chunk holds (a chunk of one value keeps it)."""
    k = max(2, math.ceil(KEEP * length))
    k += k % 2
    return min(k, length)


def index_bytes(k: int) -> int:
    return math.ceil(k * 3 / 2)


def code_bytes(k: int) -> int:
    return math.ceil(k / 4)


def record_bytes(length: int) -> int:
    k = kept(length)
    return SCALE_BYTES + index_bytes(k) + code_bytes(k)


def chunk_lengths(numel: int) -> tuple[int, int]:
    """(full chunks, length of the last short chunk or 0)."""
    return numel // CHUNK, numel % CHUNK


def encoded_bytes(numel: int) -> int:
    full, rest = chunk_lengths(numel)
    return full * record_bytes(CHUNK) + (record_bytes(rest) if rest else 0)


def _encode_chunks(values: torch.Tensor) -> torch.Tensor:
    """Records of a (chunks, length) fp32 block, one row of uint8 per chunk."""
    chunks, length = values.shape
    k = kept(length)
    top = values.abs().topk(k, dim=1, sorted=True)  # magnitudes, largest first
    half = (k + 1) // 2  # the larger half; a chunk of one value has no smaller half and sends low = high
    high = top.values[:, :half].mean(dim=1)
    low = top.values[:, half:].mean(dim=1) if k > half else high
    # Positions in increasing order, their codes alongside: a receiver checks the order, which also rules out repeats.
    positions, order = top.indices.sort(dim=1)
    is_high = (torch.arange(k).expand(chunks, k) < half).gather(1, order)
    negative = values.gather(1, positions) < 0
    codes = negative.to(torch.uint8) | (is_high.to(torch.uint8) << 1)

    out = torch.zeros(chunks, record_bytes(length), dtype=torch.uint8)
    out[:, 0:2] = low.to(torch.bfloat16).view(-1, 1).view(torch.uint8)
    out[:, 2:4] = high.to(torch.bfloat16).view(-1, 1).view(torch.uint8)
    packed_index = torch.zeros(chunks, k + k % 2, dtype=torch.int32)
    packed_index[:, :k] = positions.to(torch.int32)
    first, second = packed_index[:, 0::2], packed_index[:, 1::2]
    triples = torch.stack((first & 0xFF, (first >> 8) | ((second & 0x0F) << 4), second >> 4), dim=2).view(chunks, -1)
    index_end = SCALE_BYTES + index_bytes(k)
    out[:, SCALE_BYTES:index_end] = triples[:, : index_bytes(k)].to(torch.uint8)
    padded_codes = torch.zeros(chunks, 4 * code_bytes(k), dtype=torch.uint8)
    padded_codes[:, :k] = codes
    quads = padded_codes.view(chunks, -1, 4)
    out[:, index_end:] = quads[:, :, 0] | (quads[:, :, 1] << 2) | (quads[:, :, 2] << 4) | (quads[:, :, 3] << 6)
    return out


@torch.no_grad()
def encode(values: torch.Tensor) -> torch.Tensor:
    """The encoded bytes (uint8, ``encoded_bytes(numel)`` long) of ``values`` (any float dtype and shape, finite)."""
    flat = values.detach().reshape(-1).to("cpu", torch.float32)
    full, rest = chunk_lengths(flat.numel())
    parts = []
    if full:
        parts.append(_encode_chunks(flat[: full * CHUNK].view(full, CHUNK)).view(-1))
    if rest:
        parts.append(_encode_chunks(flat[full * CHUNK :].view(1, rest)).view(-1))
    return torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8)


def _records(encoded: torch.Tensor, numel: int) -> list[tuple[torch.Tensor, int]]:
    """The encoded bytes as (records of one length, that length): the full chunks, then the short one."""
    full, rest = chunk_lengths(numel)
    size = record_bytes(CHUNK) * full
    groups = []
    if full:
        groups.append((encoded[:size].view(full, record_bytes(CHUNK)), CHUNK))
    if rest:
        groups.append((encoded[size:].view(1, record_bytes(rest)), rest))
    return groups


def _fields(records: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(low, high, positions, codes) of records of chunks of ``length`` values; positions and codes keep their
    padding (one position when k is odd, up to three codes)."""
    k = kept(length)
    chunks = records.shape[0]
    scales = records[:, :SCALE_BYTES].reshape(-1).clone().view(torch.bfloat16).view(chunks, 2).to(torch.float32)
    index_end = SCALE_BYTES + index_bytes(k)
    raw = records[:, SCALE_BYTES:index_end].to(torch.int32)
    if raw.shape[1] % 3:
        raw = torch.cat((raw, torch.zeros(chunks, 3 - raw.shape[1] % 3, dtype=torch.int32)), dim=1)
    triples = raw.view(chunks, -1, 3)
    first = triples[:, :, 0] | ((triples[:, :, 1] & 0x0F) << 8)
    second = (triples[:, :, 1] >> 4) | (triples[:, :, 2] << 4)
    positions = torch.stack((first, second), dim=2).view(chunks, -1)
    packed = records[:, index_end:]
    codes = torch.stack([(packed >> shift) & 0x3 for shift in (0, 2, 4, 6)], dim=2).view(chunks, -1)
    return scales[:, 0], scales[:, 1], positions, codes


def bad_records(records: torch.Tensor, length: int) -> str | None:
    """Why complete records of chunks of ``length`` values are not this format, or None when they are."""
    k = kept(length)
    low, high, positions, codes = _fields(records, length)
    if not bool(torch.isfinite(low).all() and torch.isfinite(high).all()):
        return "a NaN or infinite scale"
    if bool((low < 0).any()) or bool((low > high).any()):
        return "a negative scale or a low scale above the high one"
    kept_positions = positions[:, :k]
    if bool((kept_positions >= length).any()):
        return f"a position outside its chunk of {length} values"
    if k > 1 and bool((kept_positions[:, 1:] <= kept_positions[:, :-1]).any()):
        return "positions repeated or out of order"
    if bool((positions[:, k:] != 0).any()) or bool((codes[:, k:] != 0).any()):
        return "padding bits set"
    return None


def record_span(numel: int, record: int) -> tuple[int, int]:
    """(first byte, length of the chunk) of record number ``record`` of an encoded tensor of ``numel`` values."""
    full, rest = chunk_lengths(numel)
    if record < full:
        return record * record_bytes(CHUNK), CHUNK
    return full * record_bytes(CHUNK), rest


@torch.no_grad()
def decode(encoded: torch.Tensor, numel: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """The fp32 values of checked records (``out`` when given: ``numel`` values, any shape); zero where nothing
    was kept."""
    flat = torch.zeros(numel, dtype=torch.float32)
    start = 0
    for records, length in _records(encoded, numel):
        k = kept(length)
        low, high, positions, codes = _fields(records, length)
        positions, codes = positions[:, :k].to(torch.int64), codes[:, :k]
        magnitude = torch.where((codes & 2).bool(), high.unsqueeze(1), low.unsqueeze(1))
        value = torch.where((codes & 1).bool(), -magnitude, magnitude)
        chunks = records.shape[0]
        block = flat[start : start + chunks * length].view(chunks, length)
        block.scatter_(1, positions, value)
        start += chunks * length
    if out is None:
        return flat
    out.view(-1).copy_(flat)
    return out
