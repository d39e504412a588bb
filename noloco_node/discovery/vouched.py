"""Records vouched for by a peer's own answer while the DHT does not list it (node/report.py's watch of peers).

After a partition heals, the DHT takes 10-20 s to list the far side again: each side's records expired from the
other's view during the split, and lookups skip DHT peers that failed. The peers themselves answer at once. A node
that has standing with such a peer (the caller decides; strangers never) lists it from its own answer, its Info,
until the DHT lists it again or ``record_ttl`` seconds pass without another answer.
"""

from __future__ import annotations

from typing import Generic, Protocol, TypeVar

from hivemind.utils.timed_storage import get_dht_time

MAX_VOUCHED = 64  # a bounded table: the oldest vouches go first


class _Record(Protocol):
    @property
    def peer_id(self) -> str: ...

    @property
    def updated(self) -> float: ...


Record = TypeVar("Record", bound=_Record)


class VouchedRecords(Generic[Record]):
    """The table of vouched records (of discovery/dht.py's PeerRecord: typed by what it reads of them)."""

    def __init__(self, record_ttl: float) -> None:
        self.record_ttl = record_ttl
        self._records: dict[str, Record] = {}  # peer id -> its record as its last answer renewed it

    def vouch(self, record: Record) -> None:
        """List ``record`` for ``record_ttl`` seconds from its ``updated`` time, while the DHT does not."""
        self._records[record.peer_id] = record
        if len(self._records) > MAX_VOUCHED:
            oldest = min(self._records.values(), key=lambda r: r.updated)
            del self._records[oldest.peer_id]

    def holds(self, peer_id: str) -> bool:
        """Whether ``peer_id`` is listed by its vouch alone (the DHT did not list it at the last lookup)."""
        return peer_id in self._records

    def merged(self, records: list[Record]) -> list[Record]:
        """The DHT's records, and the vouched ones it does not list and that have not expired (a record the DHT
        lists wins, and ends the vouch)."""
        if not self._records:
            return records
        listed = {r.peer_id for r in records}
        now = get_dht_time()
        for peer_id in [p for p, r in self._records.items() if p in listed or now - r.updated > self.record_ttl]:
            del self._records[peer_id]
        return [*records, *self._records.values()]
