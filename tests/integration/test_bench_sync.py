"""`noloco-node bench sync` end to end on a small shaped network: real namespaces, tbf, the delaying router, the
node's gRPC exchange and a gloo all-reduce, with a table whose figures obey the links' physics."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from .shaping import SHAPING_NEEDS, can_shape, leftover_namespaces

pytestmark = pytest.mark.skipif(not can_shape(), reason=f"bench sync {SHAPING_NEEDS}")


@pytest.mark.slow  # a benchmark's smoke run: `make test-slow` (docs/testing.md)
def test_bench_sync_smoke_measures_a_shaped_network() -> None:
    rate_mbit, rtt_ms, size_mb = 40.0, 40.0, 0.5
    done = subprocess.run(
        [sys.executable, "-m", "noloco_node", "bench", "sync", "--nodes", "3", "--sizes-mb", str(size_mb),
         "--rate-mbit", str(rate_mbit), "--rtt-ms", str(rtt_ms), "--warm-rounds", "1", "--ring-rounds", "1"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    row = next(line for line in done.stdout.splitlines() if line.startswith("| 3 |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    cold, warm, limit = float(cells[2]), float(cells[3]), float(cells[4])
    ring, ring_model = float(cells[6]), float(cells[7])
    transfer = size_mb * 2**20 * 8 / (rate_mbit * 1e6)
    assert limit == pytest.approx(transfer + rtt_ms / 1000, abs=1e-3)
    # The links are really shaped and delayed: nothing moves faster than the bandwidth allows (less tbf's 2-packet
    # burst of 128 KB at each end), and a new connection pays round trips before any data flows.
    assert warm >= transfer - 2 * 128 * 1024 * 8 / (rate_mbit * 1e6)
    assert cold >= warm and cold >= 2 * rtt_ms / 1000
    assert ring > 0 and ring_model > 0
    assert re.search(r"ring / pairwise \| model ratio", done.stdout)
    assert not leftover_namespaces("nls")
