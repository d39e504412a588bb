"""The rotated modulo code: a tensor sent in a few levels per value and decoded against the receiver's own copy.

Two paired replicas hold slow weights that differ by far less than the weights themselves. A receiver that holds
``own`` needs only where ``sent`` lies relative to it, so the sender can send each value modulo a few steps of a
grid whose step follows the *gap* between the two, not the weights (Moniqua, arXiv 2002.11787; Wyner-Ziv coding
with side information). Per chunk of ``CHUNK`` values:

1. **Rotation.** Both sides flip the signs of their values with a shared pseudo-random pattern and apply the
   orthonormal Walsh-Hadamard transform, so the gap's coordinates are near Gaussian with the chunk's RMS gap
   (a single large coordinate no longer sets the grid).
2. **Sketch and step.** The first ``SKETCH`` rotated coordinates cross exactly (fp32): the receiver measures the
   chunk's RMS gap as the RMS of the two sketches' difference. The grid's step is the sender's choice, sent with
   the chunk: ``STEP_IN_GAPS`` times its estimate of the gap, made from the gaps it measured in the codes it
   received (the swarm's replicas are about as far apart from one another as from any partner; the simulator
   averages the last measurement with the estimate before it), or 0 when it has none (the chunk's codes then say
   nothing, and it costs its bytes all the same: sizes follow from the shape).
3. **Code.** Each rotated value is rounded on that grid shifted by a shared dither (uniform in one step, so the
   rounding error is uniform and independent of the weights) and sent modulo ``LEVELS``: 3 levels, five to a
   byte (1.6 bits a value).
4. **Decode.** The receiver takes, of the values the code allows, the one nearest its own rotated value: the
   sender's grid value (within half a step of the sender's value) for every coordinate whose gap is under one
   step, and ``LEVELS`` steps off for most of those whose gap is over two. It then shrinks the decoded gap to its
   own value by its least-squares factor given the rounding, ``1 / (1 + s**2 / 12)`` with ``s`` the step in
   measured gaps, and rotates back. The error is then 0.63-0.66 of the gap for any step from 2 to 3 measured gaps
   (0.74 at 1.75, 0.85 at 1.5: the wraps take over); a chunk whose step is under ``MIN_STEP_IN_GAPS`` measured
   gaps, or 0, is not decoded: the receiver keeps its own values there, which miss by the whole gap.

**Wire form** (:func:`pack`, :func:`unpack`): one record of ``RECORD_BYTES`` per chunk (the last chunk padded with
zeros, so the size follows from the shape): the 16 sketch values and the step (fp32, little end first), then the
codes, five to a byte as base-3 digits, the lowest first (820 bytes; the last holds one code, its other four digits
0). :func:`bad_records` refuses a sketch value or step that is not finite, a negative step, a byte above 242 and a
padding digit set.

A stream run with ``--wire-dtype sparse`` sends its phi in it at every phase (pairing/stream.py; the simulator's
``noloco-sparse-side``, and its variants in simulate/wire_views.py); what it costs and saves: docs/algorithm-study.md,
"Sparse progress". Small and one-dimensional tensors (:func:`side_coded`) travel in int8 instead: their bytes are
negligible, and a chunk padded from a few values would cost a whole record.

All randomness (signs, dither) comes from a seed both sides derive from what they share (:func:`seed_of`: the run,
the sender, its outer step, the tensor), so nothing of it crosses. The functions here are pure: no state, no I/O.
"""

from __future__ import annotations

import hashlib
import math
import struct
from dataclasses import dataclass

import torch

CHUNK = 4096  # values per rotation (a power of two: the Walsh-Hadamard transform's size)
SKETCH = 16  # rotated coordinates per chunk sent exactly, from which the receiver measures the chunk's gap
LEVELS = 3
VALUES_PER_BYTE = 5  # 3**5 = 243 <= 256
STEP_IN_GAPS = 2.5  # the sender's step in its estimated RMS gaps: the middle of the flat 2-3 (module docstring)
MIN_STEP_IN_GAPS = 1.75  # a step under this many measured RMS gaps decodes worse than the flat range: not decoded


CODE_BYTES = math.ceil(CHUNK / VALUES_PER_BYTE)  # 820: the last byte holds one code, its other four digits 0
RECORD_BYTES = (SKETCH + 1) * 4 + CODE_BYTES  # per chunk: the sketch, the step (fp32, little end first), the codes
MAX_CODE_BYTE = LEVELS**VALUES_PER_BYTE - 1  # 242


