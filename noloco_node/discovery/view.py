"""A node's view of the swarm: the records of the buckets it has read, each bucket's read replacing what the view
held of that bucket (discovery/buckets.py).

At level 0 every lookup reads the one bucket, so the view is the swarm as the last lookup saw it. Higher, a lookup
reads one random bucket (and the buckets of the peers the node follows), and what it saw of other buckets stays
until the DHT would have let it expire: the view is a sample that renews itself, bounded in size.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

from hivemind.utils.timed_storage import get_dht_time

from noloco_node.discovery.buckets import Bucket


class _Record(Protocol):
    @property
    def peer_id(self) -> str: ...


Record = TypeVar("Record", bound=_Record)


@dataclass
class _Entry(Generic[Record]):
    record: Record
    expires: float  # DHT time the DHT drops it unless its owner refreshes it


class RecordView(Generic[Record]):
    """The records in view; ``keep`` bounds them (the peers with standing first, then a sample: dht.kept_records)."""

    def __init__(self, keep: Callable[[list[Record]], list[Record]]) -> None:
        self._keep = keep
        self._entries: dict[str, _Entry[Record]] = {}

    def replace(self, bucket: Bucket, found: Sequence[tuple[Record, float]]) -> None:
        """``bucket`` was read: it holds ``found`` (record, expiration) and nothing else of the view's."""
        for peer_id in [p for p in self._entries if bucket.holds(p)]:
            del self._entries[peer_id]
        for record, expires in found:
            self._entries[record.peer_id] = _Entry(record, expires)
        kept = {r.peer_id for r in self._keep([e.record for e in self._entries.values()])}
        if len(kept) < len(self._entries):
            self._entries = {p: e for p, e in self._entries.items() if p in kept}

    def records(self) -> list[Record]:
        """The records in view that the DHT still holds."""
        now = get_dht_time()
        for peer_id in [p for p, e in self._entries.items() if e.expires < now]:
            del self._entries[peer_id]
        return [e.record for e in self._entries.values()]

    def __len__(self) -> int:
        return len(self._entries)
