"""`GET /metrics`: the node's registry in the Prometheus text format.

The exchange counters and the duration histogram are prometheus_client objects in the node's own registry
(rpc/metrics.py). This module adds to that registry a collector of the node's status (what it is, its steps, its
losses, its health, its tasks' restarts), read at scrape time from the same document as ``/status``. Every series
carries no per-peer label: label sets stay bounded however large the swarm.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    InfoMetricFamily,
    Metric,
)

from noloco_node.observability.status import NodeStatus


class _StatusCollector:
    def __init__(self, status: Callable[[], NodeStatus]) -> None:
        self.status = status

    def collect(self) -> Iterator[Metric]:
        status = self.status()
        yield InfoMetricFamily(
            "noloco_node",
            "What this node is.",
            value={
                "peer_id": status.peer_id,
                "run_name": status.run_name,
                "run_fingerprint": status.run_fingerprint,
                "version": status.version,
                "mode": status.mode,
                "model_size": status.model_size,
            },
        )
        restarts = CounterMetricFamily(
            "noloco_task_restarts", "Restarts of the node's supervised background tasks.", labels=["task"]
        )
        for task in status.tasks:
            restarts.add_metric([task.name], task.restarts)
        yield restarts
        yield CounterMetricFamily(
            "noloco_inner_steps", "Inner optimizer steps of this replica.", value=status.inner_step
        )
        yield CounterMetricFamily("noloco_outer_steps", "Outer steps of this replica.", value=status.outer_step)
        yield CounterMetricFamily(
            "noloco_blends", "Outer steps blended with a partner since this node started.", value=status.blends
        )
        gauges: list[tuple[str, str, float | None]] = [
            ("noloco_train_loss", "Mean training loss over the recent inner steps.", status.train_loss),
            ("noloco_val_loss", "Validation loss at the last outer step.", status.val_loss),
            ("noloco_val_perplexity", "Validation perplexity at the last outer step.", status.val_perplexity),
            ("noloco_learning_rate", "Current inner learning rate.", status.learning_rate),
            ("noloco_tokens_per_second", "Training throughput over the recent inner steps.", status.tokens_per_second),
            ("noloco_comm_wait_fraction", "Share of trainer time spent waiting on peers.", status.comm_wait_fraction),
            ("noloco_checkpoint_age_seconds", "Since the last checkpoint.", status.checkpoint_age_seconds),
            ("noloco_uptime_seconds", "Since the node started.", status.uptime_seconds),
            ("noloco_known_peers", "Live peers of the run in the DHT.", float(len(status.peers))),
            (
                "noloco_outer_steps_behind",
                "The highest outer step among live peers whose claims count minus this node's (0 when none is ahead).",
                None if status.outer_steps_behind is None else float(status.outer_steps_behind),
            ),
            (
                "noloco_refusing_peers",
                "Peers with standing whose last answer among this node's recent exchanges refused it (quarantined it).",
                float(status.refusing_peers),
            ),
            ("noloco_healthy", "1 when /healthz answers 200.", 1.0 if status.health.ok else 0.0),
            (
                "noloco_established_peers",
                "Live peers with standing: seen for --standing-seconds and blended with this node.",
                float(status.security.established_peers),
            ),
            ("noloco_norm_bound", "Bound on a partner's relative L2 weight distance.", status.security.norm_bound),
            (
                "noloco_partner_distance",
                "Relative L2 weight distance of the last admitted partner.",
                status.security.last_partner_distance,
            ),
            (
                "noloco_partner_tensor_ratio",
                "The last admitted partner's largest tensor distance as a fraction of that tensor's bound.",
                status.security.last_partner_tensor_ratio,
            ),
        ]
        for name, documentation, value in gauges:
            if value is not None:  # an absent value is an absent series, not a made-up zero
                yield GaugeMetricFamily(name, documentation, value=value)


def register_status(registry: CollectorRegistry, status: Callable[[], NodeStatus]) -> None:
    """Serve the node's status gauges from ``registry`` too, read at every scrape."""
    registry.register(_StatusCollector(status))


def render_metrics(registry: CollectorRegistry) -> bytes:
    return generate_latest(registry)
