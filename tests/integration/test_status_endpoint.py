"""The status endpoint of real node processes: /status against its schema, /metrics through the Prometheus parser,
/healthz turning 503 when the trainer dies, and the `status` and `peers` commands reading them."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from noloco_node.node.fault_injection import Drill
from noloco_node.observability.status import NodeStatus

from .swarm_harness import Bootstrap, NodeProcess, stop_all

TRAIN = ["--model", "tiny", "--seq-len", "64", "--batch-size", "8", "--eval-batches", "2", "--inner-steps", "20"]


def wait_for(condition: Callable[[], Any], timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


def get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as error:
        return error.code, error.read()


def status_url(node: NodeProcess) -> str | None:
    status = node.status()
    return status["status_url"] if status and status.get("status_url") else None


def cli(*args: str, timeout: float = 90) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "noloco_node", *args], capture_output=True, text=True, timeout=timeout, check=False
    )


def fetch(url: str) -> NodeStatus:
    code, body = get(url + "/status")
    assert code == 200
    return NodeStatus.model_validate_json(body)  # the schema is the contract: any drift fails here


def test_status_metrics_and_commands_on_a_live_two_node_swarm(bootstrap: Bootstrap, tmp_path: Path) -> None:
    nodes = [
        NodeProcess(f"node{i}", bootstrap, tmp_path, *TRAIN, "--steps", "100000", "--shard-index", str(i))
        for i in range(2)
    ]
    try:
        url = wait_for(lambda: status_url(nodes[0]), 60, "node0's status URL in its status.json")
        first = wait_for(lambda: (s := fetch(url)).outer_step >= 2 and s, 90, "two outer steps")
        assert first.health.state == "training" and first.health.ok
        assert first.train_loss is not None and first.val_loss is not None and first.tokens_per_second > 0
        assert first.learning_rate > 0 and first.checkpoint_age_seconds is not None

        # The numbers move as training goes on, and the peer shows up with its own curve (fetched over Info).
        later = wait_for(
            lambda: (s := fetch(url)).outer_step >= first.outer_step + 3 and s.peers and s.peers[0].history and s,
            90,
            "three more outer steps and the peer's curve",
        )
        assert later.inner_step > first.inner_step and later.uptime_seconds > first.uptime_seconds
        assert len(later.history) > len(first.history)
        assert later.history[-1].val_loss < first.history[0].val_loss  # it learns
        other = nodes[1].status()
        assert [peer.peer_id for peer in later.peers] == [other["peer_id"]]
        assert later.exchange_outcomes.get("completed", 0) >= 1 and later.bytes_sent > first.bytes_sent
        assert later.exchanges and {e.role for e in later.exchanges} <= {"caller", "served"}

        code, body = get(url + "/metrics")
        assert code == 200
        families = {family.name: family for family in text_string_to_metric_families(body.decode())}
        for name in (
            "noloco_exchanges",
            "noloco_exchange_duration_seconds",
            "noloco_rejected_payloads",
            "noloco_inner_steps",
            "noloco_outer_steps",
            "noloco_train_loss",
            "noloco_val_loss",
            "noloco_bytes_sent",
            "noloco_healthy",
        ):
            assert name in families, name
        steps = families["noloco_inner_steps"].samples[0].value
        assert steps >= later.inner_step  # a counter read after the status document
        completed = [s.value for s in families["noloco_exchanges"].samples if s.labels.get("outcome") == "completed"]
        assert completed and completed[0] >= 1
        buckets = [s.value for s in families["noloco_exchange_duration_seconds"].samples if s.name.endswith("_bucket")]
        assert buckets == sorted(buckets) and buckets[-1] >= completed[0]
        assert families["noloco_healthy"].samples[0].value == 1.0

        assert get(url + "/healthz") == (200, b"training\n")
        assert get(url + "/no-such-page")[0] == 404
        request = urllib.request.Request(url + "/status", method="POST", data=b"x")
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(request, timeout=5)
        assert refused.value.code == 405
        page_code, page = get(url + "/")
        assert page_code == 200 and b"<canvas" in page and b"http" not in page.split(b"<script>")[1]  # no CDN

        shown = cli("status", "--url", url)
        assert shown.returncode == 0, shown.stderr
        assert "health" in shown.stdout and "training" in shown.stdout and other["peer_id"][-8:] in shown.stdout
        assert "kept" in next(line for line in shown.stdout.splitlines() if line.lstrip().startswith("receipts"))
        listed = cli("peers", "--url", url)
        assert listed.returncode == 0, listed.stderr
        assert "2 live peer(s)" in listed.stdout
        assert other["peer_id"] in listed.stdout and later.peer_id in listed.stdout

        # The run's receipts, read by anyone: the ledger finds both members through the DHT and asks each for its
        # receipts over gRPC (GetReceipts, page by page); each partner's copy of a receipt counts once.
        counted = cli("contributions", "--json", "--url", url)
        assert counted.returncode == 0, counted.stderr
        ledger = json.loads(counted.stdout)
        assert {m["peer_id"] for m in ledger["members"]} == {later.peer_id, other["peer_id"]}
        assert ledger["refused"] == {} and ledger["duplicates"] >= 1
        assert all(m["blends"] >= 1 for m in ledger["members"])
    finally:
        stop_all(nodes)


def test_healthz_turns_503_with_the_reason_when_the_trainer_thread_dies(bootstrap: Bootstrap, tmp_path: Path) -> None:
    # Alone, a sync node waits out --alone-grace (1 s) at each outer step: dying at step 120 (6 outer steps) leaves
    # seconds of health to see first, not half a minute.
    dies_at = Drill(fail_at_inner_step=120).environment()
    node = NodeProcess(
        "node0",
        bootstrap,
        tmp_path,
        *TRAIN,
        "--steps",
        "100000",
        "--failure-linger",
        "60",
        log_format="json",
        env=dies_at,
    )
    try:
        url = wait_for(lambda: status_url(node), 60, "the status URL")
        wait_for(lambda: get(url + "/healthz")[0] == 200, 60, "a healthy trainer")
        _, body = wait_for(lambda: (r := get(url + "/healthz"))[0] == 503 and r, 90, "/healthz to turn 503")
        assert b"trainer thread died" in body and b"injected fault at inner step 120" in body
        status = fetch(url)
        assert status.health.state == "failed" and not status.health.ok and status.inner_step == 120
        shown = cli("status", "--url", url)
        assert shown.returncode == 1 and "trainer thread died" in shown.stdout
    finally:
        node.stop()
    assert node.process.returncode == 1  # a dead trainer is a failed node, not a clean exit
    final = json.loads((node.data_dir / "status.json").read_text())
    assert final["health"]["state"] == "failed"
    # --log-format json: every line the node printed, hivemind's included, is one JSON object.
    lines = [json.loads(line) for line in node.output().splitlines()]
    failure = [line for line in lines if line["message"] == "trainer thread failed"]
    assert failure and failure[0]["level"] == "ERROR" and "injected fault" in failure[0]["exception"]
