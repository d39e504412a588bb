"""Which peers to call and how long to wait for them: deadlines learnt from observed exchanges, and backoff.

Fixed guesses fail both ways on the internet: a 60 s deadline lets one stalled peer eat a minute of every outer
step, and a short one cuts healthy exchanges of a big model over a slow link. Each completed exchange updates an
exponentially weighted mean of its duration, per peer and overall; the deadline for the next call is a multiple of
that (with a floor, so that jitter does not cut healthy calls, and the configured exchange timeout as the ceiling).
A peer that fails is avoided, for twice as long after each consecutive failure (up to a cap); one success clears
its record, and so does a peer that stopped answering at all and answers again
(:meth:`PeerPolicy.answered_again`: the path to it was broken, a partition or a restart, and is whole again; after
a minute apart the doubling would otherwise keep two halves of a healed swarm from calling each other for minutes).
A busy answer is not a failure. So is a peer whose weights were too far from this node's (the norm
bound): replicas that were apart for a while drift, and drift is not hostility, so it is *set aside* for now (the
same doubling backoff), not quarantined. A peer that sent a payload no honest peer sends (malformed, forged, in
another run's layout) is quarantined: neither called nor served for ``quarantine_seconds``, whatever happens
meanwhile.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

EWMA_WEIGHT = 0.3  # of the newest observation
DEADLINE_FACTOR = 4.0  # deadline = factor * typical duration + slack
DEADLINE_SLACK = 2.0
MAX_BACKOFF_DOUBLINGS = 5  # avoid at most avoid_seconds * 32
FAILURE = "failure"  # the reason of an avoidance for a failed call (not for drift: security.NORM_BOUND)
UNDELIVERED = "undelivered"  # stream: reserved this node's phase and never delivered its progress (pairing/stream.py)
LOSS_CHECK = "loss_check"  # a blend with the peer measured worse than none (node/blend_check.py): set aside
# A peer decides when its Info is silent: an avoidance is ended that way at most once per this many avoid_seconds
# (a healed path needs one), so that a peer cannot have itself called after every failure by going quiet between.
LIFT_EVERY_AVOIDS = 10


@dataclass
class _PeerRecord:
    typical: float | None = None
    failures: int = 0
    avoid_until: float = 0.0
    avoid_reason: str = ""
    quarantined_until: float = 0.0
    quarantine_reason: str = ""
    lifted_at: float = -float("inf")  # when answered_again last ended its avoidance


class PeerPolicy:
    def __init__(
        self,
        *,
        exchange_timeout: float,
        min_deadline: float,
        avoid_seconds: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.exchange_timeout = exchange_timeout
        self.min_deadline = min_deadline
        self.avoid_seconds = avoid_seconds
        self._clock = clock  # emulated in the protocol simulation (benchmarks/noloco_bench/swarm_protocol.py)
        self._lock = threading.Lock()
        self._peers: dict[str, _PeerRecord] = {}
        self._typical: float | None = None  # over all peers: the first call to a new peer uses it

    def deadline(self, peer_id: str) -> float:
        """Seconds to allow the next exchange with this peer."""
        with self._lock:
            record = self._peers.get(peer_id)
            typical = record.typical if record and record.typical is not None else self._typical
        if typical is None:
            return self.exchange_timeout  # nothing observed yet: the configured ceiling
        return min(self.exchange_timeout, max(self.min_deadline, DEADLINE_FACTOR * typical + DEADLINE_SLACK))

    def succeeded(self, peer_id: str, seconds: float) -> None:
        with self._lock:
            record = self._peers.setdefault(peer_id, _PeerRecord())
            record.typical = seconds if record.typical is None else _blend(record.typical, seconds)
            record.failures, record.avoid_until, record.avoid_reason = 0, 0.0, ""  # a quarantine outlives a success
            # The last lift was earned (the path worked): the next silence and answer may lift again. A peer that
            # restarts soon after a heal is otherwise left avoided for its failures while it was down.
            record.lifted_at = -float("inf")
            self._typical = seconds if self._typical is None else _blend(self._typical, seconds)

    def failed(self, peer_id: str, reason: str = FAILURE) -> float:
        """Record a failure (or a refusal for drift: ``reason`` norm_bound); returns how long the peer is now
        avoided (s)."""
        with self._lock:
            record = self._peers.setdefault(peer_id, _PeerRecord())
            record.failures += 1
            avoid = self.avoid_seconds * 2 ** min(record.failures - 1, MAX_BACKOFF_DOUBLINGS)
            record.avoid_until = self._clock() + avoid
            record.avoid_reason = reason
            return avoid

    def answered_again(self, peer_id: str) -> bool:
        """A peer that did not answer at all for a while answers again (node/report.py's watch of peers' Info):
        its avoidance for failures ends, and it is called again at once. Not one for drift or a quarantine, which
        are about its payloads, not the path; nor for a peer that only failed exchanges while its Info kept
        answering (a straggler: the watch sees no silence); and at most once per LIFT_EVERY_AVOIDS avoid_seconds
        unless an exchange with it succeeded since the last lift.
        Its failures still count: if the path is still bad, the next avoidance is doubled from there. Returns
        whether it lifted one."""
        with self._lock:
            record = self._peers.get(peer_id)
            now = self._clock()
            if record is None or record.avoid_reason != FAILURE or record.avoid_until <= now:
                return False
            if now - record.lifted_at < LIFT_EVERY_AVOIDS * self.avoid_seconds:
                return False
            record.avoid_until, record.avoid_reason, record.lifted_at = 0.0, "", now
            return True

    def quarantine(self, peer_id: str, seconds: float, reason: str = "") -> None:
        """A peer that sent a bad payload: not called, and its calls refused, for ``seconds``."""
        with self._lock:
            record = self._peers.setdefault(peer_id, _PeerRecord())
            record.quarantined_until = max(record.quarantined_until, self._clock() + seconds)
            record.quarantine_reason = reason

    def lift(self, reason: str) -> list[str]:
        """End every quarantine and avoidance given for ``reason``; returns the peers it lifted. A node that adopted
        a donor's state lifts those for ``norm_bound``: they measured a distance from weights it no longer has."""
        lifted = []
        with self._lock:
            now = self._clock()
            for peer_id, record in self._peers.items():
                if record.quarantine_reason == reason and record.quarantined_until > now:
                    record.quarantined_until, record.quarantine_reason = 0.0, ""
                    lifted.append(peer_id)
                if record.avoid_reason == reason and record.avoid_until > now:
                    record.failures, record.avoid_until, record.avoid_reason = 0, 0.0, ""
                    lifted.append(peer_id)
        return lifted

    def quarantined(self, peer_id: str) -> bool:
        with self._lock:
            record = self._peers.get(peer_id)
            return record is not None and record.quarantined_until > self._clock()

    def quarantined_now(self, limit: int) -> dict[str, str]:
        """Up to ``limit`` peers quarantined now, with the reason of each (the status shows them; the ledger lists
        their receipts apart)."""
        with self._lock:
            now = self._clock()
            found = {p: r.quarantine_reason for p, r in self._peers.items() if r.quarantined_until > now}
        return dict(sorted(found.items())[:limit])

    def avoided(self, peer_id: str) -> bool:
        with self._lock:
            record = self._peers.get(peer_id)
            now = self._clock()
            return record is not None and (record.avoid_until > now or record.quarantined_until > now)

    def avoided_for(self, peer_id: str) -> str | None:
        """The reason this peer is avoided now (FAILURE, UNDELIVERED, a refusal's), or None if it is not."""
        with self._lock:
            record = self._peers.get(peer_id)
            return record.avoid_reason if record is not None and record.avoid_until > self._clock() else None

    def forget(self, live_peer_ids: set[str]) -> None:
        """Drop what is known of peers that left, so that a long run's bookkeeping does not grow without bound."""
        with self._lock:
            now = self._clock()
            for gone in set(self._peers) - live_peer_ids:
                record = self._peers[gone]
                if record.avoid_until <= now and record.quarantined_until <= now:
                    del self._peers[gone]


def _blend(old: float, new: float) -> float:
    return (1 - EWMA_WEIGHT) * old + EWMA_WEIGHT * new
