"""The node as its gRPC service sees it (rpc/service.PeerNode): sessions from the pairing strategy, the joiner
snapshot, and the admission of a partner's payload.

Every answer here comes from a published copy or from thread-safe tables, never from the live replica: the norm
check compares a partner's tensors with the slow weights of the latest published state (held while it reads), so
it can run in any thread while the trainer applies its outer step.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from noloco_node.node.outer_step import held_outer_state, partner_tensors
from noloco_node.node.run_layout import RunLayout
from noloco_node.node.security import NodeSecurity
from noloco_node.pairing.peer_policy import PeerPolicy
from noloco_node.pairing.standing import Standing
from noloco_node.pairing.strategy import PairingStrategy
from noloco_node.rpc.contracts import ExchangeSession, OutOfReachError
from noloco_node.security.payload_guard import RunningGap
from noloco_node.wire import peer_pb2 as pb
from noloco_node.wire.frames import PayloadError, PayloadKind
from noloco_node.wire.payload import Payload, ReceiveBuffers
from noloco_node.wire.published import Latest, Published

# The payload kinds whose exchange makes the caller a partner (sync's and overlap's weights, a stream run's phase
# swap); a stream run's progress goes only to the partner its phase swap chose.
PARTNER_CHOOSING_KINDS = ("weights", "phase")


class ServedNode:
    def __init__(
        self,
        layout: RunLayout,
        *,
        peer_id: Callable[[], str],
        strategy: PairingStrategy,
        snapshot: Latest,
        security: NodeSecurity,
        policy: PeerPolicy,
        standing: Standing,
        receive_buffers: ReceiveBuffers,
        info: Callable[[], pb.InfoReply],
        outer_step: Callable[[], int | None],
        max_staleness: int,
    ) -> None:
        self.layout = layout
        self.run_fingerprint = layout.run_fingerprint
        self._peer_id = peer_id
        self.strategy = strategy
        self.snapshot = snapshot
        self.security = security
        self.policy = policy
        self.standing = standing
        self.receive_buffers = receive_buffers
        self._info = info
        self._outer_step = outer_step  # the replica's, read from another thread (an int: nothing is torn)
        self.max_staleness = max_staleness
        self._kinds = layout.payload_kinds()

    @property
    def peer_id(self) -> str:
        return self._peer_id()

    def payload_kinds(self) -> list[PayloadKind]:
        return self._kinds

    def max_payload_bytes(self) -> int:
        return self.layout.max_payload_bytes()

    def open_session(self, partner_id: str, partner_outer_step: int, kind: str) -> ExchangeSession | None:
        """A session from the strategy, or None (busy). A stranger is served only in this node's stranger steps
        (pairing/standing.py); a stream run's progress is exchanged with the partner its phase swap reserved, so
        the standing of that partner was weighed when the swap was taken. A partner further than --max-staleness
        outer steps away is told so, with this node's step (OutOfReachError), in every mode."""
        own = self._outer_step()
        if own is not None and abs(partner_outer_step - own) > self.max_staleness:
            raise OutOfReachError(own, partner_outer_step, self.max_staleness)
        if kind in PARTNER_CHOOSING_KINDS and not self.standing.may_serve(partner_id):
            return None
        return self.strategy.open_session(partner_id, partner_outer_step, kind)

    def info(self) -> pb.InfoReply:
        return self._info()

    def state_snapshot(self) -> Published | None:
        return self.snapshot.hold()

    def admit(self, payload: Payload) -> Payload:
        """The payload to blend: completed by the strategy (a stream run's progress rebuilt into the partner's
        theta), then under the norm bound (payload_guard.py): the partner's tensors against this node's latest
        slow weights. A payload that arrives before this node has a bound (an overlap offer during its first phase)
        is accepted unjudged, and judged by the trainer before it is blended (:meth:`judge`)."""
        payload = self.strategy.complete_payload(payload)
        if self.security.norm_guard.bound() is None:
            payload.unjudged = True
            return payload
        try:
            self._check(payload)
        except PayloadError:
            payload.release()
            raise
        return payload

    def judge(self, payload: Payload) -> bool:
        """Trainer thread: whether an unjudged payload passes the norm bound now; one that fails is held against
        its sender like any refused payload."""
        try:
            self._check(payload)
        except PayloadError as refused:
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
        measured = self._measured_distances(payload)
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
                send_phi="phi" in parts,
                send_delta="delta" in parts,
            )
            comparisons = [(theirs, phi, phi) for theirs in (theta, partner_phi) if theirs]
            if partner_delta:
                comparisons.append((partner_delta, delta, phi))
            self.security.admit(payload, comparisons, steps_apart)
        finally:
            copy.release()

    @staticmethod
    def _measured_distances(payload: Payload) -> list[float] | None:
        if not isinstance(payload.observer, RunningGap):
            return None
        numel: dict[str, int] = {}
        for name, tensor in payload.tensors.items():
            part = name.split("/", 1)[0]
            numel[part] = numel.get(part, 0) + tensor.numel()
        distances = payload.observer.distances(numel)
        return None if distances is None else list(distances.values())

    def refused_peer(self, partner_id: str) -> bool:
        return self.policy.quarantined(partner_id)

    def bad_payload(self, partner_id: str, error: PayloadError) -> None:
        self.security.bad_payload(partner_id, error, self.policy)
