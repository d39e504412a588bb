"""``sync`` pairing: at its outer step a node pairs with a peer at the same step and both blend fresh weights.

The node opens a :class:`PairingRound` and advertises itself ready. Incoming calls (gRPC threads) and its own
calls to ready peers (event loop) race for the round's exchange lock, which is only ever *tried*, never waited on:
a node busy with one exchange refuses every other call at once (ABORTED), so two nodes calling each other
simultaneously both get a fast refusal and retry after random jitter instead of deadlocking. The first exchange
that both sides commit (rpc/client.py: the caller's verdict, the server's acknowledgement) settles the round with
its partner; ``pair_timeout`` without one, or nobody within reach, settles it alone (a solo step).

The round goes through explicit stages (:class:`Stage`), and the trainer waits on its future, not on a flag.
Closing the round refuses new exchanges and lets one in flight finish, bounded by the exchange ceiling. The
tensors a round sends are a published copy (wire/published.py) held by every stream that reads them, so whatever
the timing of a slow stream against the trainer's next outer step, nothing it sends is ever overwritten.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import random
import threading
import time
from collections.abc import Callable, Coroutine
from concurrent.futures import Future, InvalidStateError
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any

from noloco_node.pairing.strategy import PairingContext, PairingStrategy
from noloco_node.training.replica import Replica
from noloco_node.wire.payload import Payload
from noloco_node.wire.published import Published

log = logging.getLogger(__name__)


class Stage(enum.Enum):
    OPEN = "open"  # looking for a partner; calls are served
    CLOSING = "closing"  # no new exchanges; one in flight may still complete and become the partner
    PAIRED = "paired"  # an exchange completed: the partner is known
    ALONE = "alone"  # closed without a partner: a solo step
    CLOSED = "closed"  # the trainer has taken the answer; nothing changes any more


@dataclass(frozen=True)
class RepeatGrace:
    """The last partner waits its turn, in every mode: while other peers may become ready, a node does not pair with
    its last partner again before ``until`` (monotonic), calling or called. Two nodes that just blended open their
    next rounds (or phases) at the same instant and would otherwise stay locked in the same pairs (stream, 4 nodes:
    two fixed pairs at 60 of 60 outer steps)."""

    last_partner: str | None = None
    until: float = 0.0

    @staticmethod
    def seconds(last_partner: str | None, others: bool, pair_timeout: float, phase_seconds: float) -> float:
        """The grace after a round with ``last_partner``: half a phase (at most half of --pair-timeout) while
        ``others`` may become ready; none after a solo step or with nobody else."""
        return min(pair_timeout / 2, phase_seconds / 2) if last_partner is not None and others else 0.0

    @classmethod
    def starting_now(cls, last_partner: str | None, seconds: float) -> RepeatGrace:
        return cls(last_partner, time.monotonic() + seconds)

    def allows(self, peer_id: str) -> bool:
        return peer_id != self.last_partner or time.monotonic() >= self.until


class PairingRound:
    """One outer step's chance to pair: at most one exchange at a time, the first complete one wins."""

    def __init__(
        self,
        outer_step: int,
        offer: Published,
        *,
        repeat: RepeatGrace = RepeatGrace(),
        only_partner: str | None = None,
    ) -> None:
        self.outer_step = outer_step
        self.offer = offer  # held by the round until it closes
        # Stream mode: the partner chosen during the phase is the only one this round exchanges with.
        self.only_partner = only_partner
        self.repeat = repeat
        self.stage = Stage.OPEN
        self.partner: Payload | None = None
        self.waiting_over: Future[None] = Future()  # the trainer stops waiting: paired, alone, timed out, stopped
        self.lock = threading.Lock()  # the one exchange in flight
        self._guard = threading.Lock()  # the stage

    @property
    def open(self) -> bool:
        return self.stage is Stage.OPEN

    def may_pair_with(self, peer_id: str) -> bool:
        if self.only_partner is not None:
            return peer_id == self.only_partner
        return self.repeat.allows(peer_id)

    def try_session(self, partner_id: str, partner_outer_step: int, max_staleness: int) -> RoundSession | None:
        """A session for an incoming call, or None (busy, closing, too far apart, or a too-early repeat)."""
        with self._guard:
            if not self.open or abs(partner_outer_step - self.outer_step) > max_staleness:
                return None
            if not self.may_pair_with(partner_id) or not self.lock.acquire(blocking=False):
                return None
            if not self.offer.hold():  # cannot happen while open (the round holds it); refuse rather than guess
                self.lock.release()
                return None
        return RoundSession(self)

    def settle(self, partner: Payload) -> bool:
        """A completed exchange: the first one is the partner (until the round is closed); a later one is let go
        (its buffers return to the pool). Returns whether it became the partner."""
        with self._guard:
            first = self.stage in (Stage.OPEN, Stage.CLOSING)
            if first:
                self.stage, self.partner = Stage.PAIRED, partner
        if first:
            self._stop_waiting()
        else:
            partner.release()
        return first

    def stop_waiting(self) -> None:
        """Nobody within reach, the pair timeout, or a stop: no new exchanges; one in flight may still finish."""
        with self._guard:
            if self.stage is Stage.OPEN:
                self.stage = Stage.CLOSING
        self._stop_waiting()

    def _stop_waiting(self) -> None:
        if not self.waiting_over.done():
            with contextlib.suppress(InvalidStateError):  # two threads may get here at once
                self.waiting_over.set_result(None)

    def wait(self, timeout: float, train_step: Callable[[], bool] | None = None) -> None:
        """Trainer thread: until the round is paired or told to stop waiting, at most ``timeout`` s; taking inner
        steps meanwhile while ``train_step`` allows them, then idling."""
        deadline = time.monotonic() + timeout
        while train_step is not None and not self.waiting_over.done() and time.monotonic() < deadline:
            if not train_step():
                break
        try:
            self.waiting_over.result(timeout=max(0.0, deadline - time.monotonic()))
        except FutureTimeout:
            self.stop_waiting()

    def close(self, wait_for_exchange: float) -> Payload | None:
        """Refuse new exchanges, let one in flight finish (at most ``wait_for_exchange`` s); returns the partner."""
        self.stop_waiting()
        if self.lock.acquire(timeout=wait_for_exchange):
            self.lock.release()
        with self._guard:
            partner = self.partner
            self.stage = Stage.CLOSED
        self.offer.release()
        return partner


