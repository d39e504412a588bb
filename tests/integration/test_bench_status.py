"""`noloco-node bench status` runs a real node, polls its /status and prints the throughput ratio."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest


@pytest.mark.slow  # a benchmark's smoke run: `make test-slow` (docs/testing.md)
def test_bench_status_prints_the_polled_to_quiet_ratio() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "noloco_node", "bench", "status", "--window", "3", "--rounds", "1"],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    quiet = re.search(r"quiet:\s+([\d.]+) inner steps/s", done.stdout)
    polled = re.search(r"polled:\s+([\d.]+) inner steps/s", done.stdout)
    ratio = re.search(r"throughput polled / quiet: ([\d.]+)", done.stdout)
    polls = re.search(r"polling: (\d+) GET /status", done.stdout)
    assert quiet and polled and ratio and polls, done.stdout
    assert float(quiet.group(1)) > 0 and float(polled.group(1)) > 0
    assert abs(float(ratio.group(1)) - float(polled.group(1)) / float(quiet.group(1))) < 0.01  # one round
    assert int(polls.group(1)) >= 20  # about 10 a second for 3 s: the endpoint kept answering
