"""The pairing state shared by the gRPC worker threads, the trainer thread and the event loop.

sync mode (DESIGN.md): a :class:`PairingRound` is one outer step's chance to pair. Its exchange lock is only
ever *tried*: whoever holds it (an incoming call or this node's own call) is the one exchange in flight, and every
other call is refused at once, so two nodes that call each other simultaneously cannot deadlock. The first
exchange that completes sets the partner; closing the round waits for an exchange still streaming (bounded by its
deadline) so that a payload is never half-applied.

overlap mode: an :class:`OfferBook` keeps the freshest offer received from each peer during the inner phase; at
the outer step the node takes the freshest one within the staleness bound and the book is emptied.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from noloco_node.rpc.client import Outgoing
from noloco_node.wire.payload import Payload


@dataclass
class PairingRound:
    """One outer step's chance to pair: at most one exchange at a time, the first complete one wins."""

    outer_step: int
    outgoing: Outgoing
    # The last partner is not taken again before this (monotonic) time when others may become ready: nodes that
    # blend together restart together and would otherwise stay phase-locked in the same pairs forever.
    last_partner: str | None = None
    repeat_after: float = 0.0
    lock: threading.Lock = field(default_factory=threading.Lock)
    guard: threading.Lock = field(default_factory=threading.Lock)
    partner: Payload | None = None
    closed: bool = False
    done: threading.Event = field(default_factory=threading.Event)

    @property
    def open(self) -> bool:
        return not self.closed and self.partner is None

    def may_pair_with(self, peer_id: str) -> bool:
        return peer_id != self.last_partner or time.monotonic() >= self.repeat_after

    def try_session(self, partner_id: str, partner_outer_step: int, max_staleness: int) -> RoundSession | None:
        """A session for an incoming call, or None (busy, closed, paired, too far apart, or a too-early repeat)."""
        with self.guard:
            if not self.open or abs(partner_outer_step - self.outer_step) > max_staleness:
                return None
            if not self.may_pair_with(partner_id):
                return None
            if not self.lock.acquire(blocking=False):
                return None
        return RoundSession(self)

    def set_partner(self, payload: Payload) -> None:
        with self.guard:
            if self.partner is None:
                self.partner = payload
                self.done.set()

    def close(self, wait_for_exchange: float) -> Payload | None:
        """Refuse new exchanges, let one in flight finish (at most ``wait_for_exchange`` s); returns the partner."""
        with self.guard:
            self.closed = True
        if self.lock.acquire(timeout=wait_for_exchange):
            self.lock.release()
        return self.partner


class RoundSession:
    """The ExchangeSession of a pairing round, holding the round's exchange lock until released."""

    def __init__(self, pairing_round: PairingRound) -> None:
        self.round = pairing_round

    def outgoing(self) -> Outgoing:
        return self.round.outgoing

    def complete(self, payload: Payload) -> None:
        self.round.set_partner(payload)

    def release(self) -> None:
        self.round.lock.release()


class OfferBook:
    """overlap mode: this node's current offer, one exchange at a time, and the freshest offer of each peer."""

    def __init__(self) -> None:
        self.offer: Outgoing | None = None
        self.exchange_lock = threading.Lock()
        self._guard = threading.Lock()
        self._received: dict[str, Payload] = {}

    def try_session(self) -> OfferSession | None:
        offer = self.offer
        if offer is None or not self.exchange_lock.acquire(blocking=False):
            return None
        return OfferSession(self, offer)

    def store(self, payload: Payload) -> None:
        with self._guard:
            known = self._received.get(payload.peer_id)
            if known is None or known.outer_step <= payload.outer_step:
                self._received[payload.peer_id] = payload

    def take_freshest(self, own_outer_step: int, max_staleness: int) -> Payload | None:
        """The freshest offer within the staleness bound; every held offer is dropped (each is used once)."""
        with self._guard:
            fresh = [p for p in self._received.values() if own_outer_step - p.outer_step <= max_staleness]
            self._received = {}
        return max(fresh, key=lambda p: p.outer_step) if fresh else None


class OfferSession:
    """The ExchangeSession of overlap mode: swap offers, keep the partner's for the next blend."""

    def __init__(self, book: OfferBook, offer: Outgoing) -> None:
        self.book = book
        self.offer = offer

    def outgoing(self) -> Outgoing:
        return self.offer

    def complete(self, payload: Payload) -> None:
        self.book.store(payload)

    def release(self) -> None:
        self.book.exchange_lock.release()
