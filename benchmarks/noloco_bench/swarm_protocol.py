"""`noloco-node bench protocol`: the swarm's protocol at internet size, in emulated time, with the node's rules and
two candidates beside them.

A real node's discovery, standing and peer policy (discovery/buckets.py ``SwarmSize`` and ``Bucket``, discovery/
view.py ``RecordView``, pairing/standing.py ``Standing``, pairing/peer_policy.py
``PeerPolicy``) run here unchanged for 100 to 10,000 members, on an emulated clock and an emulated DHT, with no
model: a member is its outer-step counter. What is emulated around them follows the node:

- **The DHT** holds each bucket's entries with their expirations, at most MAX_BUCKET_ENTRIES live ones per key (a
  new subkey past it is refused, as every DHT peer of a run does: dht.py ``bound_dictionaries``). A reader keeps a
  record only from its owner's bucket. Its bytes are a model calibrated on the real one (the issue's measurement and
  ``bench discovery``): a bucket read moves ENTRY_BYTES per entry (honest or not) from each of ANSWERING_PEERS DHT
  peers plus REQUEST_BYTES each; a store reads the bucket once (the nearest-node search answers with it) and sends
  the record to STORE_PEERS peers.
- **A member** looks up once a second (one random bucket at its level: the pairing loop and the status watch share a
  lookup), publishes its record every third of ``record_ttl`` and at each round (ready), and trains outer steps of
  ``phase_seconds`` (x its slowdown if it is a straggler, +-10% each). With ``pairing="ready"`` (sync mode's rule
  before 2026-11-29) it runs a round at its step: the candidates of its view that are ready, within ``max_staleness``
  and not avoided, ordered by ``Standing.order``, called one at a time (a call takes a round trip; an answer busy
  moves to the next; a member that is gone fails after CONNECT_FAIL_SECONDS and is avoided), again after 0.05-0.3 s,
  until a partner or ``pair_timeout`` (``alone_grace`` with nobody within reach). A call is taken when the callee's
  round is open and free, within reach, not a recent partner inside the repeat grace, and ``Standing.may_serve``; both
  spend a stranger turn as the node does. An exchange holds both for ``exchange_seconds`` plus a round trip. The
  straggler rule (``Standing.swarm_step``) moves a member that most of its known swarm is ahead of, and after
  BEHIND_STEPS solo steps in a row with every peer whose word counts at or beyond the edge of reach ahead, a member
  adopts the lower median step of those ahead (the node's catch-up, node/outer_step.py; its straggler rule and
  backoff are not emulated).
- **Draw, then meet** (``pairing="reserve"``), the node's rule in sync and stream mode (pairing/reserved.py): from the
  start of its phase a member asks the candidates within reach, in ``Standing.order`` (records saying they are still
  looking first), to meet at both members' next outer steps; yes from a member that is not reserved, within reach, due
  within the node's ``meeting_window`` of the asker (0.7 of half a phase plus --pair-timeout; its record's
  ``next_step_at`` hints at it; the ask says it), not a recent partner inside the repeat grace, and let in by
  ``Standing.may_serve``. The two exchange when both are at their steps (the first there waits half its phase, the
  next phase's inner steps borrowed meanwhile, then --pair-timeout); one still unreserved at its step keeps asking
  as long. The
  node asks only records that say they are still looking, and skips those due outside the window, as here.
- **Claimed slots** (``pairing="claimed"``, a candidate, not the node's rule): draw, then meet, and a member that
  reserves a member of another network group claims that group's slot, (group, the meeting's outer step), in the
  DHT; a claim by another member already readable there (CLAIM_SECONDS after it was made) is a no, and each
  claimant reads its claim back before meeting: of claims made meanwhile the lowest rank keeps the slot
  (``Swarm.claim``). A hostile key's slot is at the outer step of the member it meets. With
  ``pairing="claimed-key"`` the slot is the partner's key's instead of its group's: what a node could check (a
  claim is then a receipt the key signed itself; a group's claim rests on an address that is the claimant's word).
- **Meeting groups** (``pairing="rendezvous"``, a candidate, not the node's rule): nobody asks anybody. Time is cut
  into slots of ``phase_seconds``; at the start of its phase a member writes an entry (its outer step, when it is
  due) to its meeting group of the slot its step is due in, a DHT key placed by a hash of its network group and the
  slot (``meeting_key``) at the level two below the discovery level most hosts of its view are at. Once every member
  due in the slot has written (MEETING_READ_AT of the slot, plus a store's delay), each reads its group, calls each
  entry's address (an entry whose member does not answer is no host), and computes the group's pairing
  (``meeting_pairs``: one key per network group, pairs within reach and within the meeting window taken in the
  order of a hash of the two groups and the slot); one it leaves out reads the sibling group and pairs with those
  left out there, then with those of the 4 groups around it (MEETING_PASSES). Every reader of the same entries
  computes the same pairs, so the two named meet at their steps as reserved partners do, standing permitting, and
  a member named with nobody steps alone. A hostile host writes one entry a slot (a key of its in turn), at its
  level and the levels beside it, due mid-slot and at the honest members' step: compatible with nearly everyone,
  and still one host to every pairing. What a node would add and the bench does not emulate: fake entries (an
  address nobody holds costs its partner a step, not a blend: the meeting is a call to or from that address),
  members of one network group (one partner outside it a slot), relayed members.
- **Partners** (``partners``): the node's ``Standing`` (``known``: a record seen for --standing-seconds, a group
  held to its fair share, one blend in G outer steps), or ``EstablishedGroupsStanding`` (``established``, the node's
  line before 2026-11-29: a record seen for --standing-seconds and a blend). A call answered, and a call in, tell
  the member's ``Standing`` that the peer answers (``heard_from``), as the node's caller and server do.
- **Churn**: members leave at ``churn_per_hour`` of the swarm per hour (half of them crash, half write a tombstone),
  and as many join, each a cold start: it probes for the swarm's level, takes the lower median outer step of its
  view (a state download) and trains from there.
- **Hostile hosts**, ``hostile_share`` of the hosts, each a network group of its own with ``keys_per_hostile``
  keys whose records are always ready at the step most of their view is at. Each key takes every call (and every
  ask, with the due time most of its view has) and calls ready honest members of its view all the time (asks any,
  when members draw); its payload passes every check (an echo of the callee's weights,
  which no check can tell from an honest one). What they get is what standing lets them have.

Measured over the rounds that open after ``warmup`` seconds, for the honest members: blends per outer step taken,
the share of those blends with a hostile key (and in the window's last third), the seconds from a round's opening to
its exchange, discovery bytes per member per second, the members' level and size estimate, the honest members still
looking for a partner at a moment (the free partners an ask can find; a hostile key always is); over the whole run,
the most honest members one hostile group blended with at one outer step. ``run`` returns them;
``--members``, ``--hostile-shares``, ``--pairing`` and ``--partners`` run one swarm per combination, each with the
same seed.
"""

from __future__ import annotations

import hashlib
import heapq
import itertools
import json
import math
import random
import statistics
import time
from collections import Counter
from collections.abc import Callable, Hashable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from noloco_node.config.node_config import DEFAULT_BUCKET_RECORDS
from noloco_node.discovery.buckets import MAX_BUCKET_ENTRIES, Bucket, SwarmSize
from noloco_node.discovery.dht import PeerRecord
from noloco_node.discovery.view import RecordView
from noloco_node.node.outer_step import BEHIND_STEPS
from noloco_node.observability.ledger import connected_groups
from noloco_node.pairing.peer_policy import PeerPolicy
from noloco_node.pairing.reserved import RepeatGrace, meeting_window
from noloco_node.pairing.standing import Standing

