"""deploy/'s alert rules and Grafana dashboard against a real Prometheus (Debian's ``prometheus`` package): promtool
checks the rules and runs their unit tests (each alert at the edges of its window), and a Prometheus process
scrapes a live local swarm of two nodes, answers every query of the dashboard with data, and fires NolocoNodeDown
for the node that stopped."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
import yaml

from .swarm_harness import Bootstrap, NodeProcess

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
RULES = DEPLOY / "prometheus" / "noloco-alerts.yml"
DASHBOARD = DEPLOY / "grafana" / "noloco-dashboard.json"
PROMETHEUS, PROMTOOL = shutil.which("prometheus"), shutil.which("promtool")
# CI installs the package (.ci/run) and sets this: there the tests must run, not skip.
REQUIRED = os.environ.get("NOLOCO_REQUIRE_PROMETHEUS") == "1"
pytestmark = pytest.mark.skipif(
    not (PROMETHEUS and PROMTOOL) and not REQUIRED, reason="Debian's prometheus package (prometheus, promtool)"
)
TRAIN = ("--model", "tiny", "--seq-len", "64", "--batch-size", "8", "--eval-batches", "2", "--inner-steps", "10")


def test_promtool_checks_the_rules_and_their_unit_tests_pass() -> None:
    assert PROMTOOL is not None
    for command in (
        [PROMTOOL, "check", "rules", str(RULES)],
        [PROMTOOL, "test", "rules", str(RULES.with_name("noloco-alerts.test.yml"))],
        [PROMTOOL, "check", "config", str(RULES.with_name("prometheus.yml"))],
    ):
        done = subprocess.run(command, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0 and "SUCCESS" in done.stdout, done.stdout + done.stderr


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _api(port: int, path: str, **params: str) -> dict:
    url = f"http://127.0.0.1:{port}/api/v1/{path}" + (f"?{urllib.parse.urlencode(params)}" if params else "")
    with urllib.request.urlopen(url, timeout=5) as answer:
        body = json.loads(answer.read())
    assert body["status"] == "success", body
    return body["data"]


def _until(what: str, check, seconds: float, why=lambda: ""):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + seconds
    while True:
        try:
            found = check()
        except OSError:
            found = None
        if found:
            return found
        assert time.monotonic() < deadline, f"{what} not within {seconds:.0f} s; {why()}"
        time.sleep(0.5)


def _dashboard_queries() -> list[str]:
    panels = json.loads(DASHBOARD.read_text())["panels"]
    return [target["expr"].replace("$instance", ".*") for panel in panels for target in panel["targets"]]


def test_a_prometheus_scraping_a_local_swarm_answers_the_dashboard_and_fires_for_a_stopped_node(
    bootstrap: Bootstrap, tmp_path: Path
) -> None:
    assert PROMETHEUS is not None
    nodes = [NodeProcess(f"node{i}", bootstrap, tmp_path, *TRAIN, "--steps", "100000") for i in range(2)]
    prometheus = None
    try:
        # Both nodes past two outer steps with a partner: every series the dashboard reads exists by then.
        def blended_twice() -> bool:
            statuses = [node.status() or {} for node in nodes]
            return all(s.get("blends", 0) >= 2 and s.get("checkpoint_age_seconds") is not None for s in statuses)

        _until("two blends on each node", blended_twice, 120, lambda: nodes[0].blend_report())
        targets = [urllib.parse.urlparse((node.status() or {})["status_url"]).netloc for node in nodes]

        # The rules as deploy/ has them, but for NolocoNodeDown's window: 2 minutes there (the unit tests above check
        # it), 5 seconds here so the test does not wait for it.
        rules = yaml.safe_load(RULES.read_text())
        (down,) = [rule for rule in rules["groups"][0]["rules"] if rule["alert"] == "NolocoNodeDown"]
        down["for"] = "5s"
        (tmp_path / "rules.yml").write_text(yaml.safe_dump(rules))
        config = {
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "rule_files": [str(tmp_path / "rules.yml")],
            "scrape_configs": [{"job_name": "noloco", "static_configs": [{"targets": targets}]}],
        }
        (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
        port = _free_port()
        prometheus = subprocess.Popen(
            [
                PROMETHEUS,
                f"--config.file={tmp_path / 'prometheus.yml'}",
                f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                f"--web.listen-address=127.0.0.1:{port}",
            ],
            stdout=(tmp_path / "prometheus.log").open("w"),
            stderr=subprocess.STDOUT,
        )
        log = tmp_path / "prometheus.log"

        def both_up() -> bool:
            series = _api(port, "query", query='up{job="noloco"} == 1')["result"]
            return len(series) == 2

        _until("both nodes scraped", both_up, 60, lambda: log.read_text()[-2000:])
        # Every query of the dashboard is valid PromQL and has data from the live nodes (rates need two scrapes).
        queries = _dashboard_queries()
        assert len(queries) >= 14
        for query in queries:
            _until(f"data for {query}", lambda query=query: _api(port, "query", query=query)["result"], 30)
        names = set(re.findall(r"\bnoloco_[a-z_]+", " ".join(queries)))
        assert {"noloco_blends_total", "noloco_outer_steps_behind", "noloco_refusing_peers"} <= names

        stopped, running = targets[1], targets[0]
        nodes[1].stop()
        stopped_at = time.monotonic()

        def fired() -> list[dict]:
            alerts = _api(port, "alerts")["alerts"]
            return [a for a in alerts if a["labels"]["alertname"] == "NolocoNodeDown" and a["state"] == "firing"]

        firing = _until("NolocoNodeDown firing", fired, 60, lambda: str(_api(port, "alerts")))
        assert [alert["labels"]["instance"] for alert in firing] == [stopped]  # not the node still running
        assert running != stopped and time.monotonic() - stopped_at < 60
        assert firing[0]["annotations"]["summary"] == f"noloco node {stopped} is down"
    finally:
        if prometheus is not None:
            prometheus.terminate()
            prometheus.wait(timeout=30)
        for node in nodes:
            node.stop()
