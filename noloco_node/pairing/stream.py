"""``stream`` pairing: the partner is reserved during the inner phase by swapping slow weights, which stream while
both train, and only the phase's progress is exchanged at the outer step (pairing/reserved.py: draw, then meet).

The NoLoCo blend of node i with partner j (arXiv 2506.10911, eq. 3-5) needs j's fast weights theta_j, and its slow
weights phi_j when gamma != beta or momenta are blended. phi_j is fixed for the whole inner phase, and
theta_j = phi_j + Delta_j, where only Delta_j, the phase's progress, waits for the phase's end. So the reservation
payload is the *phase payload* (phi, and delta with --blend-momenta, in bf16), and the round payload is the
*progress* Delta = theta - phi in the run's wire dtype. The partner's theta is rebuilt as phi_j + Delta_j
(:meth:`StreamPairing.whole`) and checked under the norm bound like any partner's weights. A phase payload carries
no due time: a stream pair reserves whenever both are within --max-staleness.

The blend is exact NoLoCo up to the rounding of phi (bf16) and Delta (the wire dtype): the simulator's
``noloco-stream`` methods measure that cost (docs/algorithm-study.md). On the critical path there is only Delta,
which quantizes well (its blocks scale to the progress, not to the weights): int8 is a quarter of the fp32 weights.

With ``--wire-dtype sparse`` (the simulator's ``noloco-sparse-side``): phi crosses at every phase in the
side-information code (pairing/side_phi.py: about 0.22 bytes a value, read against the receiver's own phi), the
progress top-k coded (wire/sparse.py: 0.028 bytes a value, nothing of what it leaves out kept for later), and each
side blends with the partner as :func:`compressed_partner` makes it after the exchange: theta_j = phi_j as read +
D_j + c (Delta_i - D_i) (algorithm.compressed_partner_weights, c = algorithm.OWN_LEFT_OUT_WEIGHT). Read only once the
exchange has settled, the partner's phi is judged then, with the rest of its payload, under the norm bound
(node/outer_step.py); on arrival only its progress is.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from noloco_node import algorithm
from noloco_node.pairing.reserved import ReservedPairing
from noloco_node.pairing.side_phi import SidePhi
from noloco_node.pairing.strategy import PairingContext
from noloco_node.training.replica import Replica
from noloco_node.wire import sparse
from noloco_node.wire.payload import Payload
from noloco_node.wire.published import Published


class StreamPairing(ReservedPairing):
    mode = "stream"
    reservation_kind = "phase"
    round_kind = "progress"

    def __init__(self, ctx: PairingContext) -> None:
        super().__init__(ctx)
        progress = ctx.offers["progress"].kind
        # A sparse run's phi in the side-information code, and what it knows of the replicas' gaps.
        self.side = (
            SidePhi([item.shape for item in progress.layout], ctx.caller.settings.run_fingerprint)
            if progress.wire_dtype == "sparse"
            else None
        )
        self._left_out: list[torch.Tensor] | None = None  # a sparse round's Delta_i - D_i, kept for the blend

    def reservation_offer(
        self, phi: Sequence[torch.Tensor], delta: Sequence[torch.Tensor], outer_step: int, seconds_to_step: float | None
    ) -> Published:
        sent = phi if self.side is None else self.side.encode(phi, self.ctx.peer_id(), outer_step)
        return self.ctx.offers["phase"].publish({"phi": sent, "delta": delta}, outer_step)

    def round_offer(self, replica: Replica) -> Published:
        progress = algorithm.phase_progress(replica.fast_weights(), replica.phi)
        self._left_out = None
        if self.side is not None:  # sent top-k coded: what the code leaves out, Delta_i - D_i, stays here
            encoded = [sparse.encode(whole) for whole in progress]
            self._left_out = [
                whole.sub_(sparse.decode(code, whole.numel()).view_as(whole).to(whole.device))
                for whole, code in zip(progress, encoded, strict=True)
            ]
            progress = encoded
        return self.ctx.offers["progress"].publish({"progress": progress}, replica.outer_step)

    def whole(self, reservation: Payload, payload: Payload) -> Payload:
        """A progress payload becomes the partner's whole payload: theta = phi + Delta (fp32), with the phi (and
        delta) of its phase payload; in a sparse run the progress with that phi still in its code (the trainer
        reads it once the exchange has settled: :func:`compressed_partner`)."""
        pool = self.ctx.caller.settings.receive_buffers
        manifest = payload.manifest
        phase_tensors, phase_buffers = reservation.hand_over()
        progress_tensors, progress_buffers = payload.hand_over()
        if self.side is not None:  # phi stays in its code until the trainer reads it
            tensors = {**progress_tensors, **phase_tensors}
            return Payload(manifest, tensors, buffers=[*phase_buffers, *progress_buffers], pool=pool)
        parameters = [name.split("/", 1)[1] for name in progress_tensors]
        deltas = list(progress_tensors.values())
        buffers = [pool.take(torch.float32, delta.numel()).view(delta.shape) for delta in deltas]
        thetas = algorithm.fast_weights_from([phase_tensors[f"phi/{n}"] for n in parameters], deltas, out=buffers)
        tensors = {f"theta/{n}": theta for n, theta in zip(parameters, thetas, strict=True)}
        tensors.update(phase_tensors)
        rebuilt = [theta.view(-1) for theta in thetas]
        return Payload(manifest, tensors, buffers=[*phase_buffers, *progress_buffers, *rebuilt], pool=pool)

    def finish(self, partner: Payload, replica: Replica) -> None:
        left_out, self._left_out = self._left_out, None
        if self.side is not None and left_out is not None:
            compressed_partner(partner, replica.names, replica.phi, left_out, self.side)

    def checkpoint_state(self) -> dict[str, Any]:
        return {} if self.side is None else {"side_gap_estimates": self.side.state()}

    def restore(self, state: dict[str, Any]) -> None:
        estimates = state.get("side_gap_estimates")
        if self.side is not None and estimates is not None:
            self.side.restore(estimates)


def compressed_partner(
    payload: Payload,
    names: Sequence[str],
    phi: Sequence[torch.Tensor],
    left_out: Sequence[torch.Tensor],
    side: SidePhi,
) -> None:
    """Trainer thread, a sparse run, after the exchange: the partner's payload (progress D_j, phi_j in its code)
    made what this node blends with: phi_j read against this node's ``phi`` (side_phi.py), and
    theta_j = phi_j + D_j + c (Delta_i - D_i), algorithm.compressed_partner_weights computed in the received
    progress's buffers. The payload is left unjudged: its phi was read only now, so the trainer judges all of it
    (node/outer_step.py)."""
    tensors = payload.tensors
    seen = side.read([tensors[f"phi/{name}"] for name in names], phi, payload.peer_id, payload.outer_step)
    sent = [tensors[f"progress/{name}"] for name in names]
    thetas = algorithm.compressed_partner_weights(seen, sent, left_out, algorithm.OWN_LEFT_OUT_WEIGHT, out=sent)
    whole = {f"theta/{name}": theta for name, theta in zip(names, thetas, strict=True)}
    whole.update({f"phi/{name}": read for name, read in zip(names, seen, strict=True)})
    whole.update({name: tensor for name, tensor in tensors.items() if name.startswith("delta/")})
    payload.tensors = whole
    payload.observer = None  # what it measured on arrival was the progress, not these
    payload.unjudged = True
