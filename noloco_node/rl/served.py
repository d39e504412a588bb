"""An RL node as its gRPC service sees it (rpc/contracts.py's PeerNode): it exchanges no weights and serves no
state, so every Exchange is refused (FAILED_PRECONDITION ``payload_layout``: this node accepts no payload kind) and
GetState finds nothing; Info says its round; GetRollouts is served from its
book (rpc/rollout_serving.py).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import grpc

from noloco_node.rpc.contracts import ExchangeSession, HeldPayload
from noloco_node.wire import peer_pb2 as pb
from noloco_node.wire.frames import PayloadError, PayloadKind
from noloco_node.wire.payload import Payload, ValueObserver
from noloco_node.wire.receive_buffers import ReceiveBuffers


class RolloutPeerNode:
    def __init__(self, run_fingerprint: str, peer_id: Callable[[], str], info: Callable[[], pb.InfoReply]) -> None:
        self.run_fingerprint = run_fingerprint
        self._peer_id = peer_id
        self._info = info
        self.receive_buffers = ReceiveBuffers(max_idle_bytes=0)

    @property
    def peer_id(self) -> str:
        return self._peer_id()

    def payload_kinds(self) -> Sequence[PayloadKind]:
        return ()

    def max_payload_bytes(self) -> int:
        return 0

    def open_session(self, partner_id: str, partner_outer_step: int, kind: str) -> ExchangeSession | None:
        return None

    def info(self) -> pb.InfoReply:
        return self._info()

    def state_snapshot(self) -> HeldPayload | None:
        return None

    def value_observer(self) -> ValueObserver | None:
        return None

    def admit(self, payload: Payload) -> Payload:
        raise PayloadError(grpc.StatusCode.FAILED_PRECONDITION, "payload_layout", "an RL node blends no weights")

    def refused_peer(self, partner_id: str) -> bool:
        return False

    def bad_payload(self, partner_id: str, error: PayloadError) -> None:
        return None
