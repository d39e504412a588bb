"""Where a record lives in the DHT: hash buckets at a level that grows with the swarm, so that a node reads a bucket of
about ``bucket_records`` records at each lookup, whatever the swarm's size.

A peer's bucket at level L is the first L bits of sha256(its peer id), stored under the key
``noloco/<fingerprint>/peers/<L>/<bits>``; level 0 is one bucket, the whole swarm, as long as the swarm is small. A
node estimates the swarm's size from the buckets it reads (records found x 2^L) and from it the level W at which a
bucket holds about ``bucket_records`` records (:class:`SwarmSize`); it reads at W. It writes its record at W and at
the neighbouring level its estimate leans to (W+1 when log2(size / bucket_records) is above W, W-1 below): the level
moves with hysteresis, so two nodes with the same estimate may sit a level apart, on the side each leans to, and each
still finds the other. A record found at any level a writer writes estimates the size without bias (a bucket at level
L holds 1 / 2^L of the writers that write there). A node that has found nobody but itself (it just started, or the
swarm moved levels while it was away) probes levels 2, 4, 6, ... in turn, with level 0 between any two (where a small
swarm is, found at once): every writer writes an even level (two adjacent ones, or an even one alone), so a probe
finds the swarm wherever it is. A settled node also reads one bucket in ABOVE_EVERY at a level above its own (2, 4,
... levels up, in turn), where its own swarm writes nothing: records found there are a larger swarm it is not part
of, and it moves to their level. Without this, joiners that came up together probed level 0 first, found each other
there and settled as a swarm of their own, apart for good from the swarm they joined (bench protocol: 18 of 100
members, out of reach of the rest, after 3 hours of churn).

Readers keep a record only from a bucket its owner's hash belongs to, so filling one bucket at level L with
records takes about 2^L fresh keys per record, and every DHT peer of the run stores at most MAX_BUCKET_ENTRIES
entries under one key (dht.py ``bound_dictionaries``): an answer stays far below p2pd's 4 MiB message cap whatever
is written. A flood of keys raises every reader's size estimate, and so the level, where the same keys spread over
more buckets: it dilutes the honest records a reader sees in proportion to its size, and costs each lookup the same.
"""

from __future__ import annotations

import functools
import hashlib
import math
import random
from collections import deque
from dataclasses import dataclass

from noloco_node.config.node_config import DEFAULT_BUCKET_RECORDS

MAX_LEVEL = 24  # 2^24 buckets: far past any swarm; the level is clamped here
PROBE_STRIDE = 2  # every writer writes an even level (written_levels), so probes two levels apart miss no swarm
HASH_BITS = 32
MAX_BUCKET_ENTRIES = 256  # entries a DHT peer stores under one key: 256 x 4 KB stays a quarter of p2pd's cap
ESTIMATE_READS = 16  # the size estimate is the mean of the last this many reads
LEVEL_HYSTERESIS = 0.75  # the level moves when log2(size / bucket_records) is this far from it: no flapping
EMPTY_READS_BEFORE_PROBING = 8  # reads at level 0 that found nobody else before the node probes again
ABOVE_EVERY = 8  # a settled node reads one bucket in this many above its own level, at first
MAX_ABOVE_EVERY = 512  # ... and one in this many at most, after swarms found above did not hold (a lure)
# A swarm found above counts once it looks this many times larger than the node's own estimate, from at least this
# share of a bucket's records: a few stray records high up (a tombstone, a record of a level the swarm has left)
# would otherwise estimate a huge swarm.
LARGER_SWARM = 2.0
RECORDS_ABOVE = 0.25


