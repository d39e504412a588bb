"""What each NoLoCo method of the simulator puts on the wire: what a partner blends with, and its bytes.

Dense methods (arXiv 2506.10911, eq. 3-5 with the partner's tensors as a wire delivers them):

- ``noloco``: exact fp32 (the maths alone); ``noloco-bf16/int8/int4``: the ``sync`` mode, theta (and phi when the
  run needs it) sent whole in that wire dtype;
- ``noloco-stream[-int8|-int4]``: the ``stream`` mode: phi, fixed during the phase, crosses in bf16 while the
  replicas train; at the outer step only Delta = theta - phi (bf16 or quantized); the receiver rebuilds theta as
  phi + Delta.

Sparse methods (``noloco-sparse-*``, wire/sparse.py): Delta crosses as top-k per chunk with 2-bit values, the
part left out kept by its sender and added to its next phase's progress (error feedback). Both sides of a pair blend
with the two *compressed* Deltas, so that what one side adds of the other is exactly what the other sent (as in
SparseLoCo, where every replica applies the same sparse mean). With gamma == beta the pair step is

    delta_i = alpha * delta_i + beta/2 * (D_i + D_j) + beta/2 * (phi_j - phi_i)          (D: compressed Delta)

and only the last term needs the partner's slow weights, the dense part of every exchange. The variants send phi
(int8, which costs nothing measurable: docs/algorithm-study.md) every K outer steps (``-phiK``) or never
(``noloco-sparse``: pairwise-gossiped pseudo-gradients alone, with nothing pulling the replicas together); between
those steps a replica takes the partner's phi as its own, which drops the pull term and nothing else. A replica
with no partner sends nothing, so it applies all its progress and residual.
"""

from __future__ import annotations

import torch

from noloco_node import algorithm
from noloco_node.wire import quantize, sparse

# Per dense NoLoCo method: the wire dtype of theta and phi sent whole (sync), or of Delta when phi is streamed.
WIRE_OF_METHOD: dict[str, tuple[str, str | None]] = {
    "noloco": ("fp32", None),
    "noloco-momentum": ("fp32", None),
    "noloco-bf16": ("bf16", None),
    "noloco-int8": ("int8", None),
    "noloco-int4": ("int4", None),
    "noloco-stream": ("bf16", "bf16"),
    "noloco-stream-int8": ("bf16", "int8"),
    "noloco-stream-int4": ("bf16", "int4"),
}

# Per sparse method: how many outer steps apart phi crosses (in int8), None for never.
PHI_EVERY: dict[str, int | None] = {
    "noloco-sparse": None,
    "noloco-sparse-phi1": 1,
    "noloco-sparse-phi4": 4,
    "noloco-sparse-phi8": 8,
    "noloco-sparse-phi16": 16,
}
SPARSE_PHI_DTYPE = "int8"


def through_wire(tensors: list[torch.Tensor], wire_dtype: str) -> list[torch.Tensor]:
    """What a receiver reads of ``tensors`` sent in ``wire_dtype``: exact in fp32, rounded in bf16, blockwise
    quantized and decoded in int8/int4 (wire/quantize.py, the node's own codec)."""
    if wire_dtype == "fp32":
        return tensors
    if wire_dtype == "bf16":
        return [t.to(torch.bfloat16).to(torch.float32) for t in tensors]
    return [quantize.dequantize(quantize.quantize(t, wire_dtype), t.numel(), wire_dtype).view_as(t) for t in tensors]


def partner_view(
    method: str, theta: list[torch.Tensor], phi: list[torch.Tensor]
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The (fast, slow) weights a partner blends with, as a dense method's wire delivers them."""
    sync_wire, stream_wire = WIRE_OF_METHOD[method]
    if stream_wire is None:
        return through_wire(list(theta), sync_wire), through_wire(list(phi), sync_wire)
    seen_phi = through_wire(list(phi), "bf16")
    seen_delta = through_wire(algorithm.phase_progress(theta, phi), stream_wire)
    return algorithm.fast_weights_from(seen_phi, seen_delta), seen_phi


def _dense_bytes(numels: list[int], wire_dtype: str) -> float:
    """Bytes of tensors of these sizes in a dense wire dtype."""
    if quantize.is_quantized(wire_dtype):
        return float(sum(quantize.encoded_bytes(n, wire_dtype) for n in numels))
    return float(sum(n * (4 if wire_dtype == "fp32" else 2) for n in numels))


def bytes_per_parameter(method: str, numels: list[int], *, sends_phi: bool) -> tuple[float, float] | None:
    """(in all, on the critical path) bytes one replica sends its partner per parameter per outer step, for a
    NoLoCo method on a model of tensors of ``numels`` values; None for methods without pairs. ``sends_phi``: the
    sync mode's partner needs phi too (gamma != beta)."""
    total = float(sum(numels))
    if method in PHI_EVERY:
        every = PHI_EVERY[method]
        progress = sum(sparse.encoded_bytes(n) for n in numels) / total
        phi = 0.0 if every is None else _dense_bytes(numels, SPARSE_PHI_DTYPE) / total / every
        return progress + phi, progress
    if method not in WIRE_OF_METHOD:
        return None
    sync_wire, stream_wire = WIRE_OF_METHOD[method]
    if stream_wire is None:
        momenta = method == "noloco-momentum"  # theta, phi and delta
        parts = 1 + int(sends_phi or momenta) + int(momenta)
        whole = _dense_bytes(numels, sync_wire) / total * parts
        return whole, whole
    progress = _dense_bytes(numels, stream_wire) / total
    return progress + _dense_bytes(numels, "bf16") / total, progress


def sparse_pair_steps(
    groups: list[list[int]],
    thetas: list[list[torch.Tensor]],
    phis: list[list[torch.Tensor]],
    deltas: list[list[torch.Tensor]],
    feedback: list[sparse.ErrorFeedback],
    *,
    phi_round: bool,
    alpha: float,
    beta: float,
    gamma: float,
) -> dict[int, tuple[list[torch.Tensor], list[torch.Tensor]]]:
    """Each replica's (new phi, new delta) for one outer step of a sparse method; the residuals are committed
    here (every replica's step is computed from the state before the round). A replica with no partner sends
    nothing: its residual waits for the next one."""
    sent: dict[int, tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor] | None]] = {}
    residuals: dict[int, list[torch.Tensor]] = {}
    for group in groups:
        if len(group) < 2:
            continue
        for i in group:
            progress = algorithm.phase_progress(thetas[i], phis[i])
            _, decoded, residuals[i] = feedback[i].compress(progress)
            left_out = [d - s for d, s in zip(progress, decoded, strict=True)]
            sent[i] = (decoded, left_out, through_wire(list(phis[i]), SPARSE_PHI_DTYPE) if phi_round else None)
    results = {}
    for group in groups:
        for i in group:
            partners, partner_phis = [], []
            if len(group) == 2:
                j = next(j for j in group if j != i)
                partner_progress, _, partner_phi = sent[j]
                seen_phi = partner_phi if partner_phi is not None else list(phis[i])
                partners = [algorithm.compressed_partner_weights(seen_phi, partner_progress, sent[i][1])]
                partner_phis = [seen_phi]
            results[i] = algorithm.noloco_outer_step(
                list(thetas[i]), phis[i], deltas[i], partners, partner_phis, alpha=alpha, beta=beta, gamma=gamma
            )
    for i, residual in residuals.items():
        feedback[i].commit(residual)
    return results
