"""Draw, then meet: the partner of an outer step is reserved during the inner phase, and the two exchange at their
outer steps. ``sync`` and ``stream`` mode pair this way; they differ only in what the reservation and the outer
step's exchange carry (pairing/sync.py, pairing/stream.py).

1. At the start of its phase a node publishes its *reservation payload* and a background task exchanges it with a
   peer whose record says it is still looking (peers calling in do the same). The first complete exchange
   *reserves* the pair for this phase on both sides; a node exchanges reservations with one peer at a time (its
   reservation lock is only ever tried, so two nodes calling each other get a quick refusal and retry). The server
   of the exchange takes it only when both outer steps are due within :func:`meeting_window` of each other (0.7 of
   what the first there waits for the other: half a phase, then --pair-timeout), as far as both know when (a sync
   reservation carries the seconds until its sender's outer step): a partner due later than that would hold this
   node's round for nothing. A node of such a mode also says in its
   record when its next step is due (``next_step_at``), and asks only peers whose records are due within the
   window, or say nothing: each ask the peer would refuse costs both a round trip and a sealed payload. For the
   first min(--pair-timeout, phase)/2 seconds of a phase after a blend, the more recently paired half of the peers
   in view does not reserve it (:class:`RepeatGrace`): partners rotate instead of locking into fixed pairs or
   groups.
2. At the outer step the node publishes its *round payload* and exchanges it with the reserved partner alone, in a
   pairing round (pairing/pairing_round.py: either side may call; the first exchange both sides commit settles the
   round on both). The round payload is made whole with the reservation's (:meth:`ReservedPairing.whole`).
3. No reservation by the outer step: the node waits --alone-grace for a late one (--pair-timeout while one is in
   flight), and not even that when every peer is further ahead than --max-staleness (a node left behind goes on
   to catch up). The partner gone or already past this step, no round payload within half a phase (training on
   meanwhile, where steps may be borrowed) and then --pair-timeout of idling, or the reservation spent by an
   exchange that did not settle (refused, or cut before both sides committed: a reservation completes one round
   payload): a solo step. A reserved partner that delivered nothing while its record said it was still at the
   phase, or that had no record in the DHT at all (by PARTNER_MISSING_SECONDS), held this node's phase for
   nothing: it is set aside (``undelivered``, the doubling avoidance of a refused payload), and no phase is
   reserved with it meanwhile. The wait itself is not shortened for it: an honest partner that reserved early in
   its phase and late in this node's delivers up to a phase later, while this node trains on.

Why reserve rather than call whoever's record says ready at the outer step: a record is seconds old when it is
read, so in a swarm whose phases run at random offsets most ready records name rounds that have closed (`bench
protocol`, docs/benchmarks.md: 49% of the outer steps of 100 honest members paired that way, 99% reserved), and
a record that always says ready, a hostile one, is the one a member finds ready.
"""

from __future__ import annotations

import asyncio
import logging
import random
import threading
import time
from abc import abstractmethod
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import grpc
import torch
from hivemind.utils.timed_storage import get_dht_time

from noloco_node.discovery.dht import PeerRecord
from noloco_node.pairing.pairing_round import PairingRound, RoundSession, run_round
from noloco_node.pairing.peer_policy import FAILURE, LOSS_CHECK, UNDELIVERED
from noloco_node.pairing.strategy import PairingContext, PairingStrategy
from noloco_node.training.replica import Replica
from noloco_node.wire.frames import PayloadError
from noloco_node.wire.payload import Payload
from noloco_node.wire.published import Published

log = logging.getLogger(__name__)

# How long the partner's record may be missing from every DHT lookup before the node stops waiting for it: about
# three lookups (discovery/dht.py shares one lookup among the callers of a second).
PARTNER_MISSING_SECONDS = 3.0
# Two members whose outer steps are due this share of the first one's wait apart may reserve each other
# (meeting_window): the first there waits for the other, with room for a phase that runs a little long.
MEET_WINDOW = 0.7


def meeting_window(pair_timeout: float, phase_seconds: float | None) -> float:
    """How far apart two outer steps may be due for their members to reserve each other: MEET_WINDOW of what the
    first there waits for the other (half a phase, training on where it may, then ``pair_timeout``: pairing_round.py).
    Not of ``pair_timeout`` alone once the wait holds half a phase: with a window of 7 s, 1-3 of 32 tiny members on
    2 cores (phases of ~45 s) were reserved by nobody during a whole phase at nearly every outer step, and 93.3% of
    the outer steps blended; 99.6% and 97.1% in two runs with the half phase in the window."""
    return MEET_WINDOW * (pair_timeout + (phase_seconds or 0.0) / 2)


