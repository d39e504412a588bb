"""How a node calls its peers, whatever the pairing strategy: whom to call first, and one exchange call.

:class:`PeerCaller` chooses among the run's live peers (ready, reachable, not avoided or quarantined, within the
staleness bound), orders them by standing (standing.py: partners least recently paired first, strangers
only with this node's stranger turn) and makes one exchange call: on the node's own bounded exchange executor
(never asyncio's default one, which status fetches share), under a deadline learnt from earlier exchanges
(peer_policy.py). The partner's payload must then pass the node's
admission check (the norm bound); a refusal is counted and held against the partner, whose id here is the one its
DHT record was signed with and whose server answered as that id (rpc/client.py).

Memory is bounded by the live swarm: what is remembered of a peer (when it was last paired) is forgotten once
the peer has left the DHT.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol

import grpc

from noloco_node.discovery.dht import PeerRecord
from noloco_node.pairing.peer_policy import PeerPolicy
from noloco_node.pairing.standing import Standing
from noloco_node.rpc.client import UNACKNOWLEDGED, CallOwner, ExchangeError, exchange_with
from noloco_node.rpc.contracts import OutgoingPayload
from noloco_node.rpc.metrics import ExchangeMetrics
from noloco_node.rpc.transport import Transport
from noloco_node.security.receipts import Receipt
from noloco_node.wire.frames import PayloadError, PayloadKind
from noloco_node.wire.payload import Payload, ValueObserver
from noloco_node.wire.published import Published
from noloco_node.wire.receive_buffers import ReceiveBuffers

log = logging.getLogger(__name__)


@dataclass
class CallSettings:
    """What every exchange call of a node shares."""

    run_fingerprint: str
    kinds: dict[str, PayloadKind]  # the run's payloads by kind (node/run_layout.py); an answer is of the same kind
    choosing_kind: str  # the kind whose exchange makes the callee a partner (node/run_layout.py)
    max_payload_bytes: int
    max_staleness: int
    transport: Transport
    metrics: ExchangeMetrics
    receive_buffers: ReceiveBuffers
    receipts: Callable[[Receipt], None] | None = None  # where the receipts of this node's calls go


class PeerPaths(Protocol):
    """How peers are reached (node/reach.py): an unreachable one through the relays its record names."""

    def learn(self, peers: Sequence[PeerRecord]) -> None: ...

    async def prepare(self, peer: PeerRecord) -> str | None:
        """The gRPC address to dial ``peer`` at now (its own, or a tunnel's local endpoint), or None when there is
        no way to it."""
        ...


class DirectOnly:
    """Reachable peers only (benchmarks' bare callers, which hold no tunnels)."""

    def learn(self, peers: Sequence[PeerRecord]) -> None:
        pass

    async def prepare(self, peer: PeerRecord) -> str | None:
        return peer.address if peer.reachable else None


class PeerCaller:
    def __init__(
        self,
        settings: CallSettings,
        policy: PeerPolicy,
        standing: Standing,
        *,
        admit: Callable[[Payload], Payload],
        bad_payload: Callable[[str, PayloadError], None],
        executor: ThreadPoolExecutor,
        observer: Callable[[], ValueObserver | None] = lambda: None,
        on_peer_step: Callable[[str, int], None] = lambda _peer, _step: None,
        on_view: Callable[[list[PeerRecord]], None] = lambda _peers: None,
        paths: PeerPaths | None = None,
    ) -> None:
        self.settings = settings
        self.paths = paths or DirectOnly()
        self.policy = policy
        self.standing = standing
        self.admit = admit
        self.observer = observer  # a partner's payload measured as it arrives (the norm bound's distances)
        self.bad_payload = bad_payload
        self.executor = executor
        self.on_peer_step = on_peer_step  # a peer that refused this node as out of reach said where it is
        # The live peers as pairing sees them, for the node's view of where its peers are (observability/telemetry.py:
        # catch-up reads it); the status watch's lookups alone lag pairing's by seconds.
        self.on_view = on_view
        self.last_paired: dict[str, int] = {}  # peer id -> outer step of the last blend; live peers only

    def choosable(self, peers: Sequence[PeerRecord], own_step: int) -> list[PeerRecord]:
        """Peers worth calling now; forgets what it knew of peers no longer live (bounded tables)."""
        self.on_view(list(peers))
        live = {p.peer_id for p in peers}
        self.standing.observe(peers, own_step, self.settings.max_staleness)
        self.policy.forget(live)
        for gone in set(self.last_paired) - live:
            del self.last_paired[gone]
        self.paths.learn(peers)
        return [
            p
            for p in peers
            if p.ready
            and p.address
            and (p.reachable or p.relays)
            and not self.policy.avoided(p.peer_id)
            and abs(p.outer_step - own_step) <= self.settings.max_staleness
        ]

    def order(self, candidates: list[PeerRecord]) -> list[PeerRecord]:
        """Whom to call, in order (standing.py): partners least recently paired first, and one stranger
        before them while this node holds a stranger turn (the call spends it)."""
        return self.standing.order(candidates, self.last_paired)

    def paired(self, peer_id: str, outer_step: int) -> None:
        """A blend with ``peer_id`` at this node's ``outer_step``: its payload passed every check."""
        self.last_paired[peer_id] = outer_step
        self.standing.blended(peer_id, outer_step)

    async def call(
        self,
        peer: PeerRecord,
        outgoing: OutgoingPayload,
        kind: str = "weights",
        complete: Callable[[Payload], Payload] | None = None,
    ) -> Payload | None:
        """One exchange of payloads of ``kind`` with ``peer``; its admitted payload, or None (busy, failed, refused:
        recorded; no path to it yet: not a call, nothing recorded). ``complete`` makes the partner's payload whole
        before it is admitted (a stream run's progress, pairing/stream.py)."""
        deadline = self.policy.deadline(peer.peer_id)
        started = time.monotonic()
        loop = asyncio.get_running_loop()
        dial = await self.paths.prepare(peer)
        if dial is None:
            # No way to it yet (an unreachable peer whose record names no relay: it holds them only after its own
            # check): nothing said about the peer, so it is not set aside; it can still call in.
            log.debug("no path to %s yet: its record names no relay", peer.peer_id[-8:])
            return None
        # The call is owned: whenever this coroutine stops waiting (its deadline passed, its task was cancelled: the
        # round closed or the node is stopping), the gRPC call is cancelled and its thread is free at once.
        owner = CallOwner()
        try:
            # The call is bounded by its own gRPC deadline; the outer bound only covers the hand-off to a thread,
            # which is immediate: the executor has a thread for every exchange a node can have in flight.
            payload = await asyncio.wait_for(
                loop.run_in_executor(
                    self.executor, self._exchange, peer, dial, outgoing, kind, deadline, complete, owner
                ),
                timeout=deadline + 5,
            )
        except (ExchangeError, asyncio.TimeoutError) as error:
            owner.cancel()
            if not (isinstance(error, ExchangeError) and error.reason == "busy"):
                self._spend_turn(peer, kind)
            if isinstance(error, ExchangeError) and _answered(error):
                self.standing.heard_from(peer.peer_id)
            self._failed(peer, deadline, error)
            return None
        except asyncio.CancelledError:
            owner.cancel()
            raise
        self._spend_turn(peer, kind)
        self.standing.heard_from(peer.peer_id)
        self.policy.succeeded(peer.peer_id, time.monotonic() - started)
        return payload

    def _spend_turn(self, peer: PeerRecord, kind: str) -> None:
        """A call that chose ``peer`` as a partner, and got more than a busy answer, spends this node's stranger
        turn if ``peer`` is a stranger (standing.py). Not a busy answer (the stranger had no turn of its own, or was
        taken): two members who are strangers to each other, each spending its turn on the other's refusal in
        turn, would never meet."""
        if kind == self.settings.choosing_kind:
            self.standing.spend_stranger_turn(peer.peer_id)

    def _exchange(
        self,
        peer: PeerRecord,
        dial: str,
        outgoing: OutgoingPayload,
        kind: str,
        deadline: float,
        complete: Callable[[Payload], Payload] | None,
        owner: CallOwner,
    ) -> Payload:
        """Exchange thread: the call, holding the published copy it streams; the partner's payload is admitted
        (the norm bound) before this side commits to it (rpc/client.py)."""
        kind_of = self.settings.kinds[kind]
        if isinstance(outgoing, Published):
            if not outgoing.hold():
                raise ExchangeError(grpc.StatusCode.ABORTED, "busy", "the offer was withdrawn before the call")
            try:
                return self._stream(peer, dial, outgoing, kind_of, deadline, complete, owner)
            finally:
                outgoing.release()
        return self._stream(peer, dial, outgoing, kind_of, deadline, complete, owner)

    def _stream(
        self,
        peer: PeerRecord,
        dial: str,
        outgoing: OutgoingPayload,
        kind: PayloadKind,
        deadline: float,
        complete: Callable[[Payload], Payload] | None,
        owner: CallOwner,
    ) -> Payload:
        settings = self.settings
        admit = self.admit if complete is None else (lambda payload: self.admit(complete(payload)))
        return exchange_with(
            dial,
            outgoing,
            kind.layout,
            answers=[kind],
            run_fingerprint=settings.run_fingerprint,
            max_payload_bytes=settings.max_payload_bytes,
            wire_dtype=kind.wire_dtype,
            timeout=deadline,
            metrics=settings.metrics,
            buffers=settings.receive_buffers,
            peer=peer.peer_id,
            transport=settings.transport,
            observer=self.observer(),
            admit=admit,
            owner=owner,
            receipts=settings.receipts,
        )

    def _failed(self, peer: PeerRecord, deadline: float, error: BaseException) -> None:
        reason = error.reason if isinstance(error, ExchangeError) else "timeout"
        if isinstance(error, ExchangeError) and reason == "out_of_reach":
            if error.peer_outer_step is not None:  # not a failure: the peer is further on (or behind) than its record
                self.on_peer_step(peer.peer_id, error.peer_outer_step)
        elif isinstance(error, ExchangeError) and error.bad_payload is not None:
            if error.bad_payload.blames_sender:
                self.bad_payload(peer.peer_id, error.bad_payload)
        elif reason == UNACKNOWLEDGED:
            # The peer answered with its payload and took this side's commit; only its last frame was lost. Not a
            # peer to set aside: its next round pairs with it again.
            log.warning("exchange with %s: no acknowledgement (%s)", peer.peer_id[-8:], error)
        elif reason != "busy":
            avoid = self.policy.failed(peer.peer_id)
            log.warning(
                "exchange with %s failed (%s, deadline %.1fs), avoided for %.0fs: %s",
                peer.peer_id[-8:],
                reason,
                deadline,
                avoid,
                error,
            )


# Codes a silence ends with: no answer from the peer (cut, no route, no answer in time).
SILENT_CODES = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED})


def _answered(error: ExchangeError) -> bool:
    """Whether the peer itself answered the call that ended in ``error`` (busy, out of reach, a refusal, a payload):
    not a silence, and not an answer under another name."""
    return error.code not in SILENT_CODES and not error.reason.startswith("unauthenticated")