def side_coded(shape: tuple[int, ...] | torch.Size) -> bool:
    """Whether a tensor of ``shape`` travels in this code: a matrix of at least one chunk (the rest go in int8)."""
    return len(shape) >= 2 and math.prod(shape) >= CHUNK


def seed_of(run_fingerprint: str, sender: str, outer_step: int, tensor_index: int) -> int:
    """The seed of one tensor's signs and dither, from what both sides of an exchange know: the run, the sender's
    peer id, the outer step its payload is for, the tensor's place in it (63 bits of a SHA-256)."""
    digest = hashlib.sha256(b"noloco-side-info-v1")
    for text in (run_fingerprint, sender):
        data = text.encode()
        digest.update(struct.pack("<Q", len(data)) + data)
    digest.update(struct.pack("<QQ", outer_step, tensor_index))
    return int.from_bytes(digest.digest()[:8], "little") >> 1


def encoded_bytes(numel: int) -> int:
    """Bytes of one tensor of ``numel`` values: one record per chunk (the last chunk padded with zeros, so every
    record has one size)."""
    return math.ceil(numel / CHUNK) * RECORD_BYTES


_SIDE = 64  # CHUNK = _SIDE * _SIDE: the transform is H_64 (x) H_64, two small matrix products per chunk


def _hadamard(n: int) -> torch.Tensor:
    """The orthonormal Sylvester-Hadamard matrix of size ``n`` (a power of two)."""
    matrix = torch.ones(1, 1)
    while matrix.shape[0] < n:
        matrix = torch.cat((torch.cat((matrix, matrix), 1), torch.cat((matrix, -matrix), 1)), 0)
    return matrix / math.sqrt(n)


_H = _hadamard(_SIDE)


def _walsh_hadamard(rows: torch.Tensor) -> torch.Tensor:
    """The orthonormal Walsh-Hadamard transform of each row of a (chunks, CHUNK) fp32 tensor (its own inverse)."""
    square = rows.view(-1, _SIDE, _SIDE)
    return (_H @ square @ _H).reshape(rows.shape)


def _signs(chunks: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 2, (chunks, CHUNK), generator=generator).to(torch.float32).mul_(2).sub_(1)


def _dither(chunks: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed ^ 0x5DEECE66D)
    return torch.rand((chunks, CHUNK), generator=generator)


def rotate(values: torch.Tensor, seed: int) -> torch.Tensor:
    """``values`` (any shape) as (chunks, CHUNK) rotated fp32 rows, the last chunk padded with zeros."""
    flat = values.reshape(-1).to(torch.float32)
    chunks = math.ceil(flat.numel() / CHUNK)
    padded = torch.nn.functional.pad(flat, (0, chunks * CHUNK - flat.numel())).view(chunks, CHUNK)
    return _walsh_hadamard(padded * _signs(chunks, seed))


