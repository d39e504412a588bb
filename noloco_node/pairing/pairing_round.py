"""The pairing round at an outer step: the one rule that settles a pair in every mode.

A round holds this node's published payload for the step. Incoming calls (gRPC threads) and this node's own calls
(event loop) race for the round's exchange lock, which is only ever *tried*, never waited on: a node busy with one
exchange refuses every other call at once (ABORTED), so two nodes calling each other simultaneously both get a fast
refusal and retry after random jitter instead of deadlocking. The first exchange that both sides commit (rpc/
client.py: the caller's verdict, the server's acknowledgement) settles the round with its partner; --pair-timeout
without one settles it alone (a solo step). A reservation (pairing/reserved.py) is settled the same way, by a
reservation payload's exchange, and restricts the round to the reserved partner.

The round goes through explicit stages (:class:`Stage`), and the trainer waits on its future, not on a flag.
Closing the round refuses new exchanges and lets one in flight finish, bounded by the exchange ceiling. The
tensors a round sends are a published copy (wire/published.py) held by every stream that reads them, so whatever
the timing of a slow stream against the trainer's next outer step, nothing it sends is ever overwritten.
"""

from __future__ import annotations

import contextlib
import enum
import threading
import time
from collections.abc import Callable, Coroutine
from concurrent.futures import Future, InvalidStateError
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

from noloco_node.pairing.strategy import PairingContext
from noloco_node.wire.payload import Payload
from noloco_node.wire.published import Published


class Stage(enum.Enum):
    OPEN = "open"  # looking for a partner; calls are served
    CLOSING = "closing"  # no new exchanges; one in flight may still complete and become the partner
    PAIRED = "paired"  # an exchange completed: the partner is known
    ALONE = "alone"  # closed without a partner: a solo step
    CLOSED = "closed"  # the trainer has taken the answer; nothing changes any more


class PairingRound:
    """One outer step's chance to pair: at most one exchange at a time, the first complete one wins."""

    def __init__(
        self,
        outer_step: int,
        offer: Published,
        *,
        only_partner: str | None = None,
    ) -> None:
        self.outer_step = outer_step
        self.offer = offer  # held by the round until it closes
        # The partner reserved during the phase (pairing/reserved.py) is the only one this round exchanges with.
        self.only_partner = only_partner
        self.stage = Stage.OPEN
        self.partner: Payload | None = None
        self.waiting_over: Future[None] = Future()  # the trainer stops waiting: paired, alone, timed out, stopped
        self.lock = threading.Lock()  # the one exchange in flight
        self._guard = threading.Lock()  # the stage

    @property
    def open(self) -> bool:
        return self.stage is Stage.OPEN

    def may_pair_with(self, peer_id: str) -> bool:
        return self.only_partner is None or peer_id == self.only_partner

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

    def wait(self, timeout: float, train_step: Callable[[], bool] | None = None, at_least: float = 0.0) -> None:
        """Trainer thread: until the round is paired or told to stop waiting; taking inner steps meanwhile while
        ``train_step`` allows them (at most half of the next phase), then idling ``timeout`` s at most, plus
        whatever of ``at_least`` s the steps did not take. The steps taken do not count against the timeout: they
        are the next phase's training, done early, so a partner whose phase ran longer costs this node nothing until
        it idles (32 tiny members on 2 cores, phases of 40-58 s: 25 of 42 reserved partners that were given up on
        after 10 s, steps included, came 17-24 s after this side's step, and both sides stepped alone). ``at_least``
        is what those steps would take where none may be taken (a run's last outer step: 5 partners given up on
        there, 10 solo steps of the same run's 34)."""
        started = time.monotonic()
        while train_step is not None and not self.waiting_over.done():
            if not train_step():
                break
        idle = timeout + max(0.0, at_least - (time.monotonic() - started))
        try:
            self.waiting_over.result(timeout=idle)
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
    at_least: float = 0.0,
) -> Payload | None:
    """Trainer thread: one pairing round from open to close. ``seeker`` calls peers on the event loop while the
    trainer waits (taking ``train_step``s meanwhile) until the round is paired, told to stop, or --pair-timeout of
    idling after ``at_least`` s (:meth:`PairingRound.wait`);
    an exchange still streaming then finishes, bounded by the exchange ceiling. It streams a held copy, so the
    trainer may go on even if it did not (the partner is then dropped on both sides). Returns the partner."""
    assert ctx.loop is not None
    if ctx.stopping.is_set():  # a stop that came before the round opened: no waiting at all
        current.stop_waiting()
    seeking = ctx.spawn(seeker, "the search for a partner")
    # However the search ends (settled, nobody within reach, or an error), the trainer need not wait any longer.
    seeking.add_done_callback(lambda _: current.stop_waiting())
    ctx.telemetry.beat()
    current.wait(ctx.pair_timeout, train_step, at_least)
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
