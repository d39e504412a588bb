"""A node's view of the swarm: the records of the buckets it has read, each bucket's read replacing what the view
held of that bucket (discovery/buckets.py).

At level 0 every lookup reads the one bucket, so the view is the swarm as the last lookup saw it. Higher, a lookup
reads one random bucket (and the buckets of the peers the node follows), and what it saw of other buckets stays
until the DHT would have let it expire: the view is a sample that renews itself, bounded in size (past
MAX_LIVE_PEERS records, the node's preferred peers first and a random sample of the rest: kept_records).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

from hivemind.utils.timed_storage import get_dht_time

from noloco_node.discovery.buckets import Bucket


class _Record(Protocol):
    @property
    def peer_id(self) -> str: ...


Record = TypeVar("Record", bound=_Record)

MAX_LIVE_PEERS = 1024  # records a node considers at once: a flood of fake ones cannot grow its tables


def kept_records(records: list[Record], preferred: Callable[[str], bool], limit: int = MAX_LIVE_PEERS) -> list[Record]:
    """At most ``limit`` of ``records``: the ``preferred`` peers' first, then a random sample of the rest. Records
    cost nothing to publish, so which are kept must not be their writers' choice: readers once kept the newest by the
    date each writer gave, and a flood dated in the future pushed out every honest record."""
    if len(records) <= limit:
        return records
    first = [r for r in records if preferred(r.peer_id)]
    others = [r for r in records if not preferred(r.peer_id)]
    random.shuffle(others)
    return (first + others)[:limit]


@dataclass
class _Entry(Generic[Record]):
    record: Record
    expires: float  # DHT time the DHT drops it unless its owner refreshes it
    read: Bucket  # the read that put it in view


class RecordView(Generic[Record]):
    """The records in view, at most ``limit`` (the ``preferred`` peers first, then a sample: kept_records)."""

    def __init__(
        self,
        preferred: Callable[[str], bool],
        limit: int = MAX_LIVE_PEERS,
        clock: Callable[[], float] = get_dht_time,
    ) -> None:
        self._preferred = preferred
        self._limit = limit
        self._clock = clock
        self._entries: dict[str, _Entry[Record]] = {}
        # The peers each read put in view: a read replaces what overlapping reads left, found without a pass over
        # every record in view (a node at a high level holds hundreds, and reads once a second).
        self._by_read: dict[Bucket, set[str]] = {}

    def replace(self, bucket: Bucket, found: Sequence[tuple[Record, float]]) -> None:
        """``bucket`` was read: it holds ``found`` (record, expiration) and nothing else of the view's."""
        for read in [r for r in self._by_read if r.overlaps(bucket)]:
            for peer_id in [p for p in self._by_read[read] if bucket.holds(p)]:
                self._drop(peer_id)
        for record, expires in found:
            self._drop(record.peer_id)
            self._entries[record.peer_id] = _Entry(record, expires, bucket)
            self._by_read.setdefault(bucket, set()).add(record.peer_id)
        if len(self._entries) > self._limit:
            kept = {
                r.peer_id
                for r in kept_records([e.record for e in self._entries.values()], self._preferred, self._limit)
            }
            for peer_id in [p for p in self._entries if p not in kept]:
                self._drop(peer_id)

    def records(self) -> list[Record]:
        """The records in view that the DHT still holds."""
        now = self._clock()
        for peer_id in [p for p, e in self._entries.items() if e.expires < now]:
            self._drop(peer_id)
        return [e.record for e in self._entries.values()]

    def _drop(self, peer_id: str) -> None:
        entry = self._entries.pop(peer_id, None)
        if entry is not None:
            held = self._by_read[entry.read]
            held.discard(peer_id)
            if not held:
                del self._by_read[entry.read]

    def __len__(self) -> int:
        return len(self._entries)
