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
    assert "payload per direction 7 MB (bf16 on the wire)" in out
    both_ways = re.search(r"ratio to raw TCP doing the same transfer \(both ways\):\s+(\d+)%", out)
    one_way = re.search(r"ratio to raw TCP one way .*:\s+(\d+)%", out)
    assert both_ways and one_way
    assert 0 < int(both_ways.group(1)) <= 200 and 0 < int(one_way.group(1)) <= 200
    assert re.search(r"peak RSS added by exchanging: caller \d+ MB, served side \d+ MB", out)
