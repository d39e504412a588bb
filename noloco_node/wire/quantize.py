"""Blockwise absmax quantization of payload tensors: the ``int8`` and ``int4`` wire dtypes.

Streaming DiLoCo (arXiv 2501.18512) sends its outer gradients in 4 bits without loss of quality, and INTELLECT-1
sent int8 pseudo-gradients; both quantize in blocks so that one large value costs precision only in its own
block. Here a tensor is flattened and cut into blocks of ``BLOCK`` values (the last one may be shorter). Each block
stores one fp32 scale, its largest magnitude divided by ``qmax``, and one code per value, rounded to nearest:

- ``int8``: codes in [-127, 127], one byte each (-128 is never written, and refused on receipt);
- ``int4``: codes in [-7, 7], stored as code + 8 in a nibble, two values per byte, the lower nibble first
  (nibble 0, which would be -8, is never written and refused on receipt).

The encoded bytes of a tensor are its scales (little-endian fp32, one per block) followed by its codes, so that a
receiver checks the scales before any code arrives. Decoding is ``code * scale`` in fp32. The CPU path is
vectorised torch (a few passes over the tensor, no Python loop per block): bitsandbytes and torchao's kernels are
GPU-first and would add a dependency to every node for a path that runs on the host anyway (the outer state and
the exchange live in host memory, docs/architecture.md).
"""

from __future__ import annotations

import math

import torch

BLOCK = 256
QMAX = {"int8": 127, "int4": 7}


def is_quantized(wire_dtype: str) -> bool:
    return wire_dtype in QMAX


def num_blocks(numel: int) -> int:
    return math.ceil(numel / BLOCK)


def code_bytes(numel: int, wire_dtype: str) -> int:
    return numel if wire_dtype == "int8" else math.ceil(numel / 2)


def encoded_bytes(numel: int, wire_dtype: str) -> int:
    """Bytes on the wire for a tensor of ``numel`` values: the scales, then the codes."""
    return 4 * num_blocks(numel) + code_bytes(numel, wire_dtype)


def _padded_blocks(flat: torch.Tensor) -> torch.Tensor:
    """The values as (blocks, BLOCK) fp32, the last block padded with zeros."""
    numel = flat.numel()
    blocks = num_blocks(numel)
    if blocks * BLOCK == numel:
        return flat.to(torch.float32).view(blocks, BLOCK)
    padded = torch.zeros(blocks * BLOCK, dtype=torch.float32)
    padded[:numel] = flat
    return padded.view(blocks, BLOCK)


@torch.no_grad()
def quantize_into(values: torch.Tensor, wire_dtype: str, out: torch.Tensor) -> None:
    """Encode ``values`` (any float dtype, any shape, finite) into ``out``: uint8 of ``encoded_bytes`` length."""
    qmax = QMAX[wire_dtype]
    flat = values.detach().reshape(-1).to("cpu")
    numel = flat.numel()
    if out.dtype != torch.uint8 or out.numel() != encoded_bytes(numel, wire_dtype):
        raise ValueError(f"out must be uint8 of {encoded_bytes(numel, wire_dtype)} bytes")
    blocks = _padded_blocks(flat)
    scales = blocks.abs().amax(dim=1).div_(qmax)
    # A block of zeros keeps scale 0 (it decodes to zeros); dividing by 1 there avoids 0/0.
    divisor = torch.where(scales > 0, scales, torch.ones_like(scales))
    # One scratch tensor, rounded and clamped in place: the encode is on the critical path of every outer step.
    scaled = torch.div(blocks, divisor.unsqueeze(1)).round_().clamp_(-qmax, qmax).view(-1)
    scale_bytes = 4 * scales.numel()
    out[:scale_bytes].copy_(scales.view(torch.uint8))
    if wire_dtype == "int8":
        out[scale_bytes:].copy_(scaled[:numel].to(torch.int8).view(torch.uint8))
        return
    # Nibbles are code + 8 (1..15); a padding value (past numel, inside the last block) is code 0, nibble 8.
    nibbles = scaled.add_(8).to(torch.uint8)
    if nibbles.numel() % 2:
        nibbles = torch.cat((nibbles, torch.full((1,), 8, dtype=torch.uint8)))
    pairs = nibbles[: 2 * code_bytes(numel, wire_dtype)].view(-1, 2)
    torch.bitwise_or(pairs[:, 0], pairs[:, 1].bitwise_left_shift(4), out=out[scale_bytes:])


def quantize(values: torch.Tensor, wire_dtype: str) -> torch.Tensor:
    out = torch.empty(encoded_bytes(values.numel(), wire_dtype), dtype=torch.uint8)
    quantize_into(values, wire_dtype, out)
    return out


def scales_of(encoded: torch.Tensor, numel: int) -> torch.Tensor:
    """The fp32 scales at the head of an encoded tensor (a view, not a copy)."""
    return encoded[: 4 * num_blocks(numel)].view(torch.float32)


def codes_of(encoded: torch.Tensor, numel: int, wire_dtype: str) -> torch.Tensor:
    """The codes of an encoded tensor as int8 values in [-qmax, qmax] (int4 is unpacked into a new tensor)."""
    raw = encoded[4 * num_blocks(numel) :]
    if wire_dtype == "int8":
        return raw.view(torch.int8)
    unpacked = torch.stack((raw & 0x0F, raw >> 4), dim=1).view(-1)[:numel]
    return unpacked.to(torch.int8) - 8


@torch.no_grad()
def dequantize(encoded: torch.Tensor, numel: int, wire_dtype: str, out: torch.Tensor | None = None) -> torch.Tensor:
    """Decode an encoded tensor into fp32 (``out`` when given: ``numel`` values, any shape)."""
    scales = scales_of(encoded, numel)
    codes = codes_of(encoded, numel, wire_dtype)
    blocks = num_blocks(numel)
    if blocks * BLOCK == numel:
        decoded = codes.view(blocks, BLOCK).to(torch.float32).mul_(scales.unsqueeze(1)).view(-1)
    else:
        decoded = codes.to(torch.float32).mul_(scales.repeat_interleave(BLOCK)[:numel])
    if out is None:
        return decoded
    out.view(-1).copy_(decoded)
    return out


def bad_codes(raw: torch.Tensor, wire_dtype: str) -> bool:
    """Whether some code bytes hold a value an encoder never writes (-128 in int8, nibble 0 in int4): a sender that
    writes them is not this format, and its values would fall outside its own scales."""
    if wire_dtype == "int8":
        return bool((raw.view(torch.int8) == -128).any())
    return bool(((raw & 0x0F) == 0).any() or ((raw >> 4) == 0).any())


def bad_scales(scales: torch.Tensor) -> bool:
    """Scales must be finite and not negative (zero: an all-zero block)."""
    return not bool(torch.isfinite(scales).all()) or bool((scales < 0).any())
