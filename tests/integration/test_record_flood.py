"""Discovery under a flood of records from free keys (issue 43, docs/threat-model.md 12): real node processes, the
real DHT and gRPC, and noloco_bench/record_flood.py as a process of its own writing 1,000 records that fill every
field and 1,100 dated ahead of the readers' clocks into the run's buckets, with addresses nobody answers at. Honest
members still find each other and blend: on a fresh swarm (the flood is there before any member has standing) and
on the same swarm once its standing has formed (a second flood, new keys)."""

from __future__ import annotations

import json
import select
import subprocess
import sys
import time
from pathlib import Path

import pytest

from .swarm_harness import Bootstrap, NodeProcess, stop_all

TRAIN = [
    *("--model", "tiny", "--seq-len", "64", "--batch-size", "8", "--eval-batches", "2"),
    *("--steps", "100000", "--inner-steps", "20", "--log-every", "0", "--standing-seconds", "10"),
]
BLENDS = 5  # honest blends each member makes after a flood's records are stored
FLOOD_SECONDS = 300.0  # the flood stores its records again every 30 s for this long after its last wave


def _start_flood(bootstrap: Bootstrap, fingerprint: str) -> subprocess.Popen:
    """The record flood of the run in two waves of new keys, all minted first (a minute on two cores)."""
    return subprocess.Popen(
        [
            *(sys.executable, "-m", "noloco_bench.record_flood", "--run-fingerprint", fingerprint, "--waves", "2"),
            *(item for maddr in bootstrap.maddrs for item in ("--bootstrap", maddr)),
            *("--seconds", str(FLOOD_SECONDS), "--nice", "0"),  # an outsider brings its own CPU
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )


def _stored(flood: subprocess.Popen) -> float:
    """When the flood's next wave was stored (Unix time)."""
    assert flood.stdout is not None
    # Storing ~6,000 entries takes some 200 s of CPU (over a minute alone); beside three training members on two
    # cores, the second wave took over 400 s.
    ready, _, _ = select.select([flood.stdout], [], [], 900)
    assert ready, "the flood did not store its records within 900 s"
    stored = json.loads(flood.stdout.readline())
    assert stored["stored"] > 0, stored
    return float(stored["at"])


def _honest_blends_since(nodes: list[NodeProcess], honest: set[str], since: float) -> list[int]:
    statuses = [node.status() or {} for node in nodes]
    return [sum(1 for h in s.get("history", []) if h["time"] > since and h["partner"] in honest) for s in statuses]


def _wait_for_blends(nodes: list[NodeProcess], honest: set[str], since: float, seconds: float) -> list[int]:
    deadline = time.monotonic() + seconds
    while min(blends := _honest_blends_since(nodes, honest, since)) < BLENDS:
        assert time.monotonic() < deadline, f"honest blends per member since the flood: {blends}"
        time.sleep(1.0)
    return blends


@pytest.mark.slow  # two waves of 2,100 keys (minting them takes a minute): `make test-slow`
@pytest.mark.timeout(2400)  # the suite's 600 s is for the fast tier: each wave's stores take minutes under load
def test_members_find_each_other_and_blend_through_floods_of_filled_and_future_dated_records(
    bootstrap: Bootstrap, tmp_path: Path
) -> None:
    probe = NodeProcess("probe", bootstrap, tmp_path, *TRAIN)  # says the run's fingerprint, and leaves
    nodes: list[NodeProcess] = []
    flood: subprocess.Popen | None = None
    try:
        deadline = time.monotonic() + 120
        while not (said := probe.status()):
            assert time.monotonic() < deadline, "the probe wrote no status"
            time.sleep(0.5)
        probe.stop()
        flood = _start_flood(bootstrap, said["run_fingerprint"])
        stored = _stored(flood)
        nodes += [NodeProcess(name, bootstrap, tmp_path, *TRAIN) for name in ("a", "b", "c")]
        deadline = time.monotonic() + 120
        while not all(statuses := [node.status() for node in nodes]):
            assert time.monotonic() < deadline, "a member wrote no status"
            time.sleep(0.5)
        honest = {s["peer_id"] for s in statuses if s}
        fresh = _wait_for_blends(nodes, honest, stored, 240)

        # The swarm has standing now: every member has blended with the others. The second wave, new keys.
        deadline = time.monotonic() + 120
        while not all((s := node.status()) and s["security"]["established_peers"] >= 1 for node in nodes):
            assert time.monotonic() < deadline, "standing never formed"
            time.sleep(1.0)
        assert flood.stdin is not None
        flood.stdin.write(f"{max((node.status() or {}).get('outer_step', 0) for node in nodes)}\n")
        flood.stdin.flush()
        stored = _stored(flood)
        standing = _wait_for_blends(nodes, honest, stored, 240)
        views = [(node.status() or {}).get("discovery") for node in nodes]
        print(f"honest blends per member after the flood: fresh swarm {fresh}, with standing {standing}; {views}")
        for node in nodes:
            partners = {h["partner"] for h in (node.status() or {}).get("history", []) if h["partner"]}
            assert partners <= honest, partners - honest  # a flood key answers nobody: it cannot have blended
    finally:
        if flood is not None:
            flood.kill()
            flood.wait(timeout=30)
        stop_all(nodes)
