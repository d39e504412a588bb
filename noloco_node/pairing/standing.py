"""Whom a node pairs with in an open swarm: standing earned by a track record, and a bounded share for strangers.

A peer id costs nothing (a fresh RSA key), so a node that calls never-paired ids first, or takes whichever caller
completes first, can have every round taken by one stranger minting keys and echoing the node's own weights back
(which passes every payload check by construction). Partner choice therefore rests on two things ids cannot buy:

- **Standing.** A peer whose record this node has seen in the DHT for at least ``standing_seconds`` is a *partner*:
  partners are mixed at random among themselves, as the algorithm needs (least recently paired first, one network
  group at a time: noloco_node/addresses.py; those that have answered before the others), and their calls in are
  served. A group's blends, calling or called, are held to its *fair share*: one blend in G outer steps (G: the
  partners' groups whose records this node read in the last SHARE_MEMORY_SECONDS and that it has heard from: answered
  a call, called, or was named as a partner by established peers of two groups), at most ``SHARE_LEAD`` blends ahead
  of it and banking nothing while it is away, so that many keys of one group calling first every step take no more
  than the share of one group, and a group whose share is spent is not called. Only groups that answered count in G:
  records cost nothing, and a thousand records of keys that never answer would make every honest group's share a
  thousandth. A partner this node has also blended with (a payload that passed every check) is *established*: only an
  established peer's word counts (the swarm's front and clock, below; the full blend weight). The line is drawn at
  the record's age, not at a first blend: in a new swarm the groups that blended first were the ones whose records
  always said ready, and once established they were called first and always answered (``bench protocol``, 100 members
  with 10% always-ready hosts: those hosts took 80% of the honest blends when a partner had to be established, 24%
  when a partner is known by its record's age; docs/benchmarks.md).
- **A bounded share for strangers.** Every other id is a stranger. Strangers are called, and their calls served,
  only with a *stranger turn* (or on an introducer's share, below): a token bucket that earns ``stranger_share`` of
  a turn per outer step (its phase starts at random, so that nodes started together do not open the same steps) and
  holds at most one. A turn is for one network group, drawn at random at each outer step among the groups of the
  strangers whose records are in view within reach; the first session of a stranger of that group this node serves,
  or the first call to one that is not answered busy, spends it (``spend_stranger_turn``). Whatever the number of
  keys and addresses, strangers take at most that share of a node's rounds, a thousand keys on one address, or on
  one /24, weigh as one, and whoever calls in first does not decide who gets the turn (a fresh key calling in at
  every phase took every turn, and an honest newcomer none); a key whose record this node has not seen gets none.
  The turn waits for a stranger instead of lapsing with its step, and a call answered busy does not spend it: two
  honest newcomers, each a stranger to the other, meet at the first chance, where they once met only when both
  nodes' turns coincided. A node none of whose partners is live (a new swarm, a joiner, a partition) admits
  strangers at every step: it has no one better to pair with. One whose partners are live but out of reach
  (it fell behind, or they did) does not: it catches up with them (node/outer_step.py downloads a state after a few
  solo steps), and keeping it behind buys an attacker no more than the stranger share.
- **Introductions.** A node's record names the established peers of its latest blends (``recent_partners``). A
  stranger that an established peer names there has earned standing with a peer this node trusts, and rides on its
  introducer's share: it is called and served like a partner, without a stranger turn, and its blends count
  against the introducer's network group (its fair share is the group and all it names together), until it is
  a partner here (a bounded table remembers the introductions: the introducer's
  record moves on to its next partners long before the stranger earns standing). Two honest members that are
  strangers to each other (a joiner and a member that restarted, say) but have standing with the same peer then
  pair as soon as that peer names them, where they once waited until both held a stranger turn (10% of steps
  each). A peer with standing can name any key, and so give its share to whom it likes: the keys it names take
  what it could take itself, never more.
- **A bounded weight for strangers.** Once a node has established peers, a partner without standing counts as
  ``STRANGER_WEIGHT`` of a replica in its blend: a stranger's blend moves it a third of the way to the stranger's
  weights, not half (an honest newcomer mixes in a little more slowly; it joined from a peer's state anyway).

What K keys on M addresses can take is in docs/threat-model.md. Standing is remembered after a peer leaves the DHT
(a partition, a restart), in a bounded table that evicts strangers first and then the longest-gone: an eviction
only ever takes standing away, so the table cannot be flooded into granting it. Standing is per node and is the
node's own history: the checkpoint keeps its earned part (``checkpoint_state``), so a restarted member believes
and prefers the peers it had standing with, not whoever's records it sees first (node/catch_up.py).
"""

