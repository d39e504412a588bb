"""The rotated modulo code: a tensor sent in a few levels per value and decoded against the receiver's own copy.

Two paired replicas hold slow weights that differ by far less than the weights themselves. A receiver that holds
``own`` needs only where ``sent`` lies relative to it, so the sender can send each value modulo a few steps of a
grid whose step follows the *gap* between the two, not the weights (Moniqua, arXiv 2002.11787; Wyner-Ziv coding
with side information). Here, per chunk of ``CHUNK`` values:

1. **Rotation.** Both sides flip the signs of their values with a shared pseudo-random pattern and apply the
   orthonormal Walsh-Hadamard transform, so the gap's coordinates are near Gaussian with the chunk's RMS gap
   (a single large coordinate no longer sets the grid).
2. **Sketch.** The first ``SKETCH`` rotated coordinates cross exactly (fp32) from both sides; each side then knows
   the chunk's RMS gap (the RMS of the sketches' difference) without a round trip per value, and the sender sets
   the grid's step to ``STEP_IN_GAPS`` times it.
3. **Code.** Each rotated value is rounded on that grid shifted by a shared dither (uniform in one step, so the
   rounding error is uniform and independent of the weights) and sent modulo ``LEVELS``: 3 levels, five to a
   byte (1.6 bits a value).
4. **Decode.** The receiver takes, of the values the code allows, the one nearest its own rotated value. That is
   the sender's grid value (within half a step of the sender's value) for every coordinate whose gap is under
   one step, and ``LEVELS`` steps off for most of those whose gap is over two (with the step at ``STEP_IN_GAPS``
   RMS gaps, a Gaussian tail of about 1% of coordinates). It then shrinks the decoded gap to its own value by
   :data:`SHRINK` (the gap's least-squares estimate given the rounding) and rotates back.

The simulator's ``noloco-sparse-side`` methods use it for phi at every outer step (simulate/wire_views.py); what it
costs and saves: docs/algorithm-study.md, "Sparse progress".

All randomness (signs, dither) comes from a seed both sides derive from what they share, so nothing of it crosses.
The functions here are pure: no state, no I/O.
"""

from __future__ import annotations

import math

import torch

CHUNK = 4096  # values per rotation (a power of two: the Walsh-Hadamard transform's size)
SKETCH = 16  # rotated coordinates per chunk sent exactly, from which both sides read the chunk's gap
LEVELS = 3
STEP_IN_GAPS = 2.25  # the grid's step in RMS gaps: a gap under one step decodes exactly
VALUES_PER_BYTE = 5  # 3**5 = 243 <= 256
# The decoded gap is the true gap plus the grid's rounding, uniform over one step (variance step**2 / 12); with the
# gap itself of variance 1 (in RMS gaps), its least-squares estimate is the decoded gap times this factor.
SHRINK = 1.0 / (1.0 + STEP_IN_GAPS**2 / 12.0)


def encoded_bytes(numel: int) -> int:
    """Bytes of one tensor of ``numel`` values: the sketch (fp32) and the codes, five to a byte."""
    chunks = math.ceil(numel / CHUNK)
    return chunks * SKETCH * 4 + math.ceil(chunks * CHUNK / VALUES_PER_BYTE)


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


def sketch(rows: torch.Tensor) -> torch.Tensor:
    return rows[:, :SKETCH].clone()


def grid_step(sent_sketch: torch.Tensor, own_sketch: torch.Tensor) -> torch.Tensor:
    """Per chunk, the grid's step both sides compute from the two sketches, as a (chunks, 1) fp64 column; 0 for a
    chunk whose sketches are equal (the receiver then keeps its own values there)."""
    gap = (sent_sketch.double() - own_sketch.double()).pow(2).mean(dim=1).sqrt()
    return (gap * STEP_IN_GAPS).unsqueeze(1)


def encode(rows: torch.Tensor, step: torch.Tensor, seed: int) -> torch.Tensor:
    """The codes (0..LEVELS-1, int64 here; five to a byte on the wire) of rotated ``rows``. In fp64: a gap many
    orders of magnitude below the weights still rounds on its own grid."""
    divisor = torch.where(step > 0, step, torch.ones_like(step))
    level = torch.round(rows.double() / divisor + _dither(rows.shape[0], seed).double())
    return torch.remainder(level, LEVELS).to(torch.int64)


def decode(codes: torch.Tensor, step: torch.Tensor, own_rows: torch.Tensor, seed: int) -> torch.Tensor:
    """The sender's rotated rows as the receiver holding ``own_rows`` reads them: of the grid values the codes
    allow, the nearest to its own (exact up to the rounding while the gap is under one step), fp32."""
    dither = _dither(own_rows.shape[0], seed).double()
    divisor = torch.where(step > 0, step, torch.ones_like(step))
    own = own_rows.double() / divisor + dither
    level = codes.double()
    nearest = level + LEVELS * torch.round((own - level) / LEVELS)
    decoded = ((nearest - dither) * divisor).float()
    return torch.where(step > 0, decoded, own_rows)


def receive(sent: torch.Tensor, own: torch.Tensor, seed: int) -> torch.Tensor:
    """What a receiver holding ``own`` reads of ``sent`` sent in this code (both tensors of one shape): the whole
    round trip of one tensor, sketch included. The decoded gap to ``own`` is shrunk by :data:`SHRINK`, its
    least-squares estimate given the rounding."""
    sent_rows, own_rows = rotate(sent, seed), rotate(own, seed)
    sent_sketch = sketch(sent_rows)
    step = grid_step(sent_sketch, sketch(own_rows))
    rows = decode(encode(sent_rows, step, seed), step, own_rows, seed)
    rows = own_rows + SHRINK * (rows - own_rows)
    rows[:, :SKETCH] = sent_sketch
    return unrotate(rows, seed, sent)
