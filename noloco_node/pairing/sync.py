"""``sync`` pairing (the default): the partner is reserved during the inner phase, and at their outer steps the two
exchange their fresh weights and both blend (pairing/reserved.py: draw, then meet).

The reservation payload is one value, ``meet/due``: the seconds until the caller's outer step (negative: not known
yet, before its first phase was measured), taken when it calls, so that the peer it calls can hold the two outer
steps to the meeting window; the node's record says when that step is due (``next_step_at``), so that peers ask only
if they are due near it. The round payload is the ``weights`` payload (theta, with phi and delta when the run
needs them), blended as it came.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from noloco_node.pairing.reserved import Phase, ReservedPairing
from noloco_node.training.replica import Replica
from noloco_node.wire.frames import MEET_DUE
from noloco_node.wire.payload import Payload
from noloco_node.wire.published import Published


class SyncPairing(ReservedPairing):
    mode = "sync"
    reservation_kind = "meet"
    round_kind = "weights"
    meets_by_due_time = True

    def _meeting(self, outer_step: int, seconds_to_step: float | None) -> Published:
        due = torch.tensor([-1.0 if seconds_to_step is None else max(0.0, seconds_to_step)])
        return self.ctx.offers["meet"].publish({"meet": [due]}, outer_step)

    def reservation_offer(
        self, phi: Sequence[torch.Tensor], delta: Sequence[torch.Tensor], outer_step: int, seconds_to_step: float | None
    ) -> Published:
        return self._meeting(outer_step, seconds_to_step)

    def calling_offer(self, phase: Phase) -> Published | None:
        return self._meeting(phase.outer_step, phase.seconds_to_step()) if phase.open else None

    def seconds_to_step(self, reservation: Payload) -> float | None:
        due = float(reservation.tensors[MEET_DUE].reshape(-1)[0])
        return due if math.isfinite(due) and due >= 0 else None

    def round_offer(self, replica: Replica) -> Published:
        return self.ctx.offers["weights"].publish(replica.weights(), replica.outer_step)

    def whole(self, reservation: Payload, payload: Payload) -> Payload:
        reservation.release()
        return payload