from __future__ import annotations

import math
import random
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from noloco_node.discovery.dht import PeerRecord

# A peer's first sighting when this node has blended with it but never seen its record: standing needs the record
# seen for --standing-seconds, so a key that only ever calls in (no record at all) stays a stranger however long it
# blends (counted from its first blend, such a key would earn full weight and every turn).
NEVER_SEEN = math.inf
MAX_REMEMBERED = 4096  # peers remembered; past this strangers are forgotten first, then the longest-gone
# How far ahead of its fair share a network group's blends with this node may be, in blends. The node's share clock
# moves 1/G at each of its outer steps, a group's one blend at each of the group's blends (from the node's clock, if
# the group's is behind it: a group away for a while banks nothing), so an always-ready group takes one blend in G
# outer steps, its share of the groups, and an honest group, which meets only when both members are free and due
# together, may take two at once when they are. With one (a blend at most once in G outer steps) 100 honest members
# blended at 87% of their outer steps; a window of 0.6 G outer steps gave an always-ready group 1/0.6 of its share
# (bench protocol, docs/benchmarks.md).
SHARE_LEAD = 2
# G counts the partner groups heard from whose records this node read within this long: a view is a sample of the
# swarm's buckets (discovery/view.py), and G counted over the view alone shrank with the buckets, each group's share
# of blends growing with it.
SHARE_MEMORY_SECONDS = 300.0
# Established peers' groups whose records must name a peer before it counts as heard from without a call of its own.
NAMED_BY_GROUPS = 2
# How many replicas a partner without standing counts as in this node's blend (algorithm.noloco_pair_step), once the
# node has established peers (``believable``): its pull on this node's weights is a third of the gap instead of a
# half, so that what a stranger's step can move is bounded by the weight as well as by the stranger share.
STRANGER_WEIGHT = 0.5
# The partners a record names (its latest blends with established peers): enough to introduce the peers a node
# alternates between.
INTRODUCED_PARTNERS = 2
# Introductions a node remembers: a bounded table, the oldest forgotten first (a peer with standing can name any key).
MAX_INTRODUCED = 64


@dataclass
class _Track:
    first_seen: float  # monotonic time this node first saw the peer's record (NEVER_SEEN: blended, never listed)
    last_seen: float
    group: str = ""  # the network group of the address its record gave, last seen (addresses.py)
    blends: int = 0  # blends with this node whose payload passed every check
    last_blend_step: int | None = None  # this node's outer step at the last of them
    last_blend_time: float | None = None  # monotonic
    # It answered a call of this node's, called it (heard_from), or the records of established peers of
    # NAMED_BY_GROUPS groups name it as a partner: it counts in G, and is called before the partners never heard of.
    heard: bool = False
    named_by: set[str] = field(default_factory=set)  # groups of the established peers naming it, until heard


@dataclass(frozen=True)
class SwarmStep:
    """Where the swarm's clock is, seen from a node that most of it is ahead of (Standing.swarm_step)."""

    outer_step: int
    # This node's outer steps since it last blended with the furthest apart of those peers with standing: one of
    # them may have just come over (a download) while the rest drifted.
    steps_apart: int