@dataclass(frozen=True)
class RepeatGrace:
    """Recent partners wait their turn: for the first part of a phase, a node reserves (calling or called) only
    peers from the less recently paired half of those in view; the more recently paired half waits until ``until``.

    Nodes whose phases open at the same moment reserve each other at once, each finding only those open: two nodes
    that had just blended stayed locked in the same pair (stream, 4 nodes: two fixed pairs at 60 of 60 outer
    steps), and 8 nodes whose phases opened in two groups 3 s apart split into two groups of 4, each rotating among
    its own members for 16 of 16 outer steps (their weights 0.45 apart by then, far beyond any norm bound): whenever
    one asked a member of the other group first (never paired), that one had already reserved within its own. While
    a node's recent partners wait, the other group's members find it open. With two or three peers in view only the
    last partner waits, as before."""

    waiting: frozenset[str] = frozenset()
    until: float = 0.0  # on the clock ``allows`` is asked with

    @staticmethod
    def seconds(paired: bool, pair_timeout: float, phase_seconds: float) -> float:
        """The grace of the phase after a round: half a phase (at most half of --pair-timeout) after a blend, none
        after a solo step (a node that found nobody waits for nobody)."""
        return min(pair_timeout / 2, phase_seconds / 2) if paired else 0.0

    @classmethod
    def starting(
        cls, now: float, seconds: float, in_view: Iterable[PeerRecord], last_paired: Mapping[str, int]
    ) -> RepeatGrace:
        """The grace of a phase opening at ``now``: of the peers ``in_view``, the more recently paired half waits
        ``seconds``. Recency is ``last_paired``'s (the outer step of this node's last blend with each), counted per
        network group first, as Standing.order counts it: a group was paired when any of its keys was, so a host's
        other keys are not fresh peers that skip the wait (`bench protocol`, 100 members and 10% hostile hosts of 4
        keys, seeds 0 and 1: their share of the late blends was 30.0% and 33.1% with the last partner waiting,
        36.9% and 36.2% with the recent half counted per key, 33.3% and 32.9% counted per group)."""
        records = list(in_view)
        group_paired: dict[str, int] = {}
        for record in records:
            group = record.network_group
            group_paired[group] = max(group_paired.get(group, -1), last_paired.get(record.peer_id, -1))
        by_recency = sorted(
            records,
            key=lambda r: (group_paired[r.network_group], last_paired.get(r.peer_id, -1)),
            reverse=True,
        )
        waiting = frozenset(r.peer_id for r in by_recency[: len(records) // 2] if group_paired[r.network_group] >= 0)
        return cls(waiting, now + seconds) if seconds > 0 and waiting else cls()

    def allows(self, peer_id: str, now: float) -> bool:
        return peer_id not in self.waiting or now >= self.until


@dataclass
class Phase:
    """One inner phase of this node, from its reservation's point of view."""

    outer_step: int  # the outer step that ends this phase
    offer: Published  # this node's reservation payload, held until the next phase's replaces it
    due_at: float | None = None  # when (monotonic) its outer step is expected; None before one phase was measured
    partner: Payload | None = None  # the reserved partner's reservation payload, until its round payload arrives
    open: bool = True  # False once this node has stopped waiting for a reservation: no new one
    reserved: threading.Event = field(default_factory=threading.Event)
    repeat: RepeatGrace = field(default_factory=RepeatGrace)  # recent partners wait their turn

    def seconds_to_step(self) -> float | None:
        return None if self.due_at is None else self.due_at - time.monotonic()


class ReservedPairing(PairingStrategy):
    """The reservation and the round of sync and stream mode; a subclass says what their payloads carry."""

    reservation_kind: str  # the payload kind that reserves (ctx.offers)
    round_kind: str  # the payload kind of the outer step's exchange
    meets_by_due_time = False  # whether a reservation says when its sender's outer step is due (seconds_to_step)

    def __init__(self, ctx: PairingContext) -> None:
        super().__init__(ctx)
        self._guard = threading.Lock()  # the phase and its reservation
        self._reservation_lock = threading.Lock()  # the one reservation exchange in flight
        self._phase: Phase | None = None
        self._round: PairingRound | None = None
        # The run's live peers as last looked up, so that the round starts without a DHT lookup.
        self._records: dict[str, PeerRecord] = {}
        # The grace the next phase gives recent partners (RepeatGrace): none after a solo step.
        self._grace_seconds = 0.0
        self._partner_left = False  # this round's reserved partner went on past this phase, or left the swarm
        self._phase_seconds: float | None = None  # the last phase's length: when the next outer step is due

    # ---------------------------------------------------------------------------------- what a mode sends

    @abstractmethod
    def reservation_offer(
        self, phi: Sequence[torch.Tensor], delta: Sequence[torch.Tensor], outer_step: int, seconds_to_step: float | None
    ) -> Published:
        """This node's reservation payload for the phase that ends at ``outer_step``, due in ``seconds_to_step``
        (None: not known yet)."""

    def calling_offer(self, phase: Phase) -> Published | None:
        """The reservation payload this node calls a peer with now, held for the call (None: withdrawn). By default
        the phase's own; a mode whose reservation says when its outer step is due publishes a fresh one."""
        return phase.offer if phase.offer.hold() else None

    @abstractmethod
    def round_offer(self, replica: Replica) -> Published:
        """This node's payload at the outer step, for the reserved partner."""

    @abstractmethod
    def whole(self, reservation: Payload, payload: Payload) -> Payload:
        """The partner's round ``payload`` made whole with its ``reservation`` (both handed over to the result or
        released)."""

    def seconds_to_step(self, reservation: Payload) -> float | None:
        """How long until the sender of ``reservation`` said its outer step was due, or None if it did not say."""
        return None

    def finish(self, partner: Payload, replica: Replica) -> None:
        """Trainer thread: the settled partner's payload, before the outer step judges and blends it."""

    # ---------------------------------------------------------------------------------- gRPC threads

    def ready(self) -> bool:
        """Peers may reserve this node: the phase is open and nobody is reserved yet."""
        phase = self._phase
        return phase is not None and phase.open and phase.partner is None

    def next_step_at(self) -> float:
        phase = self._phase
        seconds = phase.seconds_to_step() if phase is not None and self.meets_by_due_time else None
        return 0.0 if seconds is None else get_dht_time() + max(0.0, seconds)

    def open_session(
        self, partner_id: str, partner_outer_step: int, kind: str
    ) -> ReservationSession | RoundSession | None:
        if partner_id == self.ctx.peer_id():
            return None
        if kind == self.round_kind:
            current = self._round
            return (
                None if current is None else current.try_session(partner_id, partner_outer_step, self.ctx.max_staleness)
            )
        if kind != self.reservation_kind:
            return None
        with self._guard:
            phase = self._phase
            if phase is None or not phase.open or phase.partner is not None:
                return None
            if abs(partner_outer_step - phase.outer_step) > self.ctx.max_staleness:
                return None
            if not phase.repeat.allows(partner_id, time.monotonic()):
                return None
            # One that reserved and never delivered, or whose blend measured worse than none, gets no phase while
            # set aside. Not one this node merely failed to call: a peer it cannot dial (a NAT, a firewall) still
            # reaches it by calling in.
            if self.ctx.caller.policy.avoided_for(partner_id) in (UNDELIVERED, LOSS_CHECK):
                return None
            if not self._reservation_lock.acquire(blocking=False):
                return None
            if not phase.offer.hold():
                self._reservation_lock.release()
                return None
        return ReservationSession(self, phase, served=True)

    def complete_payload(self, payload: Payload) -> Payload:
        """A round payload made whole with the reservation of its sender (consumed: one round payload per
        reservation); a reservation payload is whole already."""
        if payload.parts != self.ctx.offers[self.round_kind].kind.parts:
            return payload
        with self._guard:
            phase, reservation = self._phase, None
            if phase is not None and phase.partner is not None and phase.partner.peer_id == payload.peer_id:
                reservation, phase.partner = phase.partner, None
        if reservation is None:
            payload.release()
            raise PayloadError(
                grpc.StatusCode.FAILED_PRECONDITION,
                "not_reserved",
                f"a {self.round_kind} payload from a peer this node has not reserved in this phase",
            )
        if reservation.outer_step != payload.outer_step:
            payload.release()
            reservation.release()
            raise PayloadError(
                grpc.StatusCode.FAILED_PRECONDITION,
                "round_step",
                f"a {self.round_kind} payload of outer step {payload.outer_step} for a reservation of outer step "
                f"{reservation.outer_step}",
            )
        return self.whole(reservation, payload)

    def _spent(self, phase: Phase) -> bool:
        """Whether the phase's reservation was used by a round exchange (whatever its outcome)."""
        with self._guard:
            return phase.partner is None

    def _reserve(self, phase: Phase, payload: Payload, *, served: bool) -> bool:
        """The first complete reservation exchange of this phase reserves its partner; any other is let go. The
        server of the exchange also holds it to the meeting window (the caller took the server's yes)."""
        with self._guard:
            reserved = self._phase is phase and phase.open and phase.partner is None
            if reserved and served:
                reserved = self._meet(phase, payload)
            if reserved:
                phase.partner = payload
                phase.reserved.set()
        if not reserved:
            payload.release()
            return False
        if self.ctx.loop is not None:  # no longer looking: say so
            self.ctx.spawn(self.ctx.publish_record(), "publishing the DHT record")
        return True

    def _meet(self, phase: Phase, payload: Payload) -> bool:
        """Whether this node's outer step and the caller's are due close enough to meet."""
        return self._due_together(phase.seconds_to_step(), self.seconds_to_step(payload))

    def _worth_asking(self, phase: Phase, peer: PeerRecord) -> bool:
        """Whether to ask ``peer`` to reserve this phase: not a recent partner in its repeat grace, and due close
        enough to meet as far as its record says (the peer holds this node's ask to the window in ``_meet``)."""
        if not phase.repeat.allows(peer.peer_id, time.monotonic()):
            return False
        theirs = peer.next_step_at - get_dht_time() if self.meets_by_due_time and peer.next_step_at > 0 else None
        return self._due_together(phase.seconds_to_step(), theirs)

    def _due_together(self, mine: float | None, theirs: float | None) -> bool:
        """Two outer steps due ``mine`` and ``theirs`` seconds from now meet: within :func:`meeting_window` of this
        node's last phase (unknown on either side: yes)."""
        if mine is None or theirs is None:
            return True
        return abs(mine - theirs) <= meeting_window(self.ctx.pair_timeout, self._phase_seconds)

    # ---------------------------------------------------------------------------------- trainer thread

    def start(self, replica: Replica) -> None:
        self._begin_phase(replica.phi, replica.delta, replica.outer_step)
        if self.ctx.loop is not None:  # looking from now on: say so before the first phase ends
            self.ctx.spawn(self.ctx.publish_record(), "publishing the DHT record")

    def _begin_phase(self, phi: Sequence[torch.Tensor], delta: Sequence[torch.Tensor], outer_step: int) -> None:
        seconds = self._phase_seconds
        offer = self.reservation_offer(phi, delta, outer_step, seconds)
        now = time.monotonic()
        due_at = None if seconds is None else now + seconds
        repeat = RepeatGrace.starting(now, self._grace_seconds, self._records.values(), self.ctx.caller.last_paired)
        phase = Phase(outer_step, offer, due_at, repeat=repeat)
        with self._guard:
            previous, self._phase = self._phase, phase
        if previous is not None:
            self._end_phase(previous)

    def _end_phase(self, phase: Phase) -> None:
        with self._guard:
            phase.open = False
            leftover, phase.partner = phase.partner, None
        phase.offer.release()
        if leftover is not None:
            leftover.release()

    def partner(
        self, replica: Replica, phase_seconds: float, train_step: Callable[[], bool] | None = None
    ) -> Payload | None:
        ctx = self.ctx
        assert ctx.loop is not None
        self._phase_seconds = phase_seconds
        phase = self._phase
        if phase is None:
            return None
        # What the partner gets is the phase's end, whatever this node trains while it waits (node/outer_step.py
        # blends with the steps taken meanwhile on top of what it sent).
        offer = self.round_offer(replica)
        if not ctx.stopping.is_set():
            self._await_reservation(phase, train_step)
        with self._guard:
            phase.open = False  # no reservation from here on
            reserved = phase.partner
        if reserved is None:
            offer.release()
            self._grace_seconds = 0.0
            return None  # nobody reserved this node: a solo step
        current = PairingRound(replica.outer_step, offer, only_partner=reserved.peer_id)
        self._partner_left = False
        self._round = current
        seeker = self._exchange_round(current, phase, reserved.peer_id, reserved.outer_step)
        ctx.discovery.follow([reserved.peer_id])  # its record, fresh at every lookup: gone, or gone on without us
        try:
            # Half a phase, as long as the steps it may borrow meanwhile take, then --pair-timeout idling.
            partner = run_round(ctx, current, seeker, train_step, at_least=phase_seconds / 2)
        finally:
            ctx.discovery.follow([])
        with self._guard:
            self._round = None
            leftover, phase.partner = phase.partner, None  # not consumed: the round payload never came
        if leftover is not None:
            leftover.release()
            if not self._partner_left and not ctx.stopping.is_set():
                self._undelivered(reserved.peer_id, replica.outer_step)
        # The next phase's grace for recent partners (RepeatGrace): a pair that blended a moment later than this one
        # is still inside its reserved phase, so without it each finds only its recent partners open.
        self._grace_seconds = RepeatGrace.seconds(partner is not None, ctx.pair_timeout, phase_seconds)
        if partner is not None:
            self.finish(partner, replica)
        return partner

    def _undelivered(self, partner_id: str, outer_step: int) -> None:
        """The reserved partner's round payload never reached this round (no exchange used the reservation) while
        its record said it was still at this phase, or while it had no record at all: it held this node's phase and
        gave nothing. Set aside like a peer whose payload was refused: not called, and no reservation with it
        (:meth:`open_session`), for avoid_seconds, doubling. Not a failed call's avoidance, which a peer's Info
        answering again lifts (and which does not stop a peer this node cannot dial from reserving by calling in).
        An honest partner gets here only by delivering nothing within --pair-timeout of this node's outer step: a
        partner more than a phase behind."""
        policy = self.ctx.caller.policy
        if policy.avoided(partner_id):  # a failed call to it set it aside already
            return
        avoid = policy.failed(partner_id, UNDELIVERED)
        self.ctx.caller.settings.metrics.outcome(UNDELIVERED)
        log.warning(
            "outer step %d: %s reserved this phase and delivered nothing; set aside for %.0fs",
            outer_step,
            partner_id[-8:],
            avoid,
        )

    def _await_reservation(self, phase: Phase, train_step: Callable[[], bool] | None) -> None:
        """Not reserved at the phase's end (the first phase, an odd swarm, every peer taken): a peer in the same
        position may still reserve now. --alone-grace at most, --pair-timeout while a reservation is in flight,
        nothing when every peer is further ahead than --max-staleness; training meanwhile when allowed. Not
        --pair-timeout for any peer within reach: a node whose partner held its phase for nothing (a key that
        never delivers) stepped on a phase behind the one that waited for it, and two nodes under such a key blended
        at half their outer steps (78 of 79 with --alone-grace)."""
        ctx = self.ctx
        started = time.monotonic()
        while not phase.reserved.is_set():
            if self._all_ahead(phase.outer_step) and not self._reservation_lock.locked():
                return
            patience = ctx.pair_timeout if self._reservation_lock.locked() else ctx.alone_grace
            if time.monotonic() - started >= patience:
                return
            if train_step is None or not train_step():
                phase.reserved.wait(0.05)

    def _all_ahead(self, outer_step: int) -> bool:
        """Whether the last lookup saw peers and all of them further ahead than --max-staleness: nobody will come
        back to this step, and not waiting lets a node left behind catch up."""
        peers = list(self._records.values())
        return bool(peers) and all(p.outer_step > outer_step + self.ctx.max_staleness for p in peers)

    def after_blend(
        self,
        new_phi: Sequence[torch.Tensor],
        new_delta: Sequence[torch.Tensor],
        theta: Sequence[torch.Tensor],
        old_phi: Sequence[torch.Tensor],
        next_outer_step: int | None,
    ) -> None:
        if next_outer_step is None:  # no further phase: nobody may reserve one, then wait for it in vain
            self.close()
            if self.ctx.loop is not None:  # not looking any more: say so
                self.ctx.spawn(self.ctx.publish_record(), "publishing the DHT record")
            return
        self._begin_phase(new_phi, new_delta, next_outer_step)

    def interrupt(self) -> None:
        phase, current = self._phase, self._round
        if phase is not None:
            phase.reserved.set()  # a trainer waiting for a reservation goes on (it finds none, or uses it)
        if current is not None:
            current.stop_waiting()

    def close(self) -> None:
        with self._guard:
            phase, self._phase = self._phase, None
        if phase is not None:
            self._end_phase(phase)

    # ---------------------------------------------------------------------------------- event loop

    async def run(self) -> None:
        """During each phase, until the phase is reserved: exchange reservations with a peer still looking."""
        ctx = self.ctx
        while True:
            await asyncio.sleep(random.uniform(0.1, 0.3))
            phase = self._phase
            if phase is None or not phase.open or phase.partner is not None:
                continue
            try:
                live = await ctx.discovery.live_peers()
            except (TimeoutError, OSError) as error:
                log.warning("DHT lookup failed: %s", error)
                continue
            self._records = {p.peer_id: p for p in live}
            for peer in ctx.caller.order(ctx.caller.choosable(live, phase.outer_step)):
                if not self._worth_asking(phase, peer):
                    continue
                if not (phase.open and phase.partner is None) or not self._reservation_lock.acquire(blocking=False):
                    break  # reserved meanwhile (a peer called in), or a peer is reserving with us right now
                offer = self.calling_offer(phase)
                try:
                    if offer is None:
                        break  # the phase ended meanwhile
                    payload = await ctx.caller.call(peer, offer, kind=self.reservation_kind)
                finally:
                    if offer is not None:
                        offer.release()
                    self._reservation_lock.release()
                if payload is not None and self._reserve(phase, payload, served=False):
                    break

    async def _exchange_round(self, current: PairingRound, phase: Phase, partner_id: str, partner_step: int) -> None:
        """Call the reserved partner with this node's round payload until the round is settled; stop early when
        the partner is gone or already past this phase (it went on alone: nobody will answer), or when the
        reservation is spent: it completes one round payload (:meth:`complete_payload`), so an exchange that used
        it and did not settle (refused, or cut before both sides committed) leaves nothing to pair with on this
        side, and the partner's retries would only be refused until --pair-timeout. The first call goes to the
        address known from the reservation, without waiting for a DHT lookup; after a failed call the partner is
        only waited for (it calls in)."""
        ctx = self.ctx
        record, missing_since = self._records.get(partner_id), None
        listed = record is not None  # a partner never listed in the DHT this round cannot have left it
        while current.open:
            if self._spent(phase):
                current.stop_waiting()  # an exchange still in flight may settle the round
                return
            # Not dialled again once a call to it failed: a partner that is gone would be dialled every few hundred
            # milliseconds until --pair-timeout, each failure doubling its avoidance, so that a member's restart
            # would set it aside for many minutes; one that lives calls in from its own round. One set aside for
            # what it sent (drift) is still called: the pair was reserved, and its payload is judged again.
            policy = ctx.caller.policy
            unreachable = policy.avoided_for(partner_id) == FAILURE or policy.quarantined(partner_id)
            dial = record if record is not None and not unreachable else None
            if dial is not None and dial.address and current.lock.acquire(blocking=False):
                try:
                    if not current.open:
                        return
                    payload = await ctx.caller.call(
                        dial, current.offer, kind=self.round_kind, complete=self.complete_payload
                    )
                finally:
                    current.lock.release()
                if payload is not None:
                    current.settle(payload)
                    return
            await asyncio.sleep(random.uniform(0.05, 0.2))  # the partner's round is not open yet, or it calls us
            try:
                live = await ctx.discovery.live_peers()
            except (TimeoutError, OSError):
                continue
            record = next((p for p in live if p.peer_id == partner_id), None)
            listed = listed or record is not None
            now = time.monotonic()
            missing_since = None if record is not None else (missing_since or now)
            gone = missing_since is not None and now - missing_since >= PARTNER_MISSING_SECONDS
            past = record is not None and record.outer_step > partner_step
            if gone or past:
                self._partner_left = past or listed  # it went on alone, or left: nothing was held back on purpose
                current.stop_waiting()
                return


class ReservationSession:
    """The ExchangeSession of a reservation: holds the reservation lock and this phase's payload until released."""

    def __init__(self, strategy: ReservedPairing, phase: Phase, *, served: bool) -> None:
        self.strategy = strategy
        self.phase = phase
        self.served = served

    def outgoing(self) -> Published:
        return self.phase.offer

    def complete(self, payload: Payload) -> bool:
        return self.strategy._reserve(self.phase, payload, served=self.served)

    def release(self) -> None:
        self.phase.offer.release()
        self.strategy._reservation_lock.release()
