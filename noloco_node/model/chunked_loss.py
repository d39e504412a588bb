"""Next-token cross-entropy straight from the last hidden states, one chunk of rows at a time.

The plain loss computes the logits of every token (batch x seq x vocab), copies them to fp32 and keeps them for the
backward pass: with a 32k vocabulary and 32 x 1,024 tokens that is 4 GiB of fp32 logits, more than the model's
own activations at 125m. Here the output projection and the loss are one autograd function: the forward pass takes
the rows in chunks of about :data:`CHUNK_ELEMENTS` logits, computes each chunk's logits in the compute dtype, its
loss in fp32, and, when gradients are wanted, its gradients with respect to the hidden states and the projection
right away (softmax minus one-hot, the usual closed form). No chunk's logits outlive it; what is kept for the
backward pass is one hidden-sized gradient and one projection-sized gradient (the approach of Liger Kernel's fused
linear cross-entropy). Its maths is the plain loss's: ``tests/unit/test_step_plan.py`` holds the two against each other.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

# Logits computed at a time: 2^25 fp32 values (128 MiB) keep the projection's matmuls large enough to run at speed.
CHUNK_ELEMENTS = 1 << 25


def compute_dtype(device: torch.device) -> torch.dtype:
    """The dtype matmuls run in here: autocast's where it is on (bf16 on CUDA, docs/architecture.md), else fp32."""
    if torch.is_autocast_enabled(device.type):
        return torch.get_autocast_dtype(device.type)
    return torch.float32


def linear_cross_entropy(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *, compiled: bool = False
) -> torch.Tensor:
    """Mean cross-entropy in nats of ``hidden @ weight.T`` against ``targets``, in fp32, without all the logits.

    ``hidden`` is (..., width), ``weight`` (vocab, width), ``targets`` the token ids of the same leading shape.
    ``compiled``: each chunk's elementwise work (log-sum-exp, softmax, the one-hot) fused by ``torch.compile``, as
    the compiled decoder blocks are (the matmuls are the same either way)."""
    dtype = compute_dtype(hidden.device)
    rows = hidden.reshape(-1, hidden.shape[-1]).to(dtype)
    flat_targets = targets.reshape(-1)
    projection = weight.to(dtype)
    if not torch.is_grad_enabled() or not (rows.requires_grad or projection.requires_grad):
        with torch.no_grad():
            return _loss_only(rows, projection, flat_targets)
    chunk_step = _compiled_chunk_step() if compiled else _chunk_step
    loss: torch.Tensor = _LinearCrossEntropy.apply(rows, projection, flat_targets, chunk_step)
    return loss


def _chunk_rows(vocab: int) -> int:
    return max(1, CHUNK_ELEMENTS // vocab)


def _loss_only(rows: torch.Tensor, projection: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    total = torch.zeros((), dtype=torch.float32, device=rows.device)
    step = _chunk_rows(projection.shape[0])
    for start in range(0, rows.shape[0], step):
        logits = (rows[start : start + step] @ projection.T).float()
        total += F.cross_entropy(logits, targets[start : start + step], reduction="sum")
    return total / rows.shape[0]


def _chunk_step(
    chunk: torch.Tensor, projection: torch.Tensor, targets: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One chunk's summed loss and the gradients of that sum with respect to the chunk and the projection:
    d(loss)/d(logits) = softmax - one_hot, the closed form of cross-entropy's gradient."""
    logits = (chunk @ projection.T).float()
    log_norm = torch.logsumexp(logits, dim=-1)
    loss = (log_norm - logits.gather(1, targets[:, None]).squeeze(1)).sum()
    grad_logits = torch.exp(logits - log_norm[:, None])
    grad_logits[torch.arange(chunk.shape[0], device=chunk.device), targets] -= 1.0
    grad_logits = grad_logits.to(chunk.dtype)
    return loss, grad_logits @ projection, (grad_logits.T @ chunk).float()


_COMPILED: list[ChunkStep] = []


def _compiled_chunk_step() -> ChunkStep:
    if not _COMPILED:
        _COMPILED.append(torch.compile(_chunk_step, dynamic=False))
    return _COMPILED[0]


ChunkStep = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


class _LinearCrossEntropy(torch.autograd.Function):
    """The loss and both gradients in one pass over the chunks (gradients scaled in backward by its incoming one)."""

    @staticmethod
    def forward(
        ctx: Any, rows: torch.Tensor, projection: torch.Tensor, targets: torch.Tensor, chunk_step: ChunkStep
    ) -> torch.Tensor:
        count = rows.shape[0]
        step = _chunk_rows(projection.shape[0])
        total = torch.zeros((), dtype=torch.float32, device=rows.device)
        grad_rows = torch.empty_like(rows)
        grad_projection = torch.zeros(projection.shape, dtype=torch.float32, device=projection.device)
        for start in range(0, count, step):
            loss, grad_chunk, grad_weight = chunk_step(
                rows[start : start + step], projection, targets[start : start + step]
            )
            total += loss
            grad_rows[start : start + step] = grad_chunk
            grad_projection += grad_weight
        ctx.save_for_backward(grad_rows, grad_projection.to(projection.dtype))
        ctx.count = count
        return total / count

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None, None]:
        grad_rows, grad_projection = ctx.saved_tensors
        scale = grad_output / ctx.count  # the chunks' gradients are of the summed loss
        return grad_rows * scale.to(grad_rows.dtype), grad_projection * scale.to(grad_projection.dtype), None, None