class Standing:
    """Thread-safe: read by gRPC threads (incoming sessions) and the event loop (calls), written by both."""

    def __init__(
        self,
        *,
        standing_seconds: float,
        stranger_share: float,
        clock: Callable[[], float] = time.monotonic,
        rng: random.Random | None = None,
    ) -> None:
        self.standing_seconds = standing_seconds
        self.stranger_share = stranger_share
        self._clock = clock
        self._rng = rng or random.Random()
        self._lock = threading.Lock()
        self._tracks: dict[str, _Track] = {}
        self._step: int | None = None
        # The stranger share's bucket: a turn for a stranger once it holds a whole token, spent by the first
        # stranger this node serves or calls (spend_stranger_turn). Kept until used, so that two honest newcomers
        # (each a stranger to the other) meet at the first chance, not only when their random steps coincide.
        self._tokens = self._rng.random()  # a random phase: nodes started together open different steps
        # Strangers are let in at every step only while no peer with standing is live at all (a new swarm, a joiner,
        # a partition): one whose partners are live but out of reach catches up with them instead
        # (node/outer_step.py), and an attacker that keeps it behind gains no more than the stranger share.
        self._partners_live = False
        self._groups_within_reach = 0  # network groups of the partners within reach
        self._share_groups = 0  # G: the partners' groups seen lately that this node has heard from (heard_from)
        # The network group the stranger turn is for: drawn at each outer step among the groups of the strangers
        # in view (within reach), so that whoever calls in first does not decide who gets it (a key per phase
        # calling in first would take every turn). None: no turn held, or no stranger in view.
        self._turn_group: str | None = None
        # Strangers established peers named, oldest first: each with its introducer's network group, whose share
        # its blends count against.
        self._introduced: dict[str, str] = {}
        self._had_established = False
        # Fair shares (SHARE_LEAD): the node's share clock moves 1/G at each of its outer steps; a group's moves to
        # max(its own, the node's) + 1 at each of its blends, the strangers it introduced counted with it. A group
        # a blend would put more than SHARE_LEAD ahead of the node's clock has taken its share. A clock behind the
        # node's is the same as none, so those are the ones forgotten.
        self._share_clock = 0.0
        self._group_clocks: dict[str, float] = {}
        self.stranger_steps = 0  # outer steps that admitted strangers while established peers were live

    # ------------------------------------------------------------------------------------------- what is known

    def observe(self, peers: Sequence[PeerRecord], own_step: int, max_staleness: int) -> None:
        """The live view of the swarm at this node's outer step ``own_step``."""
        now = self._clock()
        with self._lock:
            for peer in peers:
                track = self._tracks.get(peer.peer_id)
                if track is None:
                    self._tracks[peer.peer_id] = _Track(first_seen=now, last_seen=now, group=peer.network_group)
                else:
                    track.last_seen, track.group = now, peer.network_group
                    if track.first_seen == NEVER_SEEN:
                        track.first_seen = now
            self._forget_beyond_limit()
            within_reach = [p for p in peers if abs(p.outer_step - own_step) <= max_staleness]
            established = {p.peer_id for p in peers if self._established(p.peer_id, now)}
            partners = {p.peer_id for p in peers if self._partner(p.peer_id, now)}
            self._partners_live = bool(partners)
            self._groups_within_reach = len({p.network_group for p in within_reach if p.peer_id in partners})
            strangers = [p for p in within_reach if p.peer_id not in partners]
            self._remember_introductions(peers, established, now)
            if self._step is None or own_step > self._step:  # G is read as the share clock moves on a step
                recent = now - SHARE_MEMORY_SECONDS
                self._share_groups = len(
                    {
                        track.group
                        for peer_id, track in self._tracks.items()
                        if track.heard and track.last_seen >= recent and self._partner(peer_id, now)
                    }
                )
            stranger_groups = sorted({p.network_group for p in strangers})
            if self._enter_step(own_step) or self._turn_group not in stranger_groups:
                self._turn_group = self._rng.choice(stranger_groups) if stranger_groups else None

    def _remember_introductions(self, peers: Sequence[PeerRecord], established: set[str], now: float) -> None:
        """The strangers the established peers' records name, kept until they are partners here or newer ones push
        them out: an introducer's record moves on to its next partners long before the stranger earns standing. A
        partner, its record in view or not, is charged to its own group: charged to its introducer's, a partner
        named while out of view left its own group's share unspent, and its group blended again before its share
        allowed."""
        for peer in peers:
            if peer.peer_id in established:
                for named in peer.partners:
                    self._introduced.pop(named, None)
                    self._introduced[named] = peer.network_group  # the latest last
                    if (track := self._tracks.get(named)) is not None and not track.heard:
                        # It blended with peers this node trusts: it answers. Two groups must say so: one
                        # established peer could otherwise name free keys by the hundred into G and the order's front.
                        track.named_by.add(peer.network_group)
                        track.heard = len(track.named_by) >= NAMED_BY_GROUPS
                        if track.heard:
                            track.named_by.clear()
        for known in [named for named in self._introduced if self._partner(named, now)]:
            del self._introduced[known]
        while len(self._introduced) > MAX_INTRODUCED:
            del self._introduced[next(iter(self._introduced))]

    def blended(self, peer_id: str, own_step: int) -> None:
        """A blend with ``peer_id`` at this node's outer step ``own_step`` (its payload passed every check)."""
        now = self._clock()
        with self._lock:
            track = self._tracks.setdefault(peer_id, _Track(first_seen=NEVER_SEEN, last_seen=now))
            track.blends += 1
            track.last_blend_step, track.last_blend_time, track.heard = own_step, now, True
            group = self._share_group(peer_id)
            self._group_clocks[group] = self._group_clock(group) + 1.0
            self._forget_spent_clocks()

    def heard_from(self, peer_id: str) -> None:
        """``peer_id`` answered a call of this node's (busy, refused or exchanged: a gRPC answer, not a silence), or
        called it with its id proven: its group counts in G from its record's next reading (as does a peer the
        records of established peers of two groups name). Records alone cost nothing to publish: a thousand records
        of keys that never answer must not make every group's share a thousandth."""
        with self._lock:
            track = self._tracks.get(peer_id)
            if track is not None:
                track.heard = True

    def established(self, peer_id: str) -> bool:
        with self._lock:
            return self._established(peer_id, self._clock())

    def recent_partners(self) -> tuple[str, ...]:
        """The established peers of this node's latest blends, latest first (``INTRODUCED_PARTNERS`` of them), for
        its record: the introductions its established peers read. Established ones only: an echoing free key that
        won one stranger turn here would otherwise be introduced to every node that trusts this one."""
        now = self._clock()
        with self._lock:
            blended = [
                (t.last_blend_time, peer)
                for peer, t in self._tracks.items()
                if t.last_blend_time is not None and self._established(peer, now)
            ]
        return tuple(peer for _, peer in sorted(blended, reverse=True)[:INTRODUCED_PARTNERS])

    def believable(self, peer_id: str) -> bool:
        """Whether what ``peer_id`` says of itself (its outer step: the swarm's front) counts: once this node has
        any peer with standing, only those peers' claims do."""
        with self._lock:
            now = self._clock()
            if not self._had_established:  # once true it stays true: a node that had standing peers keeps its bar
                self._had_established = any(self._established(known, now) for known in self._tracks)
            return not self._had_established or self._established(peer_id, now)

    def steps_apart(self, peer_id: str) -> int | None:
        """Outer steps from this node's last blend with ``peer_id`` to its current step; None if it never blended
        with it or has no standing with it (a key that won one stranger turn must not buy a looser norm bound by
        staying away). Counted on this node's own steps: nothing the peer says moves it."""
        with self._lock:
            track = self._tracks.get(peer_id)
            if track is None or track.last_blend_step is None or self._step is None:
                return None
            if not self._established(peer_id, self._clock()):
                return None
            return max(0, self._step - track.last_blend_step)

    def swarm_step(
        self, own_step: int, peer_steps: Mapping[str, int], max_staleness: int, seconds_per_step: float
    ) -> SwarmStep | None:
        """The outer step to move this node's clock to (and how far apart it is from those peers), or None (used
        by node/outer_step.py): when groups beyond ``max_staleness`` ahead make up at least half of the groups this
        node knows, itself counted, and at least one of them has standing with it. A group is *known* once it has
        standing, or its record has been seen for ``standing_seconds``; it counts once, at the lower median of its
        keys' steps. The step is the lower median of the groups ahead, and no further than a peer with standing
        could plausibly have gone since this node last blended with it: twice this node's own pace
        (``seconds_per_step``) for the time since, plus ``max_staleness``.

        So one peer that runs ahead (or says so) moves nobody; strangers alone move nobody, and a peer with
        standing at most doubles this node's clock rate. A node knows only the peers it blended with: before a
        split it may have blended with only some of the far half, so known groups count, not only established
        ones."""
        now = self._clock()
        by_group: dict[str, list[int]] = {}
        reach: list[float] = []  # for each established peer ahead: the furthest step it can plausibly be at
        apart: list[int] = []  # for each established peer ahead: this node's outer steps since it blended with it
        with self._lock:
            for peer_id, step in peer_steps.items():
                track = self._tracks.get(peer_id)
                if track is None or now - track.first_seen < self.standing_seconds:
                    continue
                by_group.setdefault(track.group, []).append(step)
                if step > own_step + max_staleness and self._established(peer_id, now):
                    assert track.last_blend_step is not None and track.last_blend_time is not None
                    pace = 2 * (now - track.last_blend_time) / max(seconds_per_step, 1e-3)
                    reach.append(track.last_blend_step + max_staleness + pace)
                    apart.append(max(0, own_step - track.last_blend_step))
        group_steps = [_lower_median(steps) for steps in by_group.values()]
        ahead = [step for step in group_steps if step > own_step + max_staleness]
        if not reach or 2 * len(ahead) < len(group_steps) + 1:
            return None
        target = min(_lower_median(ahead), int(max(reach)))
        return SwarmStep(target, max(apart)) if target > own_step + max_staleness else None

    def checkpoint_state(self) -> list[dict[str, Any]]:
        """The peers this node has blended with, for its checkpoint: how long each has been known and its blends.
        Strangers never blended with, or never seen in the DHT, are left out: they have earned nothing to keep."""
        now = self._clock()
        with self._lock:
            return [
                {
                    "peer_id": peer_id,
                    "group": track.group,
                    "known_seconds": now - track.first_seen,
                    "blends": track.blends,
                    "last_blend_step": track.last_blend_step,
                }
                for peer_id, track in self._tracks.items()
                if track.blends > 0 and track.last_blend_step is not None and track.first_seen != NEVER_SEEN
            ]

    def restore(self, saved: Sequence[dict[str, Any]]) -> None:
        """The standing a checkpoint kept (``checkpoint_state``); entries that do not read as one are skipped (a
        checkpoint of an older version has none)."""
        now = self._clock()
        with self._lock:
            for entry in saved:
                try:
                    track = _Track(
                        first_seen=now - max(0.0, float(entry["known_seconds"])),
                        last_seen=now,
                        group=str(entry["group"]),
                        blends=int(entry["blends"]),
                        last_blend_step=int(entry["last_blend_step"]),
                        last_blend_time=now,
                        heard=True,
                    )
                except (KeyError, TypeError, ValueError):
                    continue
                self._tracks[str(entry["peer_id"])] = track
            self._forget_beyond_limit()

    # ------------------------------------------------------------------------------------------- decisions

    def may_serve(self, peer_id: str) -> bool:
        """Whether an incoming pairing call from ``peer_id`` may be taken now; a refusal says nothing of the peer.

        A stranger: with a stranger turn for its record's network group only (the session spends it:
        :meth:`spend_stranger_turn`), while partners are live; any stranger without them. A partner: unless its
        network group has taken its share of this node's blends (``_share_left``), so that calling in first, every
        step, from many keys of one group earns that group no more than its share."""
        with self._lock:
            now = self._clock()
            if not self._partner(peer_id, now):
                return not self._partners_live or self._on_introducers_share(peer_id) or self._holds_turn_for(peer_id)
            return self._share_left(self._tracks[peer_id].group)

    def spend_stranger_turn(self, peer_id: str) -> None:
        """A session of a partner-choosing kind opened with ``peer_id`` (served, or called): a stranger's takes the
        stranger share's turn, while peers with standing are live (without them strangers pair freely)."""
        with self._lock:
            if self._partner(peer_id, self._clock()) or not self._partners_live or self._tokens < 1.0:
                return
            if self._on_introducers_share(peer_id):
                return
            self._tokens -= 1.0
            self._turn_group = None
            self.stranger_steps += 1

    def order(self, candidates: Sequence[PeerRecord], last_paired: dict[str, int]) -> list[PeerRecord]:
        """Whom to call, in order: the partners and the strangers on an introducer's share (each counted
        in its introducer's group), those this node has heard from first (``heard_from``), least recently paired
        group first, not the groups whose share is spent (their calls in ``may_serve`` would refuse), and with a
        stranger turn one other stranger
        before them (a random key of the turn's group; the call spends the turn); with no partner live,
        every candidate alike, one group at a time.

        Least recently paired first: nodes of equal speed reach their outer steps in lockstep and would otherwise
        keep finding their last partner ready first, splitting the swarm into fixed pairs that never mix. One
        stranger only, before the peers that answered before: a record costs nothing to publish."""
        now = self._clock()
        with self._lock:
            if not self._partners_live:
                return _by_group(candidates, last_paired, self._rng, lambda p: p.network_group)
            trusted = [p for p in candidates if self._partner(p.peer_id, now) or self._on_introducers_share(p.peer_id)]
            trusted_ids = {p.peer_id for p in trusted}  # a set: candidates number in the hundreds at a high level
            turn = [
                p
                for p in candidates
                if p.peer_id not in trusted_ids and self._tokens >= 1.0 and p.network_group == self._turn_group
            ]
            share_group = {p.peer_id: self._introduced.get(p.peer_id, p.network_group) for p in trusted}
            # Groups whose share is spent are not called: their calls in would be refused (may_serve), and a group
            # that is always ready must not take by being called what it cannot take by calling in (called last,
            # they took twice their share: bench protocol, docs/benchmarks.md).
            spent = {group for group in set(share_group.values()) if not self._share_left(group)}
            choosable = [p for p in trusted if share_group[p.peer_id] not in spent]
            heard = [p for p in choosable if self._tracks[p.peer_id].heard]
        # Peers heard from first: a record costs nothing, and a thousand records of keys that never answer, called
        # first as partners never paired, each took a call's time from the phase.
        heard_ids = {p.peer_id for p in heard}
        ordered = [
            *_by_group(heard, last_paired, self._rng, lambda p: share_group[p.peer_id]),
            *_by_group(
                [p for p in choosable if p.peer_id not in heard_ids],
                last_paired,
                self._rng,
                lambda p: share_group[p.peer_id],
            ),
        ]
        if turn:
            ordered.insert(0, self._rng.choice(turn))
        return ordered

    # ------------------------------------------------------------------------------------------- internals

    def group_of(self, peer_id: str) -> str | None:
        """The network group of the address ``peer_id``'s record gave, or None if this node never saw its record."""
        with self._lock:
            track = self._tracks.get(peer_id)
            return track.group if track is not None and track.first_seen != NEVER_SEEN else None

    def _partner(self, peer_id: str, now: float) -> bool:
        """Whether ``peer_id`` is called and served on its group's share (and counts in G): a peer whose record this
        node has seen for --standing-seconds, blended with or not."""
        track = self._tracks.get(peer_id)
        return track is not None and track.first_seen != NEVER_SEEN and now - track.first_seen >= self.standing_seconds

    def _established(self, peer_id: str, now: float) -> bool:
        track = self._tracks.get(peer_id)
        return track is not None and track.blends > 0 and now - track.first_seen >= self.standing_seconds

    def _holds_turn_for(self, peer_id: str) -> bool:
        """Whether this node holds a stranger turn for the network group of ``peer_id``'s record; a key whose record
        this node has never seen belongs to no group and never takes a turn."""
        track = self._tracks.get(peer_id)
        return (
            self._tokens >= 1.0
            and track is not None
            and track.first_seen != NEVER_SEEN
            and track.group == self._turn_group
        )

    def _on_introducers_share(self, peer_id: str) -> bool:
        """Whether ``peer_id`` is a stranger an established peer named (and whose record this node has seen) and its
        introducer's group has share left: it is then called and served like a partner."""
        track = self._tracks.get(peer_id)
        introducer_group = self._introduced.get(peer_id)
        return (
            introducer_group is not None
            and self._groups_within_reach > 0  # out of reach of its peers, a node catches up: strangers wait
            and track is not None
            and track.first_seen != NEVER_SEEN
            and self._share_left(introducer_group)
        )

    def _share_group(self, peer_id: str) -> str:
        """The network group a blend with ``peer_id`` is charged to: its introducer's while it is a stranger
        introduced here, else its own (a partner named while its record was out of view is its own group's)."""
        track = self._tracks[peer_id]
        if self._partner(peer_id, self._clock()):
            return track.group
        return self._introduced.get(peer_id, track.group)

    def _share_left(self, group: str) -> bool:
        """Whether a blend with ``group`` (the strangers it introduced counted with it) would leave it at most
        SHARE_LEAD blends ahead of its fair share."""
        ahead = self._group_clock(group) + 1.0 - self._share_clock
        return ahead <= SHARE_LEAD + 1e-9  # 1e-9: G steps of 1/G add up to a hair under one

    def _group_clock(self, group: str) -> float:
        """``group``'s share clock, never behind the node's (a group new to this node's books is at the node's: its
        first blends come at once; started one blend ahead, 100 members blended at 94% of their steps, against 98%)."""
        return max(self._group_clocks.get(group, self._share_clock), self._share_clock)

    def _forget_spent_clocks(self) -> None:
        """Group clocks at or behind the node's say nothing a missing one does not: dropped once they outnumber the
        peers remembered."""
        if len(self._group_clocks) > MAX_REMEMBERED:
            self._group_clocks = {g: c for g, c in self._group_clocks.items() if c > self._share_clock}

    def _enter_step(self, own_step: int) -> bool:
        """Moves the stranger share's bucket on to ``own_step``; whether that is a new step."""
        if self._step is not None and own_step <= self._step:
            return False
        steps = 1 if self._step is None else own_step - self._step
        self._step = own_step
        self._share_clock += steps / max(1, self._share_groups)
        # Rounded: ten tenths must make a whole turn (in floating point they make 0.9999999999999999).
        self._tokens = min(1.0, round(self._tokens + self.stranger_share * steps, 9))
        return True

    def _forget_beyond_limit(self) -> None:
        if len(self._tracks) <= MAX_REMEMBERED:
            return
        # Strangers (never blended) go first, then the longest gone: a flood of fresh keys cannot push out the
        # standing of an honest peer that is away for a while (a partition).
        by_worth = sorted(
            self._tracks, key=lambda peer_id: (self._tracks[peer_id].blends > 0, self._tracks[peer_id].last_seen)
        )
        for peer_id in by_worth[: len(self._tracks) - MAX_REMEMBERED]:
            del self._tracks[peer_id]


