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


STEPS, INNER_STEPS = 40, 10


def _race(tmp_path: Path, methods: str) -> tuple[str, dict[str, list[str]]]:
    """A 2-replica race of ``methods``; checks what every race must show, and returns its output and table rows."""
    done = subprocess.run(
        [sys.executable, "-m", "noloco_node", "bench", "race", "--nodes", "2", "--steps", str(STEPS),
         "--inner-steps", str(INNER_STEPS), "--step-seconds", "0.1", "--target-tokens-per-step", "2000000",
         "--methods", methods, "--out", str(tmp_path)],
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
    rate_mbit = float(re.search(r"links ([\d.]+) Mbit/s, RTT", out).group(1))
    measured = float(re.search(r"a pairwise round ([\d.]+) s", out).group(1))
    assert measured >= 0.9 * _kilobytes(out) * 1e3 * 8 / (rate_mbit * 1e6)
    rows = {method: _row(out, method) for method in methods.split(",")}
    for method, cells in rows.items():
        assert 0 < float(cells[6]) < 4.5, (method, cells)  # trained: tiny starts near ln(256) = 5.5 nats
        assert not cells[7].endswith("(stopped)"), (method, cells)
    # The DiLoCo run reaches its own final loss exactly when it ends: 1.00x against itself.
    assert rows["diloco-H"][1] == str(INNER_STEPS) and int(rows["diloco-H"][2]) == STEPS // INNER_STEPS
    assert rows["diloco-H"][9] == "1.00x"
    # A ring all-reduce of 2 hosts sends each host's half twice (reduce-scatter, all-gather): a model per host per
    # round on the shaped link; a counter cannot show less.
    assert float(rows["diloco-H"][5]) >= 0.9 * _kilobytes(out) / 1e3 * int(rows["diloco-H"][2]), rows["diloco-H"]
    curves = json.loads((tmp_path / "race-2.json").read_text())["runs"]
    assert set(curves) == set(rows)
    for method, curve in curves.items():
        times = [point[0] for point in curve]
        assert times == sorted(times) and times[0] > 0, method
    assert (tmp_path / "race-2.png").stat().st_size > 10_000
    assert not leftover_namespaces("nlr")
    return out, rows


def _kilobytes(out: str) -> float:
    return float(re.search(r"tiny \((\d+) KB in bf16\)", out).group(1))


@pytest.mark.slow  # a benchmark's smoke run: `make test-slow` (docs/testing.md)
def test_bench_race_smoke(tmp_path: Path) -> None:
    """NoLoCo's nodes (stream; sync differs only by --mode) against DiLoCo's gloo ranks (2H differs only by H); the
    report's arithmetic over other runs is the unit tests' (tests/unit/test_bench_race.py)."""
    out, rows = _race(tmp_path, "noloco-stream,diloco-H")
    blends, outer_steps = map(int, rows["noloco-stream"][3].split("/"))
    assert outer_steps == 2 * STEPS // INNER_STEPS and blends > 0, rows["noloco-stream"]
    # Each blend of stream follows a swap of phi in bf16 (a model each way) on the shaped links.
    assert float(rows["noloco-stream"][5]) >= 0.9 * _kilobytes(out) / 1e3 * blends / 2, rows["noloco-stream"]


@pytest.mark.slow
def test_bench_race_hivemind_smoke(tmp_path: Path) -> None:
    """hivemind-H: the same DiLoCo with hivemind's averager. Slow tier: on these links the averager once held a part
    for 60 s and then 60 s more (a fresh-clone run: "Reducer: received 50.0% of input tensors", then "Averaging:
    received 53.4% results"), and the run met the race's time cap at 3 of its 4 outer steps."""
    out, rows = _race(tmp_path, "diloco-H,hivemind-H")
    assert rows["hivemind-H"][1] == str(INNER_STEPS) and int(rows["hivemind-H"][2]) == STEPS // INNER_STEPS
    # hivemind's averager formed its group of both replicas at every outer step (it waits for a full group)
    assert f"hivemind-H: 0 of {2 * STEPS // INNER_STEPS} replica-rounds found no full group" in out, out
    # the same seeds and the same mean: the same losses as gloo's DiLoCo, to the precision of fp16 on the wire
    assert float(rows["hivemind-H"][6]) == pytest.approx(float(rows["diloco-H"][6]), abs=0.01), rows
