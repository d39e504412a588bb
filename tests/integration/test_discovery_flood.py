"""Records cost nothing to write: 1,100 of them from free keys, dated an hour in the future or filled up to the
size readers accept, under the run's peers key (noloco_bench/record_flood.py, a process of its own), against two
honest node processes with and without standing. Readers used to keep the 1,024 newest records by the date their
writers gave: a flood dated in the future pushed out every honest record, and a fresh swarm made no blend in 90 s.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from .swarm_harness import Bootstrap, NodeProcess, stop_all

TRAIN = ["--model", "tiny", "--seq-len", "64", "--batch-size", "8", "--eval-batches", "2"]
RECORDS = 1100
WINDOW = 30.0  # seconds of flood, once its records are stored


@pytest.mark.slow  # 1,100 keys and records, about two minutes per case: `make test-slow`
@pytest.mark.parametrize(
    ("standing", "flood"), [("none", ["--ahead", "3600"]), ("formed", ["--ahead", "3600"]), ("formed", ["--fill"])]
)
def test_honest_nodes_find_each_other_and_blend_under_a_flood_of_free_records(
    bootstrap: Bootstrap, tmp_path: Path, standing: str, flood: list[str]
) -> None:
    """``none``: --standing-seconds longer than the test, so the two nodes are strangers to each other all along (a
    fresh swarm). ``formed``: they have standing with each other before the flood begins."""
    standing_seconds = "3600" if standing == "none" else "3"
    args = [*TRAIN, "--steps", "100000", "--inner-steps", "20", "--standing-seconds", standing_seconds]
    nodes = [NodeProcess(f"n{i}", bootstrap, tmp_path, *args, "--shard-index", str(i)) for i in range(2)]
    try:
        deadline = time.monotonic() + 120
        while not all(len((n.status() or {}).get("history", [])) >= 3 for n in nodes):
            assert time.monotonic() < deadline and all(n.process.poll() is None for n in nodes)
            time.sleep(0.2)
        flooder = subprocess.Popen(
            [
                *(sys.executable, "-m", "noloco_bench.record_flood", "--records", str(RECORDS), *flood),
                *(item for n in nodes for item in ("--data-dir", str(n.data_dir))),
                *("--seconds", str(WINDOW + 240)),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            # The flood's records are stored once the nodes list them: wait for that, then a window under it.
            deadline = time.monotonic() + 240
            while max(len((n.status() or {}).get("peers", [])) for n in nodes) < RECORDS // 2:
                assert flooder.poll() is None, flooder.stderr.read() if flooder.stderr else ""
                assert time.monotonic() < deadline, [len((n.status() or {}).get("peers", [])) for n in nodes]
                time.sleep(0.5)
            started = time.time()
            time.sleep(WINDOW)  # the window itself: what is measured is what the nodes did in it
            ended = time.time()
            listed = [len((n.status() or {}).get("peers", [])) for n in nodes]
        finally:
            flooder.terminate()
            out, err = flooder.communicate(timeout=60)
        report = json.loads(out.strip().splitlines()[-1]) if out.strip() else {"stderr": err[-2000:]}
        statuses = [n.status() for n in nodes]
    finally:
        stop_all(nodes)
    honest = {s["peer_id"] for s in statuses}
    steps = [[h for h in s["history"] if started < h["time"] <= ended] for s in statuses]
    blended = [sum(1 for h in hs if h["partner"] in honest) for hs in steps]
    taken = [len(hs) for hs in steps]
    print(f"{standing}, {flood}: peers listed {listed}, blends with the honest peer {blended} of {taken}; {report}")
    assert report.get("stored", 0) >= RECORDS, report
    for hs, count in zip(steps, blended, strict=True):
        assert len(hs) >= 5 and count >= 0.5 * len(hs), (standing, flood, blended, taken)