def _lower_median(values: Sequence[int]) -> int:
    return sorted(values)[(len(values) - 1) // 2]


def _by_group(
    peers: Sequence[PeerRecord],
    last_paired: dict[str, int],
    rng: random.Random,
    group_of: Callable[[PeerRecord], str],
) -> list[PeerRecord]:
    """Peers ordered group by group (``group_of``: a peer's network group, or its introducer's): each group's least
    recently paired key first, groups least recently paired first (random among equal groups, whatever their number
    of keys); then the groups' other keys in the same way. Many keys on one group weigh as one: a group was paired
    when any of its keys was, so a host with many keys does not come first again with a key it has not used yet."""
    shuffled = list(peers)
    rng.shuffle(shuffled)
    shuffled.sort(key=lambda p: last_paired.get(p.peer_id, -1))
    group_paired: dict[str, int] = {}
    for peer in shuffled:
        group_paired[group_of(peer)] = max(group_paired.get(group_of(peer), -1), last_paired.get(peer.peer_id, -1))
    first: dict[str, PeerRecord] = {}
    rest: list[PeerRecord] = []
    for peer in shuffled:
        if group_of(peer) in first:
            rest.append(peer)
        else:
            first[group_of(peer)] = peer
    groups = list(first.values())
    rng.shuffle(groups)
    groups.sort(key=lambda p: group_paired[group_of(p)])
    return groups + rest
