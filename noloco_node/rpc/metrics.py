"""A node's exchange metrics: prometheus_client counters and a histogram in the node's own registry, and the last
exchanges.

Each node (and each benchmark peer) has its own :class:`~prometheus_client.CollectorRegistry`, so two nodes in one
process never share a series. ``GET /metrics`` serves the registry as it is (observability/http_server.py adds the
node's status gauges to it); ``/status`` reads the same objects through :meth:`ExchangeMetrics.snapshot`. No
series carries a per-peer label: label sets stay bounded however large the swarm, and the peer of each recent
exchange is in ``/status`` instead.

Thread-safe: the gRPC server's threads, the exchange threads and the status endpoint all touch it.
"""

from __future__ import annotations

import threading
import time
from collections import Counter as CounterDict
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

# Series named *_created (one per label set, the time it was first seen) double the output and no dashboard of this
# project reads them.
disable_created_metrics()

# Upper bounds (s) of the exchange-duration histogram's buckets: loopback exchanges of small models take
# milliseconds, a 1.3B model over a 100 Mbit/s link takes minutes.
DURATION_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


class ExchangeMetrics:
    """Exchanges by outcome, refused payloads by reason, receipts, bytes, a duration histogram and the last
    exchanges."""

    def __init__(self, keep_recent: int = 50) -> None:
        self.registry = CollectorRegistry()
        self._outcomes = Counter("noloco_exchanges", "Exchanges by outcome.", ["outcome"], registry=self.registry)
        self._rejected = Counter(
            "noloco_rejected_payloads", "Refused payloads by reason.", ["reason"], registry=self.registry
        )
        self._background_errors = Counter(
            "noloco_background_errors",
            "Background work of the pairing strategies that ended with an error.",
            ["task"],
            registry=self.registry,
        )
        self._receipts = Counter(
            "noloco_receipts",
            "Exchange receipts (security/receipts.py) by outcome: kept (both signatures), or why none was kept.",
            ["outcome"],
            registry=self.registry,
        )
        self._sent = Counter("noloco_bytes_sent", "Payload bytes sent to peers.", registry=self.registry)
        self._received = Counter("noloco_bytes_received", "Payload bytes received from peers.", registry=self.registry)
        self._duration = Histogram(
            "noloco_exchange_duration_seconds",
            "Wall time of exchanges, as caller or called side, whatever their outcome.",
            buckets=DURATION_BUCKETS,
            registry=self.registry,
        )
        self._lock = threading.Lock()
        self.recent: deque[dict[str, Any]] = deque(maxlen=keep_recent)
        self._calls_in_use: Callable[[], dict[str, int]] = dict
        self.registry.register(_CallsInUse(lambda: self._calls_in_use()))

    def count_calls_in_use(self, source: Callable[[], dict[str, int]]) -> None:
        """Read the calls being served, by kind, from ``source`` (the server's admission) when asked."""
        self._calls_in_use = source

    @property
    def calls_in_use(self) -> dict[str, int]:
        """Calls being served now, by kind (exchange, download, info, rollouts, receipts); empty without a server."""
        return self._calls_in_use()

    @property
    def outcomes(self) -> CounterDict[str]:
        """Exchanges by outcome, as counted so far (a missing outcome counts 0)."""
        return CounterDict(_by_label(self._outcomes, "outcome"))

    @property
    def rejected(self) -> CounterDict[str]:
        """Refused payloads by reason, as counted so far (a missing reason counts 0)."""
        return CounterDict(_by_label(self._rejected, "reason"))

    @property
    def bytes_sent(self) -> int:
        return int(_total(self._sent))

    @property
    def bytes_received(self) -> int:
        return int(_total(self._received))

    def outcome(self, name: str) -> None:
        self._outcomes.labels(name).inc()

    def background_error(self, task: str) -> None:
        self._background_errors.labels(task=task).inc()

    @property
    def background_errors(self) -> CounterDict[str]:
        """Background work that ended with an error, by task."""
        return CounterDict(_by_label(self._background_errors, "task"))

    def receipt(self, outcome: str) -> None:
        self._receipts.labels(outcome).inc()

    @property
    def receipts(self) -> CounterDict[str]:
        """Exchange receipts by outcome: ``kept``, or why a committed exchange left none (a refused signature or
        time, a partner that signed none)."""
        return CounterDict(_by_label(self._receipts, "outcome"))

    def rejection(self, reason: str) -> None:
        self._rejected.labels(reason).inc()

    def add_bytes(self, sent: int = 0, received: int = 0) -> None:
        if sent:
            self._sent.inc(sent)
        if received:
            self._received.inc(received)

    def record(self, *, peer: str, role: str, outcome: str, seconds: float, sent: int, received: int) -> None:
        """One finished exchange: counted by outcome, timed, and kept in the recent list."""
        self._outcomes.labels(outcome).inc()
        self._duration.observe(seconds)
        entry = {
            "peer": peer,
            "role": role,
            "outcome": outcome,
            "seconds": seconds,
            "bytes_sent": sent,
            "bytes_received": received,
            "time": time.time(),
        }
        with self._lock:
            self.recent.append(entry)

    def snapshot(self) -> dict[str, Any]:
        """The numbers ``/status`` shows, read from the same objects ``/metrics`` serves."""
        with self._lock:
            recent = list(self.recent)
        return {
            "outcomes": dict(self.outcomes),
            "rejected": dict(self.rejected),
            "background_errors": dict(self.background_errors),
            "receipts": dict(self.receipts),
            "bytes_sent": self.bytes_sent,
            "bytes_received": self.bytes_received,
            "calls_in_use": self.calls_in_use,
            "recent": recent,
        }


class _CallsInUse(Collector):
    """``noloco_calls_in_use{kind}``: a gauge read from the admission's slots at each scrape."""

    def __init__(self, source: Callable[[], dict[str, int]]) -> None:
        self._source = source

    def collect(self) -> Iterator[GaugeMetricFamily]:
        gauge = GaugeMetricFamily("noloco_calls_in_use", "Calls being served now, by kind.", labels=["kind"])
        for kind, count in sorted(self._source().items()):
            gauge.add_metric([kind], count)
        yield gauge


def _by_label(counter: Counter, label: str) -> dict[str, int]:
    return {
        sample.labels[label]: int(sample.value)
        for metric in counter.collect()
        for sample in metric.samples
        if sample.name.endswith("_total")
    }


def _total(counter: Counter) -> float:
    return sum(
        sample.value for metric in counter.collect() for sample in metric.samples if sample.name.endswith("_total")
    )
