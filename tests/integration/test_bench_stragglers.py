"""`noloco-node bench stragglers` end to end, small: a real overlap-mode swarm and real gloo barrier processes with
log-normal step times, and a report whose rates agree with the emulated step time."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest


@pytest.mark.slow  # a benchmark's smoke run: `make test-slow` (docs/testing.md)
def test_bench_stragglers_smoke() -> None:
    step_seconds = 0.05
    done = subprocess.run(
        [sys.executable, "-m", "noloco_node", "bench", "stragglers", "--nodes", "2", "--steps", "40",
         "--inner-steps", "10", "--step-seconds", str(step_seconds), "--sigma", "0.5", "--modes", "overlap"],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rates = {}
    for name in ("noloco overlap", "diloco barrier"):
        row = next(line for line in done.stdout.splitlines() if line.startswith(f"| {name} |"))
        rates[name] = float(re.search(r"\| ([\d.]+) \(min", row).group(1))
        # a replica cannot step faster than its emulated step times allow (their mean is 1 / step_seconds, give or
        # take the sampling error of 40 draws), and it did train
        assert 0 < rates[name] < 1.4 / step_seconds, row
    barrier_row = next(line for line in done.stdout.splitlines() if line.startswith("| diloco barrier |"))
    assert float(barrier_row.split("|")[4].strip().rstrip("%")) > 0  # the barrier made replicas wait
    assert "the barrier's expected rate from the distribution" in done.stdout
    assert "noloco overlap / diloco barrier throughput" in done.stdout