@functools.lru_cache(maxsize=1 << 16)
def peer_hash(peer_id: str) -> int:
    """The first HASH_BITS bits of sha256(peer id): where the peer's record lives at every level. Cached: every read
    asks it of each record the view holds (view.py), and a view holds up to 1,024."""
    return int.from_bytes(hashlib.sha256(peer_id.encode()).digest()[: HASH_BITS // 8], "big")


@dataclass(frozen=True)
class Bucket:
    """One DHT key of the run's records: the peers whose hash starts with ``index``'s ``level`` bits."""

    level: int
    index: int

    @classmethod
    def of(cls, peer_id: str, level: int) -> Bucket:
        return cls(level, peer_hash(peer_id) >> (HASH_BITS - level) if level else 0)

    @classmethod
    def random(cls, level: int, rng: random.Random | None = None) -> Bucket:
        return cls(level, (rng or random).getrandbits(level) if level else 0)

    def holds(self, peer_id: str) -> bool:
        return (peer_hash(peer_id) >> (HASH_BITS - self.level) if self.level else 0) == self.index

    def overlaps(self, other: Bucket) -> bool:
        """Whether some peer's record belongs to both (the one at the lower level holds the other's peers)."""
        low, high = (self, other) if self.level <= other.level else (other, self)
        return high.index >> (high.level - low.level) == low.index

    def key(self, run_fingerprint: str) -> str:
        bits = format(self.index, f"0{self.level}b") if self.level else ""
        return f"noloco/{run_fingerprint}/peers/{self.level}/{bits}"


class SwarmSize:
    """A node's estimate of the swarm's size, and the level it reads and writes at, from the buckets it read."""

    def __init__(self, bucket_records: int = DEFAULT_BUCKET_RECORDS) -> None:
        if bucket_records < 1:
            raise ValueError("bucket_records must be at least 1")
        self.bucket_records = bucket_records
        self.level = 0
        self.probing = True  # nobody found yet: reads go to the probe levels in turn
        self._probe = 0
        self._empty_reads = 0
        self._reads = 0  # settled reads, counted for the reads above the node's level
        self._above = 0  # reads above the node's level so far: which level the next one reads
        self._above_every = ABOVE_EVERY
        self._moved_up_to: int | None = None  # the level a swarm found above took this node to, while it holds
        self._sizes: deque[float] = deque(maxlen=ESTIMATE_READS)

    @property
    def estimate(self) -> float | None:
        """Members of the swarm (this node included) as the last reads saw them; None while probing."""
        return None if self.probing or not self._sizes else sum(self._sizes) / len(self._sizes)

    def written_levels(self) -> tuple[int, ...]:
        """Where this node writes its record: its level, and the neighbouring one its estimate leans to (none
        while probing, or when it leans below level 0: a small swarm's members write one bucket). An odd level is
        never written alone, even when the estimate leans nowhere (it is a multiple of 2^L records, so it can sit
        exactly on the level): probes read even levels, and a swarm written at an odd level only would be one that
        no joiner finds."""
        size = self.estimate
        if size is None:
            return (self.level,)
        leaning = math.log2(max(size, 1.0) / self.bucket_records) - self.level
        if leaning > 0 and self.level < MAX_LEVEL:
            return (self.level, self.level + 1)
        if (leaning < 0 or self.level % 2) and self.level > 0:
            return (self.level - 1, self.level)
        return (self.level,)

    def read_level(self) -> int:
        """The level of the next random bucket read: a probe level while probing, else the node's level."""
        if self.probing:
            return 0 if self._probe % 2 == 0 else min(MAX_LEVEL, (self._probe + 1) // 2 * PROBE_STRIDE)
        return self.level

    def above_level(self) -> int | None:
        """The level of an extra read above the node's level with this lookup (one lookup in ABOVE_EVERY; 2, 4, ...
        levels up, in turn), or None. It only looks for a larger swarm: what it finds enters the node's view only if
        the node moves there (``observe`` says so)."""
        levels_above = (MAX_LEVEL - self.level) // PROBE_STRIDE
        if self.probing or not levels_above or self._reads % self._above_every != self._above_every - 1:
            return None
        return self.level + PROBE_STRIDE * (1 + self._above % levels_above)

    def observe(self, bucket: Bucket, records: int, others: int) -> bool:
        """A random bucket's read found ``records`` well-formed records of its members, ``others`` of them not this
        node's. Returns whether the node's level changed (its record then goes to its new levels at once)."""
        if self.probing:
            if others == 0:
                self._probe = (self._probe + 1) % (2 * (MAX_LEVEL // PROBE_STRIDE))
                return False
            self.probing, self._probe, self._empty_reads = False, 0, 0
            self._sizes.clear()
            changed, self.level = self.level != bucket.level, bucket.level
            self._sizes.append(records * 2.0**bucket.level)
            return self._settle() or changed
        if bucket.level >= self.level + PROBE_STRIDE:
            return self._observe_above(bucket, records, others)
        if bucket.level != self.level:
            return False  # a read begun before the level moved
        self._reads += 1
        # Above level 0 a read that finds nobody lowers the estimate, and the level follows it down one step at a
        # time; only at level 0, where every member's record would be, does finding nobody mean probing again. A
        # flood written up to some level otherwise threw a node above it back to probing again and again.
        self._empty_reads = self._empty_reads + 1 if others == 0 and self.level == 0 else 0
        if self._empty_reads >= EMPTY_READS_BEFORE_PROBING:
            self.probing, self._empty_reads = True, 0
            return False
        self._sizes.append(records * 2.0**bucket.level)
        return self._settle()

    def _observe_above(self, bucket: Bucket, records: int, others: int) -> bool:
        """A read above the node's level, where its own swarm writes nothing: others found there are a larger swarm
        when they are at least RECORDS_ABOVE of a bucket and estimate one LARGER_SWARM times the node's own, and the
        node moves to their level. Records written high up to lure nodes away (a bucket's share at every bucket of
        a level: thousands of keys) move it there, its reads find only them, and its level walks back down: each
        time that happens, reads above come half as often (down to one in MAX_ABOVE_EVERY)."""
        self._above += 1
        size = records * 2.0**bucket.level
        if others < RECORDS_ABOVE * self.bucket_records or size < LARGER_SWARM * max(self.estimate or 1.0, 1.0):
            return False
        self.level, self._above, self._moved_up_to = bucket.level, 0, bucket.level
        self._sizes.clear()
        self._sizes.append(size)
        self._settle()
        return True

    def _settle(self) -> bool:
        """Move the level one step toward log2(size / bucket_records) when it is LEVEL_HYSTERESIS away."""
        size = self.estimate
        if size is None:
            return False
        wanted = math.log2(max(size, 1.0) / self.bucket_records)
        if wanted > self.level + LEVEL_HYSTERESIS and self.level < MAX_LEVEL:
            self.level += 1
        elif wanted < self.level - LEVEL_HYSTERESIS and self.level > 0:
            self.level -= 1
            if self._moved_up_to is not None and self.level < self._moved_up_to - 1:
                # The swarm found above did not hold: below the levels it wrote at, it was a lure (or left)
                self._moved_up_to = None
                self._above_every = min(MAX_ABOVE_EVERY, 2 * self._above_every)
        else:
            return False
        return True
