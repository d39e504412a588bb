"""JSON log lines, hivemind's records routed through them, and /metrics text that Prometheus' parser reads."""

from __future__ import annotations

import io
import json
import logging

from prometheus_client.parser import text_string_to_metric_families

from noloco_node.logs import configure_logging
from noloco_node.observability.metrics import register_status, render_metrics
from noloco_node.observability.status import Health, NodeStatus, SecurityStatus
from noloco_node.rpc.metrics import ExchangeMetrics


def test_json_lines_for_ours_and_hivemind(monkeypatch) -> None:
    stream = io.StringIO()
    monkeypatch.setattr("sys.stderr", stream)
    configure_logging("INFO", "json")
    try:
        logging.getLogger("noloco_node.node.daemon").info("outer step %d", 3)
        logging.getLogger("hivemind.dht.node").warning("a hivemind warning")
        try:
            raise ValueError("bad")
        except ValueError:
            logging.getLogger("noloco_node.x").exception("failed")
    finally:
        configure_logging("INFO", "text")
    lines = [json.loads(line) for line in stream.getvalue().splitlines()]
    assert lines[0]["message"] == "outer step 3" and lines[0]["level"] == "INFO" and "T" in lines[0]["time"]
    assert lines[1]["logger"] == "hivemind.dht.node" and lines[1]["level"] == "WARNING"
    assert "ValueError: bad" in lines[2]["exception"]


def status(**changes: object) -> NodeStatus:
    base = dict(
        peer_id="p",
        run_name="r",
        run_fingerprint="f",
        version="0",
        mode="sync",
        model_size="tiny",
        address="a",
        reachable=True,
        status_url="u",
        dht_maddrs=[],
        started_at=0.0,
        uptime_seconds=5.0,
        inner_step=120,
        outer_step=6,
        total_steps=1000,
        learning_rate=1e-3,
        train_loss=2.5,
        val_loss=None,
        val_perplexity=None,
        tokens_per_second=100.0,
        comm_wait_fraction=0.1,
        checkpoint_age_seconds=None,
        bytes_sent=10,
        bytes_received=20,
        exchange_outcomes={"completed": 4, "busy": 1},
        rejected_payloads={"not_finite": 2},
        exchanges=[],
        peers=[],
        history=[],
        security=SecurityStatus(
            private_run=False,
            tls=False,
            mutual_tls=False,
            norm_bound=1.0,
            norm_bound_basis="own_movement",
            last_partner_distance=None,
        ),
        health=Health(state="training", reason="", ok=True),
    )
    return NodeStatus(**{**base, **changes})


def test_metrics_parse_and_leave_absent_values_out() -> None:
    metrics = ExchangeMetrics()  # the node's own registry, with real prometheus_client objects in it
    for seconds in (0.01, 0.02, 0.03, 0.5):
        metrics.record(peer="p", role="caller", outcome="completed", seconds=seconds, sent=1, received=2)
    metrics.record(peer="p", role="served", outcome="busy", seconds=0.5, sent=0, received=0)
    metrics.rejection("not_finite")
    metrics.rejection("not_finite")
    metrics.add_bytes(sent=10, received=20)
    register_status(metrics.registry, status)
    families = {f.name: f for f in text_string_to_metric_families(render_metrics(metrics.registry).decode())}
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value for f in families.values() for s in f.samples}
    assert samples[("noloco_exchanges_total", (("outcome", "completed"),))] == 4
    assert samples[("noloco_rejected_payloads_total", (("reason", "not_finite"),))] == 2
    assert samples[("noloco_exchange_duration_seconds_bucket", (("le", "+Inf"),))] == 5
    assert samples[("noloco_exchange_duration_seconds_bucket", (("le", "0.05"),))] == 3
    assert samples[("noloco_bytes_sent_total", ())] == 10 and samples[("noloco_bytes_received_total", ())] == 20
    assert metrics.snapshot()["outcomes"] == {"completed": 4, "busy": 1}  # /status reads the same objects
    assert samples[("noloco_inner_steps_total", ())] == 120 and samples[("noloco_train_loss", ())] == 2.5
    assert "noloco_val_loss" not in families and "noloco_checkpoint_age_seconds" not in families
    assert families["noloco_node_info"].samples[0].labels["run_fingerprint"] == "f"


def test_the_alerts_gauges_count_only_peers_whose_word_counts() -> None:
    """noloco_refusing_peers and noloco_outer_steps_behind: free keys that refuse every call, or claim a far step,
    must not set off an operator's alert about an honest node."""
    from noloco_node.node.report import refusing_peers, steps_behind
    from noloco_node.observability.status import KnownPeer

    def call(peer: str, outcome: str) -> dict[str, str]:
        return {"peer": peer, "role": "caller", "outcome": outcome}

    recent = [call("a", "refused"), call("b", "refused"), call("b", "completed"), call("free1", "refused")]
    recent += [call("c", "refused"), {"peer": "d", "role": "server", "outcome": "refused"}]
    established = {"a", "b", "c", "d"}.__contains__
    assert refusing_peers(recent, established) == 2  # a and c; b answered since; free1 has no standing
    assert refusing_peers(recent, lambda peer: False) == 0

    def peer(step: int) -> KnownPeer:
        return KnownPeer(peer_id=f"p{step}", address="10.0.0.1:1", outer_step=step, inner_step=0, ready=True,
                         record_age_seconds=1.0)  # fmt: skip

    assert steps_behind(10, []) is None
    assert steps_behind(10, [peer(9), peer(14)]) == 4 and steps_behind(10, [peer(8)]) == 0