def run_round(
    ctx: PairingContext,
    current: PairingRound,
    seeker: Coroutine[Any, Any, None],
    train_step: Callable[[], bool] | None,
) -> Payload | None:
    """Trainer thread: one pairing round from open to close. ``seeker`` calls peers on the event loop while the
    trainer waits (taking ``train_step``s meanwhile) until the round is paired, told to stop, or --pair-timeout;
    an exchange still streaming then finishes, bounded by the exchange ceiling. It streams a held copy, so the
    trainer may go on even if it did not (the partner is then dropped on both sides). Returns the partner."""
    assert ctx.loop is not None
    if ctx.stopping.is_set():  # a stop that came before the round opened: no waiting at all
        current.stop_waiting()
    seeking = ctx.spawn(seeker, "the search for a partner")
    # However the search ends (settled, nobody within reach, or an error), the trainer need not wait any longer.
    seeking.add_done_callback(lambda _: current.stop_waiting())
    ctx.telemetry.beat()
    current.wait(ctx.pair_timeout, train_step)
    ctx.telemetry.beat()
    partner = current.close(wait_for_exchange=ctx.exchange_ceiling + 5)
    seeking.cancel()
    return partner


class RoundSession:
    """The ExchangeSession of a pairing round: holds the round's exchange lock and its offer until released."""

    def __init__(self, pairing_round: PairingRound) -> None:
        self.round = pairing_round

    def outgoing(self) -> Published:
        return self.round.offer

    def complete(self, payload: Payload) -> bool:
        return self.round.settle(payload)

    def release(self) -> None:
        self.round.offer.release()
        self.round.lock.release()


