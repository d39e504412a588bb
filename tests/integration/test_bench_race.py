"""`noloco-node bench race` end to end, small: real node processes and real DiLoCo processes (gloo's ring, and
hivemind's averager), each in its own network namespace behind a shaped, delayed link, racing to a loss; the
report's figures must obey the links' physics and the races' own arithmetic."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from .shaping import SHAPING_NEEDS, can_shape, leftover_namespaces

pytestmark = pytest.mark.skipif(not can_shape(), reason=f"bench race {SHAPING_NEEDS}")


def _row(stdout: str, method: str) -> list[str]:
    line = next(line for line in stdout.splitlines() if line.startswith(f"| {method} |"))
    return [cell.strip() for cell in line.strip("|").split("|")]


def test_bench_race_smoke(tmp_path: Path) -> None:
    """One method of each kind of process: NoLoCo's nodes (stream; sync differs only by --mode), DiLoCo's gloo
    ranks and hivemind's averager (DiLoCo at 2H differs only by H); the report's arithmetic over other runs is the
    unit tests' (tests/unit/test_bench_race.py)."""
    steps, inner_steps = 40, 10
    done = subprocess.run(
        [sys.executable, "-m", "noloco_node", "bench", "race", "--nodes", "2", "--steps", str(steps),
         "--inner-steps", str(inner_steps), "--step-seconds", "0.1", "--target-tokens-per-step", "2000000",
         "--methods", "noloco-stream,diloco-H,hivemind-H", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    out = done.stdout
    # The links are shaped as the scaling says: the emulated exchange time is the target's, times the time scale,
    # and the pairwise round measured on them takes at least the payload's transfer time at the link's rate.
    target = float(re.search(r"a bf16 pairwise exchange ([\d.]+) s", out).group(1))
    scale = float(re.search(r"time scale ([\d.]+)\)", out).group(1))
    emulated = float(re.search(r"a bf16 exchange ([\d.]+) s", out).group(1))
    assert emulated == pytest.approx(target * scale, rel=0.02)
    kilobytes = float(re.search(r"tiny \((\d+) KB in bf16\)", out).group(1))
    rate_mbit = float(re.search(r"links ([\d.]+) Mbit/s, RTT", out).group(1))
    measured = float(re.search(r"a pairwise round ([\d.]+) s", out).group(1))
    assert measured >= 0.9 * kilobytes * 1e3 * 8 / (rate_mbit * 1e6)
    rows = {method: _row(out, method) for method in ("noloco-stream", "diloco-H", "hivemind-H")}
    for method, cells in rows.items():
        assert 0 < float(cells[6]) < 4.5, (method, cells)  # trained: tiny starts near ln(256) = 5.5 nats
        assert not cells[7].endswith("(stopped)"), (method, cells)
    assert rows["diloco-H"][1] == rows["hivemind-H"][1] == str(inner_steps)
    assert int(rows["diloco-H"][2]) == int(rows["hivemind-H"][2]) == steps // inner_steps
    # hivemind's averager formed its group of both replicas at every outer step (it waits for a full group)
    assert f"hivemind-H: 0 of {2 * steps // inner_steps} replica-rounds found no full group" in out, out
    blends, outer_steps = map(int, rows["noloco-stream"][3].split("/"))
    assert outer_steps == 2 * steps // inner_steps and blends > 0, rows["noloco-stream"]
    # The DiLoCo run reaches its own final loss exactly when it ends: 1.00x against itself.
    assert rows["diloco-H"][9] == "1.00x"
    # Bytes on the shaped links: each blend of stream follows a swap of phi in bf16 (a model each way), and a ring
    # all-reduce of 2 hosts sends each host's half twice (reduce-scatter, all-gather), a model per host per round;
    # a counter cannot show less.
    megabytes = kilobytes / 1e3
    assert float(rows["noloco-stream"][5]) >= 0.9 * megabytes * blends / 2, rows["noloco-stream"]
    assert float(rows["diloco-H"][5]) >= 0.9 * megabytes * int(rows["diloco-H"][2]), rows["diloco-H"]
    curves = json.loads((tmp_path / "race-2.json").read_text())["runs"]
    for method, curve in curves.items():
        times = [point[0] for point in curve]
        assert times == sorted(times) and times[0] > 0, method
    assert (tmp_path / "race-2.png").stat().st_size > 10_000
    assert not leftover_namespaces("nlr")
