"""The node as its gRPC service sees it (rpc/service.PeerNode): sessions from the pairing strategy, the joiner
snapshot, and a partner's payload made whole by the strategy and then admitted (payload_admission.py).

Every answer here comes from a published copy or from thread-safe tables, never from the live replica.
"""

from __future__ import annotations

from collections.abc import Callable

from noloco_node.node.payload_admission import PayloadAdmission
from noloco_node.node.run_layout import RunLayout
from noloco_node.pairing.standing import Standing
from noloco_node.pairing.strategy import PairingStrategy
from noloco_node.rpc.contracts import ExchangeSession, OutOfReachError
from noloco_node.security.payload_guard import RunningGap
from noloco_node.wire import peer_pb2 as pb
from noloco_node.wire.frames import PayloadError, PayloadKind
from noloco_node.wire.payload import Payload
from noloco_node.wire.published import LatestSnapshot, Published
from noloco_node.wire.receive_buffers import ReceiveBuffers


class ServedNode:
    def __init__(
        self,
        layout: RunLayout,
        *,
        peer_id: Callable[[], str],
        strategy: PairingStrategy,
        snapshot: LatestSnapshot,
        admission: PayloadAdmission,
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
        self.admission = admission
        self.standing = standing
        self.receive_buffers = receive_buffers
        self._info = info
        self._outer_step = outer_step  # the replica's, read from another thread (an int: nothing is torn)
        self.max_staleness = max_staleness
        self._kinds = layout.payload_kinds()
        self._choosing_kind = layout.partner_choosing_kind()

    @property
    def peer_id(self) -> str:
        return self._peer_id()

    def payload_kinds(self) -> list[PayloadKind]:
        return self._kinds

    def max_payload_bytes(self) -> int:
        return self.layout.max_payload_bytes()

    def open_session(self, partner_id: str, partner_outer_step: int, kind: str) -> ExchangeSession | None:
        """A session from the strategy, or None (busy). A stranger is served only with this node's stranger turn
        (pairing/standing.py); a reserved round's payload (sync, stream) is exchanged with the partner the
        reservation chose, so the standing of that partner was weighed when the reservation was taken. A partner
        further than --max-staleness outer steps away is told so, with this node's step (OutOfReachError), in every
        mode."""
        self.standing.heard_from(partner_id)  # its id is proven (the caller proof), whatever this node answers
        own = self._outer_step()
        if own is not None and abs(partner_outer_step - own) > self.max_staleness:
            raise OutOfReachError(own, partner_outer_step, self.max_staleness)
        if kind != self._choosing_kind:
            return self.strategy.open_session(partner_id, partner_outer_step, kind)
        if not self.standing.may_serve(partner_id):
            return None
        session = self.strategy.open_session(partner_id, partner_outer_step, kind)
        if session is not None:
            self.standing.spend_stranger_turn(partner_id)
        return session

    def info(self) -> pb.InfoReply:
        return self._info()

    def state_snapshot(self) -> Published | None:
        return self.snapshot.hold()

    def admit(self, payload: Payload) -> Payload:
        """The payload to blend: made whole by the strategy (a stream run's progress rebuilt into the partner's
        theta), then admitted under the norm bound."""
        return self.admission.admit(self.strategy.complete_payload(payload))

    def value_observer(self) -> RunningGap | None:
        return self.admission.value_observer()

    def refused_peer(self, partner_id: str) -> bool:
        return self.admission.policy.quarantined(partner_id)

    def bad_payload(self, partner_id: str, error: PayloadError) -> None:
        self.admission.bad_payload(partner_id, error)