class SyncPairing(PairingStrategy):
    mode = "sync"

    def __init__(self, ctx: PairingContext) -> None:
        super().__init__(ctx)
        self._round: PairingRound | None = None
        self._last_partner: str | None = None
        self._known_peers: set[str] = set()

    def ready(self) -> bool:
        current = self._round
        return current is not None and current.open

    def open_session(self, partner_id: str, partner_outer_step: int, kind: str) -> RoundSession | None:
        current = self._round
        if current is None or kind != "weights" or partner_id == self.ctx.peer_id():
            return None
        return current.try_session(partner_id, partner_outer_step, self.ctx.max_staleness)

    def partner(
        self, replica: Replica, phase_seconds: float, train_step: Callable[[], bool] | None = None
    ) -> Payload | None:
        ctx = self.ctx
        assert ctx.loop is not None
        offer = ctx.offers["weights"].publish(replica.weights(), replica.outer_step)
        others = bool(self._known_peers - {self._last_partner, None})
        grace = RepeatGrace.seconds(self._last_partner, others, ctx.pair_timeout, phase_seconds)
        repeat = RepeatGrace.starting_now(self._last_partner, grace)
        current = PairingRound(replica.outer_step, offer, repeat=repeat)
        self._round = current
        ctx.spawn(ctx.publish_record(), "publishing the DHT record")  # ready: say so
        partner = run_round(ctx, current, self._seek_partner(current), train_step)
        self._round = None
        self._last_partner = partner.peer_id if partner is not None else None
        return partner

    def interrupt(self) -> None:
        current = self._round
        if current is not None:
            current.stop_waiting()

    async def _seek_partner(self, current: PairingRound) -> None:
        """Call ready peers (least recently paired first) until the round is settled."""
        ctx = self.ctx
        # Let the other nodes reaching this outer step publish their readiness before choosing among them.
        await asyncio.sleep(random.uniform(0.05, 0.25))
        alone_until = time.monotonic() + ctx.alone_grace
        while current.open:
            try:
                live = await ctx.discovery.live_peers()
                # Only peers that may reach this step can be worth a grace: with the far side of a split (or a
                # straggler) counted, a node paired with its one reachable partner waited half a phase every step.
                self._known_peers = {
                    p.peer_id for p in live if abs(p.outer_step - current.outer_step) <= ctx.max_staleness
                }
                candidates = ctx.caller.choosable(live, current.outer_step)
            except (TimeoutError, OSError) as error:
                log.warning("DHT lookup failed: %s", error)
                live, candidates = [], []
            # Peers this node set aside (a failure, the norm bound) do not count: their payload would be refused
            # again, and waiting the whole pair_timeout for them at every step left two such nodes idle most of the
            # time while the rest of the swarm ran away from them.
            within_reach = [
                p
                for p in live
                if abs(p.outer_step - current.outer_step) <= ctx.max_staleness
                and not ctx.caller.policy.avoided(p.peer_id)
            ]
            all_ahead = bool(live) and all(p.outer_step > current.outer_step + ctx.max_staleness for p in live)
            if not within_reach and (all_ahead or time.monotonic() >= alone_until):
                # Nobody else in the run within the staleness bound (alone, or every other node far ahead or far
                # behind): waiting the whole pair_timeout would only idle the trainer. A peer that comes within
                # reach is found at the next outer step. When everyone is ahead, nobody will come back to this
                # step: not waiting even the grace lets a node that fell behind catch up (with the grace, a node
                # 3 steps behind a 3-node tiny swarm stayed behind, alone, to the end of the run).
                current.stop_waiting()
                return
            for peer in ctx.caller.order([p for p in candidates if current.may_pair_with(p.peer_id)]):
                if not current.open or not current.lock.acquire(blocking=False):
                    break  # settled, or someone is exchanging with us right now: see how it ends
                try:
                    if not current.open:
                        return
                    payload = await ctx.caller.call(peer, current.offer)  # the call holds the copy it streams
                    if payload is not None:
                        current.settle(payload)
                        return
                finally:
                    current.lock.release()
            await asyncio.sleep(random.uniform(0.05, 0.3))  # jitter: two nodes calling each other desynchronise