ENTRY_BYTES = 1005  # per record per answering DHT peer (measured, issue 43: RSA-2048 owner subkeys, signatures)
REQUEST_BYTES = 300  # a get or store request and the answer's framing, per DHT peer
ANSWERING_PEERS = 2  # DHT peers that answer a read with the key's entries (measured, issue 43)
STORE_PEERS = 2  # DHT peers a record is stored at
LOOKUP_EVERY = 1.0  # a member's lookups (pairing loop and status watch share one: LOOKUP_SHARING_SECONDS)
CONNECT_FAIL_SECONDS = 1.0  # a call to a member that is gone fails after this
HOSTILE_CALL_EVERY = 0.5  # a hostile key calls one ready honest member this often
HOSTILE_VIEW_EVERY = 4.0  # a hostile key rereads its view (the front and the ready members) this often
LOOKING_SAMPLE_SECONDS = 1.0  # how often the honest members still looking are counted
CLAIM_SECONDS = 1.0  # a claim stored in the DHT is read by others this long after it was made
MEETING_LEVELS_BELOW = 2  # "rendezvous": a meeting group is the hosts of 2^2 discovery buckets (~4 x bucket_records)
MEETING_LEVEL_MAJORITY = 0.6  # "rendezvous": of the hosts in view, the share at a level that moves the meetings there
MEETING_PASSES = 3  # "rendezvous": a member left out pairs with those left out of 2, then 4 groups around it
MEETING_READ_AT = 0.2  # "rendezvous": of a slot, when its group is read (every member due in it has written by then)
FINGERPRINT = "protocol"


@dataclass(frozen=True)
class ProtocolSettings:
    members: int  # honest members at the start (hostile keys come on top)
    seconds: float = 900.0  # emulated
    warmup: float = 120.0  # rounds opened before this are not counted
    phase_seconds: float = 30.0  # an outer step's inner steps
    exchange_seconds: float = 2.0  # one exchange's transfer (a 125m model's int8 payload at ~60 MB/s)
    hostile_share: float = 0.1  # of the hosts
    keys_per_hostile: int = 4
    churn_per_hour: float = 0.1  # of the members, leaving (and as many joining) per hour
    straggler_share: float = 0.1
    straggler_slowdown: float = 1.3
    bucket_records: int = DEFAULT_BUCKET_RECORDS
    record_ttl: float = 20.0
    pair_timeout: float = 10.0
    alone_grace: float = 1.0
    max_staleness: int = 2
    standing_seconds: float = 120.0
    stranger_share: float = 0.1
    avoid_seconds: float = 30.0
    pairing: str = "reserve"  # "reserve": draw, then meet (the node's); "ready": calls to records flagged ready;
    # "claimed": draw, then meet, each group's outer step claimed by one partner (a candidate, Swarm.claim);
    # "claimed-key": the same, each key's outer step (what a node can check: a claim is a receipt the key signed)
    partners: str = "known"  # "known": the node's Standing; "established": EstablishedGroupsStanding
    seed: int = 0


class EstablishedGroupsStanding(Standing):
    """The node's standing as it drew the line between partner and stranger before 2026-11-29: a peer is called and
    served on its network group's share only once its record was seen for ``standing_seconds`` and it blended with
    this member. In a new swarm the groups that blended first were the always-ready ones. (A group's share was then
    twice in 2G outer steps, and groups whose share was spent were called last; this class keeps the node's share.)"""

    def _partner(self, peer_id: str, now: float) -> bool:
        return self._established(peer_id, now)


STANDINGS: dict[str, type[Standing]] = {"known": Standing, "established": EstablishedGroupsStanding}
PAIRINGS = ("ready", "reserve", "claimed", "claimed-key", "rendezvous")
CLAIMING = ("claimed", "claimed-key")


class Clock:
    """Emulated seconds, and what is due when: callbacks in time order (ties in the order they were scheduled)."""

    def __init__(self) -> None:
        self.now = 0.0
        self._due: list[tuple[float, int, Callable[[], object]]] = []
        self._order = itertools.count()

    def __call__(self) -> float:
        return self.now

    def after(self, seconds: float, callback: Callable[[], object]) -> None:
        heapq.heappush(self._due, (self.now + max(0.0, seconds), next(self._order), callback))

    def run_until(self, end: float) -> None:
        while self._due and self._due[0][0] <= end:
            self.now, _, callback = heapq.heappop(self._due)
            callback()
        self.now = end


class EmulatedDHT:
    """The run's keys (discovery buckets, and "rendezvous" meeting groups): each key's live entries, bounded as every
    DHT peer of a run bounds them."""

    def __init__(self, clock: Clock) -> None:
        self._clock = clock
        self._keys: dict[Hashable, dict[str, tuple[PeerRecord, float]]] = {}

    def _live(self, bucket: Hashable) -> dict[str, tuple[PeerRecord, float]]:
        entries = self._keys.setdefault(bucket, {})
        now = self._clock.now
        for peer_id in [p for p, (_, expires) in entries.items() if expires < now]:
            del entries[peer_id]
        return entries

    def store(self, bucket: Hashable, record: PeerRecord, expires: float) -> tuple[bool, int]:
        """Whether the entry was stored, and the bytes it cost its writer."""
        entries = self._live(bucket)
        cost = self.read_bytes(len(entries)) + STORE_PEERS * (ENTRY_BYTES + REQUEST_BYTES)
        if record.peer_id not in entries and len(entries) >= MAX_BUCKET_ENTRIES:
            return False, cost
        entries[record.peer_id] = (record, expires)
        return True, cost

    def read(self, bucket: Hashable) -> tuple[list[tuple[PeerRecord, float]], int]:
        """The bucket's entries (every one, whoever wrote it) and the bytes the read cost its reader."""
        entries = self._live(bucket)
        return list(entries.values()), self.read_bytes(len(entries))

    @staticmethod
    def read_bytes(entries: int) -> int:
        return ANSWERING_PEERS * (REQUEST_BYTES + entries * ENTRY_BYTES)


def _hash32(text: str) -> int:
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:4], "big")


MeetingKey = tuple[int, int, int]  # "rendezvous": (slot, level, index)


def meeting_key(network_group: str, slot: int, level: int) -> MeetingKey:
    """A host's meeting group for a slot: the first ``level`` bits of a hash of its network group and the slot, so
    that nobody chooses its group (its address places it) and the groups mix anew at every slot."""
    return slot, level, _hash32(f"{network_group}/{slot}") >> (32 - level) if level else 0


def meeting_pairs(slot: int, entries: list[PeerRecord], max_staleness: int, window: float) -> dict[str, str]:
    """Who meets whom in one meeting group at one slot, the same for every reader of the same entries: one key per
    network group (the lowest hash of key and slot), then pairs of hosts whose outer steps are within reach and due
    within ``window`` of each other, taken greedily in the order of a hash of the two groups and the slot (which
    neither chooses). Each host meets at most one other: a host's keys, or its always-ready records, buy no more."""
    hosts: dict[str, PeerRecord] = {}
    for record in sorted(entries, key=lambda r: (_hash32(f"{r.peer_id}/{slot}"), r.peer_id)):
        hosts.setdefault(record.network_group, record)
    edges: list[tuple[int, str, str]] = []
    for one, other in itertools.combinations(hosts.values(), 2):
        if (
            abs(one.outer_step - other.outer_step) <= max_staleness
            and abs(one.next_step_at - other.next_step_at) <= window
        ):
            low, high = sorted((one.network_group, other.network_group))
            edges.append((_hash32(f"{slot}/{low}/{high}"), one.peer_id, other.peer_id))
    edges.sort()
    partner: dict[str, str] = {}
    for _, a, b in edges:
        if a not in partner and b not in partner:
            partner[a], partner[b] = b, a
    return partner


@dataclass
class MemberCounts:
    rounds: int = 0  # outer steps taken in the measured window
    blends: int = 0
    hostile_blends: int = 0
    late_blends: int = 0  # in rounds opened in the last third of the measured window
    late_hostile_blends: int = 0
    clock_moves: int = 0
    catch_ups: int = 0  # states downloaded after solo steps with every peer out of reach ahead
    unmatched: int = 0  # "rendezvous": outer steps whose meeting group gave this member nobody (or a gone partner)
    found_seconds: list[float] = field(default_factory=list)  # a round's opening to its exchange
    discovery_bytes: int = 0  # in the measured window
    first_blend_after: float | None = None  # a joiner: seconds from its start to its first blend