def unrotate(rows: torch.Tensor, seed: int, like: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`rotate`, shaped like ``like``."""
    flat = (_walsh_hadamard(rows) * _signs(rows.shape[0], seed)).view(-1)
    return flat[: like.numel()].view(like.shape)


@dataclass(frozen=True)
class Coded:
    """One tensor in the code: per chunk its sketch (chunks, SKETCH) and step (chunks,), fp32, and its codes
    (chunks, CHUNK), each in 0..LEVELS-1 (five to a byte on the wire)."""

    sketch: torch.Tensor
    step: torch.Tensor
    codes: torch.Tensor


def encode(values: torch.Tensor, gap_estimate: torch.Tensor | None, seed: int) -> Coded:
    """``values`` in the code, its step ``STEP_IN_GAPS`` times ``gap_estimate`` per chunk (None: no estimate yet,
    every step 0). The grid arithmetic is fp64: a gap many orders of magnitude below the weights still rounds on
    its own grid."""
    rows = rotate(values, seed)
    chunks = rows.shape[0]
    estimate = torch.zeros(chunks) if gap_estimate is None else gap_estimate.to(torch.float32).reshape(chunks)
    step = (estimate * STEP_IN_GAPS).to(torch.float32)
    divisor = torch.where(step > 0, step, torch.ones_like(step)).double().unsqueeze(1)
    level = torch.round(rows.double() / divisor + _dither(chunks, seed).double())
    codes = torch.remainder(level, LEVELS).to(torch.uint8)
    return Coded(sketch=rows[:, :SKETCH].clone(), step=step, codes=torch.where(step.unsqueeze(1) > 0, codes, 0))


def decode(coded: Coded, own: torch.Tensor, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(the sender's values as the receiver holding ``own`` reads them, shaped like ``own``; the RMS gap measured
    in each chunk, (chunks,) fp32). A chunk whose step is under MIN_STEP_IN_GAPS measured gaps keeps ``own``."""
    own_rows = rotate(own, seed)
    gap = (coded.sketch.double() - own_rows[:, :SKETCH].double()).pow(2).mean(dim=1).sqrt()
    step = coded.step.double()
    decodable = (step > 0) & (step >= MIN_STEP_IN_GAPS * gap)
    divisor = torch.where(step > 0, step, torch.ones_like(step)).unsqueeze(1)
    dither = _dither(own_rows.shape[0], seed).double()
    reference = own_rows.double() / divisor + dither
    level = coded.codes.double()
    nearest = level + LEVELS * torch.round((reference - level) / LEVELS)
    # Two copies whose sketches agree are taken to be equal (shrink 0): the sketch's coordinates are a random
    # projection of the whole chunk's gap.
    in_gaps = step / torch.where(gap > 0, gap, torch.ones_like(gap))
    shrink = torch.where(gap > 0, 1.0 / (1.0 + in_gaps.pow(2) / 12.0), torch.zeros_like(gap)).unsqueeze(1)
    decoded = own_rows.double() + shrink * ((nearest - dither) * divisor - own_rows.double())
    decoded[:, :SKETCH] = coded.sketch.double()
    rows = torch.where(decodable.unsqueeze(1), decoded, own_rows.double()).float()
    return unrotate(rows, seed, own), gap.float()


def pack(coded: Coded) -> torch.Tensor:
    """The wire bytes of ``coded``: per chunk its sketch and step (fp32) and its codes, five to a byte (code k of
    a byte is its base-3 digit k, the lowest first), flat uint8."""
    chunks = coded.codes.shape[0]
    digits = torch.zeros(chunks, CODE_BYTES * VALUES_PER_BYTE, dtype=torch.int32)
    digits[:, :CHUNK] = coded.codes.to(torch.int32)
    weights = LEVELS ** torch.arange(VALUES_PER_BYTE, dtype=torch.int32)
    codes = (digits.view(chunks, CODE_BYTES, VALUES_PER_BYTE) * weights).sum(dim=2).to(torch.uint8)
    sketch = coded.sketch.to(torch.float32).contiguous().view(torch.uint8).view(chunks, SKETCH * 4)
    step = coded.step.to(torch.float32).reshape(chunks, 1).contiguous().view(torch.uint8)
    return torch.cat((sketch, step, codes), dim=1).view(-1)


def _fields(records: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sketch, step, code bytes) of (chunks, RECORD_BYTES) records."""
    chunks = records.shape[0]
    sketch = records[:, : SKETCH * 4].contiguous().view(torch.float32).view(chunks, SKETCH)
    step = records[:, SKETCH * 4 : (SKETCH + 1) * 4].contiguous().view(torch.float32).view(chunks)
    return sketch, step, records[:, (SKETCH + 1) * 4 :]


def bad_records(records: torch.Tensor) -> str | None:
    """Why complete (chunks, RECORD_BYTES) uint8 records are not this format, or None when they are."""
    sketch, step, codes = _fields(records)
    if not bool(torch.isfinite(sketch).all()):
        return "a NaN or infinite sketch value"
    if not bool(torch.isfinite(step).all()) or bool((step < 0).any()):
        return "a NaN, infinite or negative step"
    if bool((codes > MAX_CODE_BYTE).any()):
        return f"a code byte above {MAX_CODE_BYTE}"
    if bool((codes[:, -1] >= LEVELS).any()):  # CHUNK = 5 * 819 + 1: the last byte's other digits are padding
        return "padding digits set"
    return None


def unpack(encoded: torch.Tensor, numel: int) -> Coded:
    """The :class:`Coded` of a tensor of ``numel`` values from its checked wire bytes (:func:`bad_records`)."""
    records = encoded.view(math.ceil(numel / CHUNK), RECORD_BYTES)
    sketch, step, codes = _fields(records)
    chunks = records.shape[0]
    weights = LEVELS ** torch.arange(VALUES_PER_BYTE, dtype=torch.int32)
    digits = (codes.to(torch.int32).unsqueeze(2) // weights) % LEVELS
    return Coded(sketch=sketch.clone(), step=step.clone(), codes=digits.view(chunks, -1)[:, :CHUNK].to(torch.uint8))
