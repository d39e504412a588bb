"""Whether a partner's payload may be blended: the norm bound (security/payload_guard.py) measured against this
node's latest published slow weights, on whichever side of the exchange the payload arrived (the caller's,
pairing/caller.py, or the server's, served.py), and what a refused one costs its sender.

Everything here reads a published copy or thread-safe tables, never the live replica: the copy is held while it is
read, so a check can run in any thread while the trainer applies its outer step.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import torch

from noloco_node.node.outer_step import held_outer_state, partner_tensors
from noloco_node.node.run_layout import RunLayout
from noloco_node.node.security import Comparison, Distance, NodeSecurity
from noloco_node.pairing.peer_policy import LOSS_CHECK, PeerPolicy
from noloco_node.pairing.standing import Standing
from noloco_node.rpc.metrics import ExchangeMetrics
from noloco_node.security.payload_guard import NORM_BOUND, RunningGap, relative_norms
from noloco_node.wire.frames import PayloadError
from noloco_node.wire.payload import Payload
from noloco_node.wire.published import LatestSnapshot

# Refusals by the loss check, with no blend taken between, before a partner is set aside (refuse_blend).
LOSS_CHECK_STRIKES = 2
MAX_STRIKES_TRACKED = 4096  # partners with a strike remembered: keys cost nothing, the oldest are forgotten
MAX_FAR_GROUPS = 1024  # network groups remembered as refused under the norm bound (node/probation.py reads them)


class PayloadAdmission:
    def __init__(
        self,
        layout: RunLayout,
        *,
        snapshot: LatestSnapshot,
        security: NodeSecurity,
        policy: PeerPolicy,
        standing: Standing,
        metrics: ExchangeMetrics,
    ) -> None:
        self.layout = layout
        self.metrics = metrics
        self._strikes: dict[str, int] = {}  # refusals by the loss check since the partner's last blend taken
        # Each network group refused under the norm bound, and when (a count of refusals): a downloaded state's
        # probation asks how many groups found it far since. By group, not key: free keys cost nothing.
        self._far_groups: dict[str, int] = {}
        self._far_refusals = 0
        self._far_lock = threading.Lock()  # refusals happen on gRPC threads, the caller's and the trainer
        self.snapshot = snapshot
        self.security = security
        self.policy = policy
        self.standing = standing

    def admit(self, payload: Payload) -> Payload:
        """A whole payload (completed by the strategy where it needs to be) under the norm bound
        (payload_guard.py): the partner's tensors against this node's latest slow weights. A payload that arrives
        before this node has a bound (an overlap offer during its first phase) is accepted unjudged, and judged by
        the trainer before it is blended (:meth:`judge`)."""
        if self.security.norm_guard.bound() is None:
            payload.unjudged = True
            return payload
        try:
            self._check(payload)
        except PayloadError as refused:
            if refused.reason == NORM_BOUND:
                self._refused_far(payload.peer_id)
            payload.release()
            raise
        return payload

    def far_groups_since(self, mark: int) -> int:
        """How many network groups this node refused under the norm bound after its ``mark``-th such refusal."""
        with self._far_lock:
            return sum(1 for refused_at in self._far_groups.values() if refused_at > mark)

    @property
    def far_refusals(self) -> int:
        """Refusals under the norm bound so far: a mark for :meth:`far_groups_since`."""
        return self._far_refusals

    def _refused_far(self, peer_id: str) -> None:
        group = self.standing.group_of(peer_id)
        if group is None:  # a key whose record this node never saw is in no group: it counts for nothing
            return
        with self._far_lock:
            self._far_refusals += 1
            self._far_groups.pop(group, None)
            self._far_groups[group] = self._far_refusals  # the newest last: the oldest is forgotten first
            while len(self._far_groups) > MAX_FAR_GROUPS:
                del self._far_groups[next(iter(self._far_groups))]

    def judge(self, payload: Payload) -> bool:
        """Trainer thread: whether an unjudged payload passes the norm bound now; one that fails is held against
        its sender like any refused payload."""
        try:
            self._check(payload)
        except PayloadError as refused:
            if refused.reason == NORM_BOUND:
                self._refused_far(payload.peer_id)
            self.bad_payload(payload.peer_id, refused)
            return False
        payload.unjudged = False
        return True

    def value_observer(self) -> RunningGap | None:
        """For one incoming payload: the norm bound's distances measured as its chunks arrive, against the latest
        published state (held until the payload is complete or dropped)."""
        copy = self.snapshot.hold()
        if copy is None:
            return None
        phi, delta = held_outer_state(copy, len(self.layout.names))
        references: dict[str, torch.Tensor] = {}
        for name, own_phi, own_delta in zip(self.layout.names, phi, delta, strict=True):
            references[f"theta/{name}"] = references[f"phi/{name}"] = own_phi.reshape(-1)
            references[f"delta/{name}"] = own_delta.reshape(-1)
        return RunningGap(references, copy.release)

    def _check(self, payload: Payload) -> None:
        # Since when the two replicas last shared weights: the norm bound allows for their drift meanwhile.
        steps_apart = self.standing.steps_apart(payload.peer_id)
        # A sparse run's phi is still in the code that only this node's phi reads: the rest is judged now, and all of
        # it by the trainer once it has read phi (pairing/stream.py compressed_partner).
        coded = bool(payload.side_coded)
        measured = None if coded else self._measured_distances(payload, self.layout.names)
        if measured is not None:  # measured chunk by chunk while it arrived: nothing left to compute
            self.security.admit_distances(payload, measured, steps_apart)
            return
        count = len(self.layout.names)
        copy = self.snapshot.hold()
        if copy is None:
            return  # still starting: nothing to compare with, and nothing will be blended before there is
        try:
            phi, delta = held_outer_state(copy, count)
            parts = payload.parts
            theta, partner_phi, partner_delta = partner_tensors(
                payload,
                self.layout.names,
                send_theta="theta" in parts,
                send_phi="phi" in parts and not coded,
                send_delta="delta" in parts,
            )
            names = self.layout.names
            comparisons: list[Comparison] = [(theta, phi, phi, names)] if theta else []
            if partner_phi:
                comparisons.append((partner_phi, phi, phi, None))
            if partner_delta:
                comparisons.append((partner_delta, delta, phi, None))
            self.security.admit(payload, comparisons, steps_apart)
            if "progress" in parts:  # a sparse run's progress, judged as a phase's progress of this node would be
                progress = [payload.tensors[f"progress/{name}"] for name in names]
                overall, per_tensor = relative_norms(progress, phi)
                tensors = list(zip(names, per_tensor, strict=True))
                self.security.admit_distances(payload, [(overall, tensors)], steps_apart)
        finally:
            copy.release()
        payload.unjudged = coded

    @staticmethod
    def _measured_distances(payload: Payload, names: Sequence[str]) -> list[Distance] | None:
        """The distances measured while the payload arrived: one per part, and for theta each tensor's too."""
        if not isinstance(payload.observer, RunningGap):
            return None
        numel: dict[str, int] = {}
        for name, tensor in payload.tensors.items():
            part = name.split("/", 1)[0]
            numel[part] = numel.get(part, 0) + tensor.numel()
        distances = payload.observer.distances(numel)
        if distances is None:
            return None
        return [
            (distance, list(zip(names, payload.observer.tensor_distances(part, names), strict=True)))
            if part == "theta"
            else (distance, None)
            for part, distance in distances.items()
        ]

    def bad_payload(self, partner_id: str, error: PayloadError) -> None:
        self.security.bad_payload(partner_id, error, self.policy)

    def refuse_blend(self, partner_id: str, message: str) -> None:
        """Trainer thread: a partner whose blend failed the loss check (node/blend_check.py), after an exchange
        both sides committed: counted (rejection ``loss_check``), and at its LOSS_CHECK_STRIKES-th refusal with no
        blend taken between, set aside like one refused for the norm bound (a stream run swaps no phase with it
        meanwhile, pairing/stream.py). Not at the first: an honest compressed blend now and then measures worse on
        one side alone (with an earlier sparse wire's error feedback a 3-node swarm that set aside each of those
        blended at 57% of its outer steps); a partner that sends harm sends it every time."""
        self.metrics.rejection(LOSS_CHECK)
        strikes = self._strikes.pop(partner_id, 0) + 1
        if strikes < LOSS_CHECK_STRIKES:
            self._strikes[partner_id] = strikes  # the newest last: the oldest is forgotten first
            while len(self._strikes) > MAX_STRIKES_TRACKED:
                del self._strikes[next(iter(self._strikes))]
            self.security.complaints.complain(partner_id, LOSS_CHECK, f"{message}; not blended")
            return
        self.security.set_aside(partner_id, LOSS_CHECK, message, self.policy)

    def blend_taken(self, partner_id: str) -> None:
        """Trainer thread: a blend with this partner passed the loss check; its strikes start again."""
        self._strikes.pop(partner_id, None)
