"""What the peer service (rpc/service.py) and its client need from the node: the service's method names, the
payloads it sends, the session of one exchange, and the node it serves. Protocols only, so that the rpc layer
depends on no node.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

from noloco_node.errors import NolocoError
from noloco_node.wire import peer_pb2 as pb
from noloco_node.wire.frames import PayloadError, PayloadKind, TensorLayout
from noloco_node.wire.payload import Payload, ValueObserver
from noloco_node.wire.receive_buffers import ReceiveBuffers

# The service of proto/noloco/v1/peer.proto. Frames cross gRPC as encoded bytes (wire/frames.py writes them,
# wire/payload.py reads them), so the streaming methods are registered and called without protobuf
# (de)serializers; a client built from the generated stubs still interoperates: the bytes are the proto's own.
SERVICE = "noloco.v1.Peer"
EXCHANGE_METHOD = f"/{SERVICE}/Exchange"
GET_STATE_METHOD = f"/{SERVICE}/GetState"
INFO_METHOD = f"/{SERVICE}/Info"
GET_ROLLOUTS_METHOD = f"/{SERVICE}/GetRollouts"
GET_RECEIPTS_METHOD = f"/{SERVICE}/GetReceipts"
SEEN_AS_HEADER = "noloco-seen-as"  # trailing metadata of Info: the caller's address as the server sees it
OUTER_STEP_HEADER = "noloco-outer-step"  # trailing metadata of an out-of-reach refusal: the server's outer step


class OutOfReachError(NolocoError):
    """A pairing call from a peer further than --max-staleness outer steps from this node: refused with
    OUT_OF_RANGE and this node's outer step, so that a caller left behind learns it from the live swarm, not only
    from DHT records that may lag a step."""

    def __init__(self, outer_step: int, partner_outer_step: int, max_staleness: int) -> None:
        super().__init__(
            f"out of reach: this node is at outer step {outer_step}, the caller at {partner_outer_step} "
            f"(--max-staleness {max_staleness})"
        )
        self.outer_step = outer_step


class OutgoingPayload(Protocol):
    """What a node sends in one exchange or download: a manifest and its tensors, which nobody writes meanwhile
    (a static payload, or a wire/published.py copy held for the stream)."""

    @property
    def manifest(self) -> pb.Manifest: ...

    @property
    def tensors(self) -> Sequence[Any]: ...


class HeldPayload(OutgoingPayload, Protocol):
    """An outgoing payload held for one reader, who releases it when done (a wire/published.py copy)."""

    def release(self) -> None: ...


class ExchangeSession(Protocol):
    """The node's side of one exchange, served or initiated; handed out only when the node can pair now."""

    def outgoing(self) -> OutgoingPayload: ...

    def complete(self, payload: Payload) -> bool:
        """The partner's verified payload, which the partner has committed to: take it to blend with (atomically)
        and return True, or return False (the round closed meanwhile: the payload is let go) and the exchange is
        not committed on either side."""

    def release(self) -> None:
        """The exchange is over, whatever its outcome; the node may pair again."""


class PeerNode(Protocol):
    """What the gRPC service needs from the node it serves."""

    @property
    def run_fingerprint(self) -> str: ...

    @property
    def peer_id(self) -> str: ...

    @property
    def receive_buffers(self) -> ReceiveBuffers:
        """Reused from one exchange to the next."""

    def payload_kinds(self) -> Sequence[PayloadKind]:
        """The payloads a peer may send in an exchange (their tensors and wire dtype); anything else is refused
        (FAILED_PRECONDITION ``payload_layout`` or ``wire_dtype`` for another configuration's)."""

    def max_payload_bytes(self) -> int: ...

    def open_session(self, partner_id: str, partner_outer_step: int, kind: str) -> ExchangeSession | None:
        """A session for an exchange of payloads of ``kind`` if this node can exchange with that partner now; None
        means busy (ABORTED); raises OutOfReachError for a partner too many outer steps away (OUT_OF_RANGE)."""

    def info(self) -> pb.InfoReply: ...

    def state_snapshot(self) -> HeldPayload | None:
        """The full replica state at the last outer step, held for one joiner's download (the service releases
        it); None when there is none yet."""

    def value_observer(self) -> ValueObserver | None:
        """For one incoming payload: what sees its values as they arrive (the norm bound's distances), or None."""

    def admit(self, payload: Payload) -> Payload:
        """The payload to hand to the session (for a stream run's progress, assembled with the partner's phase
        payload), or PayloadError if it must still not be blended (the norm bound); on an error nothing is kept."""

    def refused_peer(self, partner_id: str) -> bool:
        """True for a peer this node no longer exchanges with (it sent a bad payload recently)."""

    def bad_payload(self, partner_id: str, error: PayloadError) -> None:
        """A partner's payload was refused for its content (already counted): log it and avoid the partner."""


class AdmitsEverything:
    """PeerNode defaults for nodes without an admission policy (benchmarks, test doubles): one kind of payload,
    ``expected_layout()`` in ``wire_dtype``; every verified payload is admitted and no peer is refused."""

    wire_dtype: str
    expected_layout: Callable[[], Sequence[TensorLayout]]  # the double's one payload, defined by each double

    def payload_kinds(self) -> list[PayloadKind]:
        return [PayloadKind("weights", tuple(self.expected_layout()), self.wire_dtype)]

    def value_observer(self) -> ValueObserver | None:
        return None

    def admit(self, payload: Payload) -> Payload:
        return payload

    def refused_peer(self, partner_id: str) -> bool:
        return False

    def bad_payload(self, partner_id: str, error: PayloadError) -> None:
        return None
