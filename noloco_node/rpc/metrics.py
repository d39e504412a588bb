"""Counters of a node's exchanges: outcomes, refused payloads by reason, bytes, a duration histogram, the last ones.

Thread-safe: the gRPC server's threads, the callers' threads and the status endpoint all touch it.
"""

from __future__ import annotations

import threading
import time
from collections import Counter, deque
from typing import Any

# Upper bounds (s) of the exchange-duration histogram's buckets: loopback exchanges of small models take
# milliseconds, a 1.3B model over a 100 Mbit/s link takes minutes.
DURATION_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


class ExchangeMetrics:
    """Exchanges by outcome, refused payloads by reason, bytes, a duration histogram and the last exchanges.

    Thread-safe: the gRPC server's threads, the callers' worker threads and the status endpoint all touch it.
    """

    def __init__(self, keep_recent: int = 50) -> None:
        self._lock = threading.Lock()
        self.outcomes: Counter[str] = Counter()
        self.rejected: Counter[str] = Counter()
        self.bytes_sent = 0
        self.bytes_received = 0
        self.recent: deque[dict[str, Any]] = deque(maxlen=keep_recent)
        self.duration_bucket_counts = [0] * len(DURATION_BUCKETS)  # cumulative, as Prometheus wants them
        self.duration_sum = 0.0
        self.duration_count = 0

    def outcome(self, name: str) -> None:
        with self._lock:
            self.outcomes[name] += 1

    def rejection(self, reason: str) -> None:
        with self._lock:
            self.rejected[reason] += 1

    def add_bytes(self, sent: int = 0, received: int = 0) -> None:
        with self._lock:
            self.bytes_sent += sent
            self.bytes_received += received

    def record(self, *, peer: str, role: str, outcome: str, seconds: float, sent: int, received: int) -> None:
        """One finished exchange: counted by outcome, timed, and kept in the recent list."""
        with self._lock:
            self.outcomes[outcome] += 1
            self.duration_sum += seconds
            self.duration_count += 1
            for index, bound in enumerate(DURATION_BUCKETS):
                if seconds <= bound:
                    self.duration_bucket_counts[index] += 1
            self.recent.append(
                {
                    "peer": peer,
                    "role": role,
                    "outcome": outcome,
                    "seconds": seconds,
                    "bytes_sent": sent,
                    "bytes_received": received,
                    "time": time.time(),
                }
            )

    def snapshot(self) -> dict[str, Any]:
        """A consistent copy of everything, for the status endpoint and the metrics page."""
        with self._lock:
            return {
                "outcomes": dict(self.outcomes),
                "rejected": dict(self.rejected),
                "bytes_sent": self.bytes_sent,
                "bytes_received": self.bytes_received,
                "recent": list(self.recent),
                "duration_buckets": list(zip(DURATION_BUCKETS, self.duration_bucket_counts, strict=True)),
                "duration_sum": self.duration_sum,
                "duration_count": self.duration_count,
            }
