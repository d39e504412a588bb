"""`noloco-node bench exchange` runs two real processes and prints its figure next to raw TCP from the same run."""

from __future__ import annotations

import re
import subprocess
import sys


def test_bench_exchange_prints_the_ratio_to_raw_tcp() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "noloco_node", "bench", "exchange", "--model", "small", "--repeats", "1"],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout
    assert "exchange payload 7 MB per direction (bf16 on the wire)" in out
    ratios = {
        label: re.search(rf"ratio to {label}[^\n]*:\s+(\d+)%", out)
        for label in (
            r"raw TCP doing the same transfer \(both ways\)",
            "raw TCP one way, per direction",
            "raw TCP one way, bytes moved",
            "bare gRPC both ways",
            r"raw TCP one way(?=:)",  # the state download's
        )
    }
    assert all(ratios.values()), out
    assert all(0 < int(match.group(1)) <= 400 for match in ratios.values()), out
    assert re.search(r"peak RSS added by exchanging: caller \d+ MB, served side \d+ MB", out)
