"""The live page `GET /` in real headless Chromium: it must draw a 2-node swarm's curves from live data.

The screenshot is kept with the test's files; set NOLOCO_SCREENSHOT=path to copy it somewhere (the README's
docs/status-page.png is made this way).
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import pytest

from .swarm_harness import Bootstrap, NodeProcess, stop_all
from .webdriver import Browser, browser_missing

TRAIN = ["--model", "tiny", "--seq-len", "64", "--batch-size", "8", "--eval-batches", "2", "--inner-steps", "25"]


def test_the_live_page_draws_both_nodes_curves_in_chromium(tmp_path: Path) -> None:
    missing = browser_missing()
    if missing and os.environ.get("NOLOCO_REQUIRE_BROWSER"):
        pytest.fail(f"NOLOCO_REQUIRE_BROWSER is set (CI) but {missing}")
    if missing:
        pytest.skip(missing)
    bootstrap = Bootstrap(tmp_path)
    nodes = [
        NodeProcess(f"node{i}", bootstrap, tmp_path, *TRAIN, "--steps", "100000", "--shard-index", str(i))
        for i in range(2)
    ]
    browser = None
    try:
        deadline = time.monotonic() + 60
        while not ((status := nodes[0].status()) and status.get("status_url")):
            assert time.monotonic() < deadline, "node0 never wrote its status URL"
            time.sleep(0.2)
        browser = Browser(tmp_path / "chromedriver.log")
        browser.open(status["status_url"] + "/")
        # The page polls /status every 2 s; wait until its chart holds this node's and the peer's curves, and it
        # says the node trains and lists its one peer.
        deadline = time.monotonic() + 120
        while True:
            series, points, health, peer_rows = browser.run(
                "return [document.body.dataset.series, document.body.dataset.points,"
                " document.getElementById('health').textContent,"
                " document.querySelectorAll('#peers tr').length - 1]"
            )
            if int(series) >= 2 and int(points) >= 12 and health == "training" and peer_rows == 1:
                break
            assert time.monotonic() < deadline, (
                f"the page never showed both curves, the health and the peer: series {series}, points {points}, "
                f"health {health!r}, peer rows {peer_rows}"
            )
            time.sleep(1.0)
        shot = tmp_path / "status-page.png"
        browser.screenshot(shot)
        assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 20_000
        if os.environ.get("NOLOCO_SCREENSHOT"):
            shutil.copy(shot, os.environ["NOLOCO_SCREENSHOT"])
    finally:
        if browser is not None:
            browser.close()
        stop_all(nodes)
        bootstrap.stop()