class Member:
    """One key of the swarm: an honest member, or one of a hostile host's keys."""

    def __init__(self, swarm: Swarm, peer_id: str, address: str, *, hostile: bool, slowdown: float) -> None:
        self.swarm, self.peer_id, self.address, self.hostile, self.slowdown = swarm, peer_id, address, hostile, slowdown
        settings, clock = swarm.settings, swarm.clock
        self.rng = random.Random(swarm.rng.getrandbits(64))
        self.size = SwarmSize(settings.bucket_records)
        self.standing = STANDINGS[settings.partners](
            standing_seconds=settings.standing_seconds,
            stranger_share=settings.stranger_share,
            clock=clock,
            rng=self.rng,
        )
        self.policy = PeerPolicy(
            exchange_timeout=60.0, min_deadline=5.0, avoid_seconds=settings.avoid_seconds, clock=clock
        )
        self.view: RecordView[PeerRecord] = RecordView(self.standing.established, clock=clock)
        self.last_paired: dict[str, int] = {}
        self.alive = True
        self.started = clock.now
        self.outer_step: int | None = None  # None: not training yet (probing for the swarm, then downloading)
        self.round: int = 0  # the current round's number; its_open says whether it is open
        self.round_open = False
        self.round_opened = 0.0
        self.busy = False  # an exchange (or a call) in flight
        self.asking = False  # draw, then meet: an ask in flight (asks in are still answered meanwhile)
        self.repeat = RepeatGrace()  # recent partners wait their turn, as in the node
        self.next_round_at = 0.0  # when the next round opens (draw, then meet: a member's own estimate, told)
        self.reserved: str | None = None  # draw, then meet: the partner this member meets at its next round
        self._claim: tuple[str, int] | None = None  # "claimed": the partner's slot this member's reservation holds
        self._claim_settles = 0.0  # "claimed": when this member has read its claim back (no meeting before)
        self._meeting: tuple[MeetingKey, str | None] | None = None  # "rendezvous": this phase's group, and partner
        self._meeting_level: int | None = None  # "rendezvous": the discovery level its meeting groups follow
        self.phase = 0  # phases begun: a draw belongs to one
        self._tried: set[str] = set()  # draw, then meet: asked in this pass over the candidates, and refused
        self.counts = MemberCounts()
        self._candidates_at = -1.0
        self._looked_up = 0.0  # when the last lookup ended
        self._candidates: list[PeerRecord] = []
        self._near: list[PeerRecord] = []
        self._order: list[PeerRecord] = []  # draw, then meet: whom to ask, from the last lookup
        self._order_at: tuple[float, int] = (-1.0, 0)
        self._within_reach = False
        self._all_ahead = False
        self._behind = 0  # solo steps in a row with every peer out of reach ahead (_catch_up_if_left_behind)

    # ------------------------------------------------------------------------------------------- discovery

    def record(self) -> PeerRecord:
        return PeerRecord(
            peer_id=self.peer_id,
            address=self.address,
            run_fingerprint=FINGERPRINT,
            outer_step=self.outer_step or 0,
            ready=self.looking(),
            updated=self.swarm.clock.now,
            partners=self.standing.recent_partners(),
            next_step_at=self._advertised_due(),
        )

    def looking(self) -> bool:
        """What the record's ``ready`` says: still looking for this phase's partner (draw, then meet), or the round
        open (ready)."""
        if self._reserving():
            return self.reserved is None and self.outer_step is not None
        return self.round_open

    def _advertised_due(self) -> float:
        """When this member says its next outer step is due; a hostile key says what most of its view says."""
        if self.hostile:  # the next due time most of its view will reach (records' phases carried forward)
            now, phase = self.swarm.clock.now, self.swarm.settings.phase_seconds
            dues = sorted(
                r.next_step_at + phase * max(0, math.ceil((now - r.next_step_at) / phase))
                for r in self._near
                if r.next_step_at > 0
            )
            return dues[len(dues) // 2] if dues else now
        return self._due() if self.outer_step is not None and self.outer_step >= 0 else 0.0

    def publish(self, leaving: bool = False) -> None:
        record = replace(self.record(), leaving=leaving)
        expires = self.swarm.clock.now + self.swarm.settings.record_ttl
        for level in self.size.written_levels():
            _, cost = self.swarm.dht.store(Bucket.of(self.peer_id, level), record, expires)
            self._count_bytes(cost)

    def refresh_loop(self) -> None:
        if not self.alive:
            return
        self.publish()
        self.swarm.clock.after(self.swarm.settings.record_ttl / 3, self.refresh_loop)

    def lookup_loop(self) -> None:
        if not self.alive:
            return
        bucket = Bucket.random(self.size.read_level(), self.rng)
        entries, cost = self.swarm.dht.read(bucket)
        self._count_bytes(cost)
        found = [(record, expires) for record, expires in entries if bucket.holds(record.peer_id)]
        self.view.replace(bucket, [(record, expires) for record, expires in found if not record.leaving])
        others = sum(1 for record, _ in found if record.peer_id != self.peer_id)
        above_level = self.size.above_level()  # before this read counts: the node's own rule
        if self.size.observe(bucket, len(found), others):
            self.publish()
        if above_level is not None:  # a larger swarm, if anything: in view only once the member moves there
            above = Bucket.random(above_level, self.rng)
            entries, cost = self.swarm.dht.read(above)
            self._count_bytes(cost)
            found = [(record, expires) for record, expires in entries if above.holds(record.peer_id)]
            if self.size.observe(above, len(found), sum(1 for record, _ in found if record.peer_id != self.peer_id)):
                self.view.replace(above, [(record, expires) for record, expires in found if not record.leaving])
                self.publish()
        if self.outer_step is None and not self.hostile and not self.size.probing:
            self._join_training()
        self._looked_up = self.swarm.clock.now
        self.swarm.clock.after(LOOKUP_EVERY, self.lookup_loop)

    def live(self) -> list[PeerRecord]:
        return [r for r in self.view.records() if r.peer_id != self.peer_id]

    def _front(self) -> int:
        steps = sorted(r.outer_step for r in self.live())
        return steps[(len(steps) - 1) // 2] if steps else 0

    def _count_bytes(self, count: int) -> None:
        if self.swarm.measured(self.swarm.clock.now):
            self.counts.discovery_bytes += count

    # ------------------------------------------------------------------------------------------- training

    def start_training(self, outer_step: int, first_phase: float) -> None:
        self.outer_step = outer_step
        self.next_round_at = self.swarm.clock.now + first_phase
        self.swarm.clock.after(first_phase, self.open_round)
        self._begin_phase()

    def _reserving(self) -> bool:
        return self.swarm.settings.pairing in ("reserve", "rendezvous", *CLAIMING)

    def _begin_phase(self) -> None:
        self.phase += 1
        self.reserved = None
        self._release_claim()
        self._tried.clear()
        self._meeting = None
        if self._reserving():
            self.publish()  # looking again
            phase = self.phase
            if self.swarm.settings.pairing == "rendezvous":
                self._enter_meeting(phase)
            else:
                self.swarm.clock.after(self.rng.uniform(0.05, 0.3), lambda: self._draw(phase))

    def _join_training(self) -> None:
        """A joiner that found the swarm downloads a donor's state (the lower median step in view) and trains on."""
        front = self._front()
        self.outer_step = -1  # downloading
        self.swarm.clock.after(self.swarm.settings.exchange_seconds, lambda: self.start_training(front, self._phase()))

    def _phase(self) -> float:
        return self.swarm.settings.phase_seconds * self.slowdown * self.rng.uniform(0.9, 1.1)

    def open_round(self) -> None:
        if not self.alive:
            return
        settings, clock = self.swarm.settings, self.swarm.clock
        assert self.outer_step is not None
        live = self.live()
        moved = self.standing.swarm_step(
            self.outer_step,
            {r.peer_id: r.outer_step for r in live},
            settings.max_staleness,
            settings.phase_seconds * self.slowdown,
        )
        if moved is not None:
            self.outer_step = moved.outer_step
            if self.swarm.measured(clock.now):
                self.counts.clock_moves += 1
        self.round += 1
        self.round_open, self.round_opened = True, clock.now
        if self.swarm.measured(clock.now):
            self.counts.rounds += 1
        self.publish()
        number = self.round
        clock.after(self._wait_seconds(), lambda: self._timeout(number))
        if self._reserving():
            if not self._meet() and self.reserved is None:
                if self._meeting is not None:  # "rendezvous": its group gave it nobody who comes
                    self._close(None)
                else:
                    self._draw(self.phase)
            return
        clock.after(self.rng.uniform(0.05, 0.25), lambda: self._seek(number, clock.now + settings.alone_grace))

    def _wait_seconds(self) -> float:
        """How long an open round waits for a partner: --pair-timeout; under draw, then meet half a phase first, as
        the node's reserved rounds do (pairing_round.py ``PairingRound.wait``: the inner steps borrowed meanwhile are
        the next phase's, which ``next_round_at`` counts from the round's opening)."""
        settings = self.swarm.settings
        if self._reserving():
            return settings.phase_seconds * self.slowdown / 2 + settings.pair_timeout
        return settings.pair_timeout

    def _window(self) -> float:
        """How far apart two members' outer steps may be due for them to reserve each other (the node's
        ``meeting_window``, from this member's phase)."""
        settings = self.swarm.settings
        return meeting_window(settings.pair_timeout, settings.phase_seconds * self.slowdown)

    def _timeout(self, number: int) -> None:
        if self.round == number and self.round_open and not self.busy:
            self.reserved = None
            self._close(None)

    def _close(self, partner: Member | None) -> None:
        settings, clock = self.swarm.settings, self.swarm.clock
        self.round_open = False
        grace = RepeatGrace.seconds(partner is not None, settings.pair_timeout, settings.phase_seconds)
        self.repeat = RepeatGrace.starting(clock.now, grace, self._near, self.last_paired)
        assert self.outer_step is not None
        self.outer_step += 1
        self.next_round_at = max(self.round_opened + self._phase(), clock.now + 0.01)  # steps borrowed while waiting
        if partner is None and self._catch_up_if_left_behind():
            self.next_round_at += settings.exchange_seconds  # the download, before the next phase
        clock.after(self.next_round_at - clock.now, self.open_round)
        self._begin_phase()

    def _catch_up_if_left_behind(self) -> bool:
        """The node's catch-up (node/outer_step.py ``_catch_up_if_left_behind``): after BEHIND_STEPS solo steps in a
        row with every peer whose word counts at or beyond the edge of reach ahead, adopt a donor's state (the lower
        median step of those ahead). Not emulated: the node's straggler rule and its backoff."""
        assert self.outer_step is not None
        edge = self.outer_step + self.swarm.settings.max_staleness
        steps = [r.outer_step for r in self.live() if self.standing.believable(r.peer_id)]
        ahead = sorted(step for step in steps if step >= edge)
        if not ahead or any(self.outer_step - self.swarm.settings.max_staleness <= step < edge for step in steps):
            self._behind = 0
            return False
        self._behind += 1
        if self._behind < BEHIND_STEPS:
            return False
        self._behind = 0
        self.outer_step = ahead[(len(ahead) - 1) // 2]
        if self.swarm.measured(self.swarm.clock.now):
            self.counts.catch_ups += 1
        return True

    def _refresh_candidates(self) -> list[PeerRecord]:
        """What the pairing loop reads from a lookup: recomputed once per lookup (the node shares one a second)."""
        clock, settings = self.swarm.clock, self.swarm.settings
        if clock.now - self._candidates_at >= LOOKUP_EVERY:
            assert self.outer_step is not None
            live = self.live()
            self.standing.observe(live, self.outer_step, settings.max_staleness)
            self.policy.forget({r.peer_id for r in live})
            for gone in set(self.last_paired) - {r.peer_id for r in live}:
                del self.last_paired[gone]
            near = [r for r in live if abs(r.outer_step - self.outer_step) <= settings.max_staleness]
            self._near = near
            self._candidates = [r for r in near if r.ready]
            self._within_reach = bool(near)
            self._all_ahead = bool(live) and all(r.outer_step > self.outer_step + settings.max_staleness for r in live)
            self._candidates_at = clock.now
        return self._candidates

    def _seek(self, number: int, alone_until: float) -> None:
        if self.round != number or not self.round_open or self.busy or not self.alive:
            return
        clock = self.swarm.clock
        candidates = self._refresh_candidates()
        reachable = [c for c in candidates if not self.policy.avoided(c.peer_id)]
        if not self._within_reach and (self._all_ahead or clock.now >= alone_until):
            self._close(None)
            return
        order = self.standing.order([c for c in reachable if self._may_pair_with(c.peer_id)], self.last_paired)
        self._call_in_turn(number, order, alone_until)

    def _call_in_turn(self, number: int, order: list[PeerRecord], alone_until: float) -> None:
        if self.round != number or not self.round_open or self.busy or not self.alive:
            return
        if not order:
            self.swarm.clock.after(self.rng.uniform(0.05, 0.3), lambda: self._seek(number, alone_until))
            return
        peer, rest = order[0], order[1:]
        self.busy = True
        callee = self.swarm.members.get(peer.peer_id)
        rtt = self.swarm.round_trip(self, callee)
        if callee is None or not callee.alive:

            def failed() -> None:
                self.busy = False
                self.policy.failed(peer.peer_id)
                self._after_call(number, rest, alone_until)

            self.swarm.clock.after(CONNECT_FAIL_SECONDS, failed)
            return
        if not callee.takes_call_from(self):

            def refused() -> None:
                self.busy = False
                self.standing.heard_from(peer.peer_id)
                self._after_call(number, rest, alone_until)

            self.swarm.clock.after(rtt, refused)
            return
        self.standing.spend_stranger_turn(peer.peer_id)
        self.standing.heard_from(peer.peer_id)
        self.swarm.exchange(self, callee, rtt)

    def _after_call(self, number: int, rest: list[PeerRecord], alone_until: float) -> None:
        if (
            self.round == number
            and self.round_open
            and self.swarm.clock.now >= self.round_opened + (self.swarm.settings.pair_timeout)
        ):
            self._close(None)
            return
        self._call_in_turn(number, rest, alone_until)

    # ------------------------------------------------------------------------------------------- draw, then meet

    def _due(self) -> float:
        """When this member is at its next outer step: its open round's opening, or the next round's."""
        return self.round_opened if self.round_open else self.next_round_at

    def _draw(self, phase: int) -> None:
        """Draw, then meet: ask the next candidate in ``Standing.order`` (every record within reach, ready or not)
        to meet at both members' next outer steps; until one says yes, or the round settles."""
        if self.phase != phase or self.reserved is not None or self.asking or self.busy or not self.alive:
            return
        settings, clock = self.swarm.settings, self.swarm.clock
        if settings.pairing == "rendezvous":  # whom it meets is its meeting group's to say, nobody's ask
            return
        self._refresh_candidates()
        alone = self._all_ahead or clock.now >= self.round_opened + settings.alone_grace
        if self.round_open and not self._within_reach and alone:
            self._close(None)
            return
        if self._order_at != (self._candidates_at, phase):  # once per lookup and phase, not once per ask
            window = self._window()
            due = [r for r in self._near if abs(r.next_step_at - self._due()) <= window]
            # Those whose records say they are still looking first: a member reserved early in its phase stays so
            looking = self.standing.order([r for r in due if r.ready], self.last_paired)
            self._order = looking or self.standing.order(due, self.last_paired)
            self._order_at = (self._candidates_at, phase)
        peer = next(
            (
                r
                for r in self._order
                if r.peer_id not in self._tried
                and not self.policy.avoided(r.peer_id)
                and self._may_pair_with(r.peer_id)
            ),
            None,
        )
        if peer is None:  # a pass over every candidate met no yes: ask them again after the next lookup
            self._tried.clear()
            clock.after(LOOKUP_EVERY, lambda: self._draw(phase))
            return
        callee = self.swarm.members.get(peer.peer_id)
        self.asking = True
        if callee is None or not callee.alive:

            def failed() -> None:
                self.asking = False
                self.policy.failed(peer.peer_id)
                self._after_draw(phase)

            clock.after(CONNECT_FAIL_SECONDS, failed)
            return

        def answered() -> None:
            self.asking = False
            self.standing.heard_from(peer.peer_id)
            if self.reserved is not None:  # reserved by a peer's ask meanwhile: this one is withdrawn
                return
            if self.phase == phase and not self.swarm.slot_taken(callee, self) and callee.takes_reservation_from(self):
                self.standing.spend_stranger_turn(peer.peer_id)
                self.reserved = callee.peer_id
                self.swarm.claim(callee, self)
                self.publish()
                if not callee.hostile:
                    callee.reserved = self.peer_id
                    self.swarm.claim(self, callee)
                    callee.publish()
                if not self._meet() and callee.round_open and not callee.hostile:
                    callee._meet()
                return
            self._tried.add(peer.peer_id)
            self._after_draw(phase)

        clock.after(self.swarm.round_trip(self, callee), answered)

    def _after_draw(self, phase: int) -> None:
        if self.round_open and self.swarm.clock.now >= self.round_opened + self._wait_seconds():
            self._close(None)
        else:
            self._draw(phase)

    def _enter_meeting(self, phase: int) -> None:
        """Under rendezvous: writes this phase's entry (its step, and when it is due) to its meeting group of the
        slot its step is due in, and reads the group once every member due in that slot has written (MEETING_READ_AT
        of the slot, and the DHT's CLAIM_SECONDS). A step due after its slot's group was read (a phase begun late,
        after a long wait) goes to the next slot's group, where those due within the window of it may meet it."""
        clock, slot_seconds = self.swarm.clock, self.swarm.settings.phase_seconds
        due = self._due()
        slot = math.floor(due / slot_seconds)
        if (slot + MEETING_READ_AT) * slot_seconds + CLAIM_SECONDS < clock.now:
            slot += 1
        read_at = (slot + MEETING_READ_AT) * slot_seconds + CLAIM_SECONDS
        entry = replace(self.record(), next_step_at=due)
        key = meeting_key(entry.network_group, slot, max(0, self._swarm_level() - MEETING_LEVELS_BELOW))
        _, cost = self.swarm.dht.store(key, entry, (slot + 2) * slot_seconds)
        self._count_bytes(cost)
        clock.after(read_at - clock.now, lambda: self._read_meeting(phase, key))

    def _read_meeting(self, phase: int, key: MeetingKey) -> None:
        """Under rendezvous: the group's pairing (``meeting_pairs``, what every reader of it computes); a member it
        leaves out reads the sibling group too, and the hosts both groups left out are paired the same way (under
        their parent key). The partner named is reserved if standing serves it (the node's ask to it would be its
        confirmation) and met at both members' steps; a member named with nobody goes alone at its step."""
        if self.phase != phase or not self.alive:
            return
        slot, level, index = key
        read: dict[MeetingKey, list[PeerRecord]] = {}
        partner_id = None
        for height in range(min(MEETING_PASSES, level + 1)):
            pairs, _ = self._subtree(slot, level, index >> height, height, read)
            partner_id = pairs.get(self.peer_id)
            if partner_id is not None:
                key = (slot, level - height, index >> height)
                break
        partner = self.swarm.members.get(partner_id) if partner_id is not None else None
        if partner is not None and partner.alive:
            self.standing.heard_from(partner.peer_id)
            if self.policy.quarantined(partner.peer_id) or not self.standing.may_serve(partner.peer_id):
                partner = None
            else:
                self.standing.spend_stranger_turn(partner.peer_id)
        else:
            partner = None
        self._meeting = (key, partner.peer_id if partner is not None else None)
        if partner is None:
            if self.swarm.measured(self._due()):
                self.counts.unmatched += 1
            if self.round_open and not self.busy:
                self._close(None)
            return
        self.reserved = partner.peer_id
        if self.round_open and not self._meet() and self.reserved is None and not self.busy:
            self._close(None)

    def _swarm_level(self) -> int:
        """Under rendezvous: the discovery level most hosts of its view are at (a record would say its writer's
        level; here the bench reads it off the member), kept until another level has MEETING_LEVEL_MAJORITY of them:
        members a level apart (an estimate near a level's edge) would otherwise meet in different groups, and a
        host that writes at every level would meet one member at each. Every host of the view counts here; a node
        must count only hosts it has heard from, or records that name free addresses choose its level."""
        levels: dict[str, int] = {}
        for record in self.live():
            member = self.swarm.members.get(record.peer_id)
            if member is not None and record.network_group not in levels:
                levels[record.network_group] = member.size.level
        counts = Counter(levels.values())
        if counts:
            level, most = counts.most_common(1)[0]
            if self._meeting_level is None or most > MEETING_LEVEL_MAJORITY * len(levels):
                self._meeting_level = level
        return self._meeting_level if self._meeting_level is not None else self.size.level

    def _subtree(
        self, slot: int, level: int, root: int, height: int, read: dict[MeetingKey, list[PeerRecord]]
    ) -> tuple[dict[str, str], list[PeerRecord]]:
        """Under rendezvous: the pairs of the meeting groups at ``level`` under ``root`` (a prefix ``height`` bits
        shorter), and the hosts they leave out: each group paired alone, then the two halves' left-out hosts paired
        together under their parent key, up to ``root``. What every member whose group is there computes."""
        if height == 0:
            key = (slot, level, root)
            if key not in read:
                read[key] = self._read_group(key)
            entries, pairs = read[key], self.swarm.meeting_pairs(key, read[key])
        else:
            low_pairs, low = self._subtree(slot, level, 2 * root, height - 1, read)
            high_pairs, high = self._subtree(slot, level, 2 * root + 1, height - 1, read)
            entries = low + high
            pairs = {**low_pairs, **high_pairs, **self.swarm.meeting_pairs((slot, level - height, root), entries, True)}
        matched = {r.network_group for r in entries if r.peer_id in pairs}
        return pairs, [r for r in entries if r.network_group not in matched]

    def _read_group(self, key: MeetingKey) -> list[PeerRecord]:
        """A meeting group's entries: those whose network group places them there (the key is anybody's to write),
        and whose member answers (the reader's call to each: a record for an address nobody holds is no host)."""
        entries, cost = self.swarm.dht.read(key)
        slot, level, _ = key
        group = [r for r, _ in entries if not r.leaving and meeting_key(r.network_group, slot, level) == key]
        self._count_bytes(cost + len(group) * 2 * REQUEST_BYTES)
        members = self.swarm.members
        return [r for r in group if r.peer_id in members and members[r.peer_id].alive]

    def takes_reservation_from(self, caller: Member) -> bool:
        """A request to meet at both members' next outer steps: taken when this member is free and unreserved, the
        caller within reach, both due within the meeting window of each other, not a repeat inside the grace, and
        served by standing (which then spends a stranger turn if it needs one)."""
        settings = self.swarm.settings
        if not self.alive or self.busy or self.reserved is not None or caller.outer_step is None:
            return False
        if self.outer_step is None or self.outer_step < 0 or self.swarm.settings.pairing == "rendezvous":
            return False
        if self.hostile:  # always there, at any step
            return True
        if abs(caller.outer_step - self.outer_step) > settings.max_staleness:
            return False
        due = self._due() if caller.hostile else caller._due()  # a hostile key says whatever suits
        if abs(due - self._due()) > self._window() or self.swarm.slot_taken(caller, self):
            return False
        if self.round_open and self.swarm.clock.now >= self.round_opened + self._wait_seconds():
            return False
        return self._lets_in(caller)

    def _meet(self) -> bool:
        """Exchanges with the reserved partner if both are at their outer steps; drops a reservation the partner no
        longer holds. Whether an exchange began."""
        if self.reserved is None or not self.round_open or self.busy:
            return False
        partner = self.swarm.members.get(self.reserved)
        if self._meeting is not None and partner is not None and partner.alive and not partner.hostile:
            theirs = partner._meeting
            if theirs is None:  # "rendezvous": the partner has not read the group yet; its read meets
                return False
            if theirs != (self._meeting[0], self.peer_id):  # it read another pairing (or moved on)
                self.reserved = None
                return False
        elif partner is None or not partner.alive or (not partner.hostile and partner.reserved != self.peer_id):
            self.reserved = None
            self._release_claim()
            return False
        if max(self._claim_settles, partner._claim_settles) > self.swarm.clock.now:
            return False  # a claim not read back yet: its read-back meets
        if partner.hostile or (partner.round_open and not partner.busy):
            self.swarm.exchange(self, partner, self.swarm.round_trip(self, partner))
            return True
        return False

    def _release_claim(self) -> None:
        """A reservation dropped without its exchange gives the partner's slot back ("claimed")."""
        if self._claim is not None:
            self.swarm.release(self._claim, self.peer_id)
            self._claim = None

    def lose_claim(self, slot: tuple[str, int]) -> None:
        """Another member's claim on the slot this member's reservation holds won ("claimed": each read its claim
        back): the reservation is dropped, and the member draws again."""
        if self._claim != slot or self.reserved is None or self.busy:
            return
        self.reserved = None
        self._release_claim()
        self.publish()
        if self.round_open:
            self._after_draw(self.phase)
        else:
            self._draw(self.phase)

    def _may_pair_with(self, peer_id: str) -> bool:
        return self.repeat.allows(peer_id, self.swarm.clock.now)

    def takes_call_from(self, caller: Member) -> bool:
        """An incoming call: taken when this member's round is open and free, the caller within reach, not a
        repeat inside the grace, and served by standing (which then spends a stranger turn if it needs one)."""
        if not self.alive or self.busy or not self.round_open or self.outer_step is None or caller.outer_step is None:
            return False
        if self.hostile:
            return True
        if abs(caller.outer_step - self.outer_step) > self.swarm.settings.max_staleness:
            return False
        return self._lets_in(caller)

    def _lets_in(self, caller: Member) -> bool:
        """Not a repeat inside the grace, not quarantined, and served by standing (which then spends a stranger turn
        if it needs one): what a call in and an ask in must both pass."""
        self.standing.heard_from(caller.peer_id)
        if not self._may_pair_with(caller.peer_id) or self.policy.quarantined(caller.peer_id):
            return False
        if not self.standing.may_serve(caller.peer_id):
            return False
        self.standing.spend_stranger_turn(caller.peer_id)
        return True

    def blended(self, partner: Member, seconds: float) -> None:
        clock = self.swarm.clock
        self.busy = False
        if self.hostile:
            return
        self._claim = None  # blended: the slot stays claimed
        assert self.outer_step is not None
        self.last_paired[partner.peer_id] = self.outer_step
        self.standing.blended(partner.peer_id, self.outer_step)
        if partner.hostile:
            self.swarm.hostile_group_blends[(partner.record().network_group, self.outer_step)] += 1
        self.policy.succeeded(partner.peer_id, seconds)
        if self.swarm.measured(self.round_opened):
            self.counts.blends += 1
            self.counts.hostile_blends += partner.hostile
            if self.swarm.late(self.round_opened):
                if not partner.hostile:
                    self.swarm.late_pairs.append((self.peer_id, partner.peer_id))
                self.counts.late_blends += 1
                self.counts.late_hostile_blends += partner.hostile
            self.counts.found_seconds.append(clock.now - seconds - self.round_opened)
        if self.counts.first_blend_after is None:
            self.counts.first_blend_after = clock.now - self.started
        self._close(partner)

    # ------------------------------------------------------------------------------------------- hostile keys

    def hostile_loop(self) -> None:
        """A hostile key: always ready, at the front of its view; calls a ready honest member now and then (draw, then
        meet: asks any honest member within reach to meet it, and is there whenever the member comes)."""
        if not self.alive:
            return
        # What a recent lookup showed (every few seconds: hundreds of keys, always ready, need not read every one)
        if self._candidates_at < self._looked_up - HOSTILE_VIEW_EVERY:
            live = self.live()
            members = self.swarm.members
            # Where the honest members of its view are: the hostile hosts act as one attacker and know their keys,
            # which only echo and, counted, would drag it behind
            steps = sorted(r.outer_step for r in live if r.peer_id in members and not members[r.peer_id].hostile)
            self.outer_step = steps[(len(steps) - 1) // 2] if steps else 0
            self._candidates = [
                r
                for r in live
                if (r.ready or self._reserving())
                and abs(r.outer_step - self.outer_step) <= self.swarm.settings.max_staleness
                and r.peer_id in members
                and not members[r.peer_id].hostile
            ]
            self._candidates_at = self._looked_up
            self._near = self._candidates
        self.round_open = True
        if not self.busy and self._candidates and self.swarm.settings.pairing != "rendezvous":
            callee = self.swarm.members.get(self.rng.choice(self._candidates).peer_id)
            if self._reserving():
                if callee is not None and callee.takes_reservation_from(self):
                    callee.reserved = self.peer_id
                    self.swarm.claim(self, callee)
                    callee.publish()
                    callee._meet()
            elif callee is not None and callee.takes_call_from(self):
                self.busy = True
                self.swarm.exchange(self, callee, self.swarm.round_trip(self, callee))
        self.swarm.clock.after(HOSTILE_CALL_EVERY, self.hostile_loop)

    def leave(self, crashed: bool) -> None:
        if not crashed:
            self.publish(leaving=True)
        self.alive = False


class Swarm:
    def __init__(self, settings: ProtocolSettings) -> None:
        self.settings = settings
        self.rng = random.Random(settings.seed)
        self.clock = Clock()
        self.dht = EmulatedDHT(self.clock)
        self.members: dict[str, Member] = {}
        self.departed: list[Member] = []
        # Honest members' blends with each other in the window's last third: whether the swarm still mixes as one.
        self.late_pairs: list[tuple[str, str]] = []
        self._latency: dict[str, float] = {}
        self._hosts = itertools.count(1)
        # "claimed": each (network group, outer step) slot's claims, (made at, rank, claimant)
        self.claims: dict[tuple[str, int], list[tuple[float, float, str]]] = {}
        # Honest members' blends with each hostile group, by the members' outer step: what "claimed" bounds to one
        self.hostile_group_blends: Counter[tuple[str, int]] = Counter()
        # Honest members still looking, counted every LOOKING_SAMPLE_SECONDS of the measured window: the partners an
        # ask can find free, against the hostile groups, which always are
        self.looking_samples: list[int] = []
        self.hostile_hosts: list[list[Member]] = []
        # "rendezvous": each meeting group's last pairing, by the entries it was computed from
        self._pairings: dict[tuple[MeetingKey, bool], tuple[frozenset[tuple[str, int, float]], dict[str, str]]] = {}

    # ------------------------------------------------------------------------------------------- claims (a candidate)

    def _slot(self, partner: Member, claimant: Member) -> tuple[str, int]:
        """The slot a reservation with ``partner`` takes: its network group ("claimed"; its key with "claimed-key") at
        the outer step the meeting is at (a hostile key says the claimant's own, whatever suits it)."""
        step = claimant.outer_step if partner.hostile else partner.outer_step
        owner = partner.peer_id if self.settings.pairing == "claimed-key" else partner.record().network_group
        return owner, step or 0

    def slot_taken(self, partner: Member, claimant: Member) -> bool:
        """Whether another member's claim on ``partner``'s slot is there to read: with ``pairing="claimed"`` a
        group meets one partner per outer step (another group's; its own members pair among themselves freely), and
        a member reads the partner's slot before it reserves."""
        if self.settings.pairing not in CLAIMING or claimant.hostile:
            return False
        if partner.record().network_group == claimant.record().network_group:
            return False
        visible = self.clock.now - CLAIM_SECONDS
        return any(
            made <= visible and who != claimant.peer_id
            for made, _, who in self.claims.get(self._slot(partner, claimant), [])
        )

    def claim(self, partner: Member, claimant: Member) -> None:
        """An honest member that reserved ``partner`` stores its claim on the partner's slot (signed by both: the
        meeting's receipt), then reads the slot back once every claim made meanwhile is there: of claims made
        within CLAIM_SECONDS of each other the lowest rank (drawn here; in a node a hash of the claim, which nobody
        chooses) keeps the slot, and the others drop their reservations."""
        if self.settings.pairing not in CLAIMING or claimant.hostile:
            return
        if partner.record().network_group == claimant.record().network_group:
            return
        slot = self._slot(partner, claimant)
        mine = (self.clock.now, self.rng.random(), claimant.peer_id)
        self.claims.setdefault(slot, []).append(mine)
        claimant._claim = slot
        claimant._claim_settles = self.clock.now + 2 * CLAIM_SECONDS

        def read_back() -> None:
            rivals = [
                c for c in self.claims.get(slot, []) if c[2] != claimant.peer_id and c[0] <= mine[0] + CLAIM_SECONDS
            ]
            if any(rank < mine[1] for _, rank, _ in rivals):
                claimant.lose_claim(slot)
            elif claimant._claim == slot and claimant.round_open:
                claimant._meet()

        self.clock.after(2 * CLAIM_SECONDS, read_back)

    def release(self, slot: tuple[str, int], claimant: str) -> None:
        kept = [c for c in self.claims.get(slot, []) if c[2] != claimant]
        if kept:
            self.claims[slot] = kept
        else:
            self.claims.pop(slot, None)

    # ------------------------------------------------------------------------------------------- meetings (a candidate)

    def meeting_pairs(self, key: MeetingKey, entries: list[PeerRecord], left_out: bool = False) -> dict[str, str]:
        """``meeting_pairs`` of a group's entries (or of two sibling groups' left-out hosts, under their parent key),
        computed once for every reader that reads the same ones."""
        seen = frozenset((r.peer_id, r.outer_step, r.next_step_at) for r in entries)
        cached = self._pairings.get((key, left_out))
        if cached is None or cached[0] != seen:
            settings = self.settings
            window = meeting_window(settings.pair_timeout, settings.phase_seconds)
            cached = (seen, meeting_pairs(key[0], entries, settings.max_staleness, window))
            self._pairings[(key, left_out)] = cached
        return cached[1]

    def hostile_meetings(self, slot: int) -> None:
        """Under rendezvous: each hostile host writes an entry to its meeting group of ``slot`` at its level and the
        levels beside it (wherever members may read), one of its keys in turn, its step what most of its view is at,
        due mid-slot (within the window of most members due in it)."""
        slot_seconds = self.settings.phase_seconds
        for keys in self.hostile_hosts:
            key = keys[slot % len(keys)]
            entry = replace(key.record(), next_step_at=(slot + 0.5) * slot_seconds)
            for level in {max(0, key.size.level - MEETING_LEVELS_BELOW + d) for d in (-1, 0, 1)}:
                self.dht.store(meeting_key(entry.network_group, slot, level), entry, (slot + 2) * slot_seconds)
        for old in [k for k in self._pairings if k[0][0] < slot - 2]:
            del self._pairings[old]
        self.clock.after(slot_seconds, lambda: self.hostile_meetings(slot + 1))

    def _address(self) -> str:
        """A public address of a /24 of its own (addresses.network_group): 11.0.0.1, 11.0.1.1, ..."""
        host = next(self._hosts)
        return f"{11 + host // 65536}.{host // 256 % 256}.{host % 256}.1:7000"

    def _peer_id(self) -> str:
        return "nl" + format(self.rng.getrandbits(160), "040x")

    def add_honest(self, *, joining: bool) -> Member:
        settings = self.settings
        slowdown = settings.straggler_slowdown if self.rng.random() < settings.straggler_share else 1.0
        member = Member(self, self._peer_id(), self._address(), hostile=False, slowdown=slowdown)
        self._enter(member)
        if not joining:  # the swarm's first members start at step 0, each when its own launch brings it up
            member.start_training(0, self.rng.uniform(0, settings.phase_seconds))
        return member

    def add_hostile_host(self) -> None:
        address = self._address()
        keys = []
        for _ in range(self.settings.keys_per_hostile):
            member = Member(self, self._peer_id(), address, hostile=True, slowdown=1.0)
            member.outer_step = 0
            keys.append(member)
            self._enter(member)
            self.clock.after(self.rng.uniform(0, HOSTILE_CALL_EVERY), member.hostile_loop)
        self.hostile_hosts.append(keys)

    def _enter(self, member: Member) -> None:
        self.members[member.peer_id] = member
        self._latency[member.peer_id] = self.rng.uniform(0.01, 0.15)  # one way, to the internet's core
        self.clock.after(self.rng.uniform(0, LOOKUP_EVERY), member.lookup_loop)
        self.clock.after(self.rng.uniform(0, 0.5), member.refresh_loop)

    def _count_looking(self) -> None:
        if self.measured(self.clock.now):
            self.looking_samples.append(
                sum(1 for m in self.members.values() if not m.hostile and m.alive and not m.busy and m.looking())
            )
        self.clock.after(LOOKING_SAMPLE_SECONDS, self._count_looking)

    def measured(self, moment: float) -> bool:
        """Whether a round opened (or bytes moved) at ``moment`` counts: after the warm-up, and early enough that
        its round has settled before the end."""
        return self.settings.warmup <= moment <= self.measured_until

    @property
    def measured_until(self) -> float:
        """The last moment a round may open and still settle before the end: the longest wait (half the slowest
        phase, then --pair-timeout, under draw, then meet; the same window for every pairing rule, so that their
        counts compare), an exchange and 2 s."""
        settings = self.settings
        wait = settings.phase_seconds * max(1.0, settings.straggler_slowdown) / 2 + settings.pair_timeout
        return settings.seconds - wait - settings.exchange_seconds - 2

    def late(self, moment: float) -> bool:
        """Whether a round opened at ``moment`` is in the last third of the measured window: where the hostile share
        has left the first G-step windows behind."""
        end = self.measured_until
        return moment >= end - (end - self.settings.warmup) / 3

    def round_trip(self, a: Member, b: Member | None) -> float:
        return 2 * (self._latency[a.peer_id] + (self._latency[b.peer_id] if b is not None else 0.1))

    def exchange(self, caller: Member, callee: Member, rtt: float) -> None:
        caller.busy = callee.busy = True
        seconds = self.settings.exchange_seconds + 2 * rtt
        started = self.clock.now

        def done() -> None:
            if not (caller.alive and callee.alive):  # one side left mid-exchange: the other's call failed
                for side, other in ((caller, callee), (callee, caller)):
                    side.busy = False
                    if side.alive and not side.hostile:
                        side.policy.failed(other.peer_id)
                        if side._reserving():
                            side.reserved = None
                            side._after_draw(side.phase)
                        else:
                            side._after_call(side.round, [], self.clock.now)
                return
            caller.blended(callee, self.clock.now - started)
            callee.blended(caller, self.clock.now - started)

        self.clock.after(seconds, done)

    def churn(self) -> None:
        """One member leaves (a crash or a tombstone) and a new one joins a while later."""
        honest = [m for m in self.members.values() if not m.hostile and m.alive]
        if honest:
            leaving = self.rng.choice(honest)
            leaving.leave(crashed=self.rng.random() < 0.5)
            del self.members[leaving.peer_id]
            self.departed.append(leaving)
            self.clock.after(self.rng.uniform(0, 60), lambda: self.add_honest(joining=True))
        rate = self.settings.churn_per_hour * self.settings.members / 3600
        if rate > 0:
            self.clock.after(self.rng.expovariate(rate), self.churn)

    def run(self) -> dict[str, Any]:
        settings = self.settings
        for _ in range(settings.members):
            self.add_honest(joining=False)
        hosts = round(settings.members * settings.hostile_share / (1 - settings.hostile_share))
        for _ in range(hosts):
            self.add_hostile_host()
        rate = settings.churn_per_hour * settings.members / 3600
        if rate > 0:
            self.clock.after(self.rng.expovariate(rate), self.churn)
        self.clock.after(LOOKING_SAMPLE_SECONDS, self._count_looking)
        if settings.pairing == "rendezvous" and self.hostile_hosts:
            self.clock.after(settings.phase_seconds / 2, lambda: self.hostile_meetings(1))
        started = time.process_time()
        self.clock.run_until(settings.seconds)
        return self._report(hosts, time.process_time() - started)

    def _report(self, hostile_hosts: int, cpu_seconds: float) -> dict[str, Any]:
        settings = self.settings
        honest = [m for m in [*self.members.values(), *self.departed] if not m.hostile]
        staying = [m for m in self.members.values() if not m.hostile]
        rounds = sum(m.counts.rounds for m in honest)
        blends = sum(m.counts.blends for m in honest)
        hostile_blends = sum(m.counts.hostile_blends for m in honest)
        late = sum(m.counts.late_blends for m in honest)
        late_hostile = sum(m.counts.late_hostile_blends for m in honest)
        found = sorted(s for m in honest for s in m.counts.found_seconds)
        window = self.measured_until - settings.warmup
        joiners = [m.counts.first_blend_after for m in honest if m.started > 0]
        rates = sorted(m.counts.blends / m.counts.rounds for m in staying if m.counts.rounds >= 5)
        levels = [m.size.level for m in staying]
        estimates = [m.size.estimate for m in staying if m.size.estimate is not None]
        return {
            "members": settings.members,
            "pairing": settings.pairing,
            "partners": settings.partners,
            "hostile_hosts": hostile_hosts,
            "hostile_keys": hostile_hosts * settings.keys_per_hostile,
            "hostile_host_share": hostile_hosts / max(1, hostile_hosts + settings.members),
            "emulated_seconds": settings.seconds,
            "left_and_joined": len(self.departed),
            "rounds": rounds,
            "blend_rate": blends / rounds if rounds else 0.0,
            "members_below_90_percent": sum(rate < 0.9 for rate in rates),
            "lowest_member_rate": rates[0] if rates else None,
            "hostile_share_of_blends": hostile_blends / blends if blends else 0.0,
            "hostile_share_of_late_blends": late_hostile / late if late else 0.0,
            "most_blends_of_a_hostile_group_at_one_step": max(self.hostile_group_blends.values(), default=0),
            "honest_looking_mean": statistics.fmean(self.looking_samples) if self.looking_samples else None,
            "clock_moves": sum(m.counts.clock_moves for m in honest),
            "catch_ups": sum(m.counts.catch_ups for m in honest),
            "unmatched_share": sum(m.counts.unmatched for m in honest) / rounds if rounds else 0.0,
            "found_partner_median_s": statistics.median(found) if found else None,
            "found_partner_p90_s": found[int(0.9 * (len(found) - 1))] if found else None,
            "joiners": len(joiners),
            "joiners_blended": sum(j is not None for j in joiners),
            "joiner_first_blend_median_s": statistics.median([j for j in joiners if j is not None])
            if any(j is not None for j in joiners)
            else None,
            "discovery_bytes_per_member_s": sum(m.counts.discovery_bytes for m in honest) / len(honest) / window,
            "level_median": statistics.median(levels) if levels else None,
            "estimate_median": statistics.median(estimates) if estimates else None,
            "view_median": statistics.median(len(m.view) for m in staying) if staying else None,
            "late_groups": _groups([m.peer_id for m in staying], self.late_pairs),
            "simulation_cpu_s": cpu_seconds,
        }


def run(settings: ProtocolSettings) -> dict[str, Any]:
    return Swarm(settings).run()


def _groups(members: list[str], pairs: list[tuple[str, str]]) -> list[int]:
    """The sizes of the groups ``members`` fall into when each of ``pairs`` joins its two, largest first: one group
    is a swarm that mixes as one; two or more trained as separate swarms."""
    return [len(group) for group in connected_groups(members, pairs)]


def run_protocol_bench(
    member_counts: list[int],
    hostile_shares: list[float],
    pairings: list[str],
    partners: list[str],
    settings: ProtocolSettings,
    out: Path | None,
) -> int:
    """One run per pairing, partner rule, hostile share and size (each a swarm of its own, the same seed), printed
    as it ends."""
    for option, values, allowed in (("--pairing", pairings, PAIRINGS), ("--partners", partners, tuple(STANDINGS))):
        unknown = [v for v in values if v not in allowed]
        if unknown:
            print(f"noloco-node bench protocol: {option} {','.join(unknown)}: not one of {', '.join(allowed)}")
            return 2
    print(
        f"noloco-node bench protocol: {settings.seconds:.0f} s emulated, outer steps of "
        f"{settings.phase_seconds:.0f} s, hostile hosts of {settings.keys_per_hostile} keys, churn "
        f"{settings.churn_per_hour:.0%}/h, {settings.straggler_share:.0%} stragglers x {settings.straggler_slowdown}, "
        f"seed {settings.seed}",
        flush=True,
    )
    series: dict[tuple[str, float], list[dict[str, Any]]] = {}
    for pairing in pairings:
        for rule in partners:
            for share in hostile_shares:
                for members in member_counts:
                    run_settings = replace(settings, members=members, hostile_share=share, pairing=pairing)
                    result = run(replace(run_settings, partners=rule))
                    series.setdefault((f"{pairing}, {rule}", share), []).append(result)
                    print(_line(result), flush=True)
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        document = {"settings": asdict(settings), "results": [r for rs in series.values() for r in rs]}
        (out / "protocol.json").write_text(json.dumps(document, indent=2))
        _plot(series, out / "protocol.png")
        print(f"wrote {out / 'protocol.json'} and {out / 'protocol.png'}")
    return 0


def _line(r: dict[str, Any]) -> str:
    found = r["found_partner_median_s"]
    return (
        f"{r['pairing']:>7}, {r['partners']:>11}: {r['members']:>6} members (+{r['hostile_keys']} hostile keys "
        f"on {r['hostile_hosts']} hosts): blends "
        f"{r['blend_rate']:.1%} of {r['rounds']} outer steps (target >= 95%; members under 90%: "
        f"{r['members_below_90_percent']}; met nobody {r['unmatched_share']:.1%}), hostile keys' share of blends "
        f"{r['hostile_share_of_blends']:.1%} "
        f"(last third {r['hostile_share_of_late_blends']:.1%}; hosts {r['hostile_host_share']:.1%}; a hostile group "
        f"blended with at most {r['most_blends_of_a_hostile_group_at_one_step']} honest members at one outer step; "
        f"honest members looking at a moment {_mean_text(r['honest_looking_mean'])}), partner found "
        f"after {found if found is None else round(found, 2)} s "
        f"median, discovery {r['discovery_bytes_per_member_s'] / 1000:.1f} KB/s per member, level "
        f"{r['level_median']}, estimate {r['estimate_median'] and round(r['estimate_median'])}, "
        f"view {r['view_median']}, {_groups_text(r['late_groups'])}, "
        f"{r['left_and_joined']} left and joined ({r['joiners_blended']} of "
        f"{r['joiners']} joiners blended), clock moves {r['clock_moves']}, catch-ups {r['catch_ups']}, "
        f"{r['simulation_cpu_s']:.0f} s CPU"
    )


def _mean_text(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def _groups_text(sizes: list[int]) -> str:
    """The late blends' groups: "one group" when the swarm mixes as one."""
    if len(sizes) <= 1:
        return "late blends join the swarm as one group"
    lone = sum(size == 1 for size in sizes)
    return f"late blends split it into {len(sizes)} groups (largest {sizes[0]}, {lone} members with no late blend)"


def _plot(series: dict[tuple[str, float], list[dict[str, Any]]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    for (pairing, share), results in series.items():
        sizes = [r["members"] for r in results]
        label = f"{pairing}, {share:.0%} hostile hosts"
        axes[0].plot(sizes, [100 * r["blend_rate"] for r in results], "o-", label=f"blends per outer step, {label}")
        if share > 0:
            axes[0].plot(
                sizes,
                [100 * r["hostile_share_of_late_blends"] for r in results],
                "s--",
                label=f"{pairing}, hostile share (last third)",
            )
        axes[1].plot(sizes, [r["discovery_bytes_per_member_s"] / 1000 for r in results], "o-", label=label)
        found = [math.nan if r["found_partner_median_s"] is None else r["found_partner_median_s"] for r in results]
        axes[2].plot(sizes, found, "o-", label=f"median, {label}")  # 0.0 s (found at the step) is a point too
    axes[0].axhline(95, color="grey", linestyle=":", label="95% target")
    axes[0].axhline(10, color="red", linestyle=":", label="10%: the hostile share of hosts")
    axes[0].set_ylabel("% of honest members' outer steps")
    axes[1].set_ylabel("discovery KB/s per member")
    axes[2].set_ylabel("seconds to a partner")
    for axis in axes:
        axis.set_xscale("log")
        axis.set_xlabel("honest members")
        axis.set_ylim(bottom=0)
        axis.legend(fontsize=7)
    fig.suptitle("bench protocol: the node's discovery, standing and pairing in emulated time", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
