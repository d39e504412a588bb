"""A swarm split in two and healed (docs/threat-model.md, "Drift is not hostility"): four real node processes, each
in a network namespace of its own behind the shaped network's router (noloco_bench/shaped_network.py), the
real DHT and gRPC. For a minute the router drops everything between the halves; then it stops. Replicas that were
apart have drifted: they must pair again, not refuse and quarantine each other."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from noloco_bench.outsider_swarm import steps_to_merge
from noloco_bench.shaped_network import shaped_network
from noloco_node.launcher.local_swarm import LocalSwarm

ARGS = [
    *("--model", "tiny", "--seq-len", "64", "--batch-size", "8", "--eval-batches", "2"),
    *("--steps", "100000", "--inner-steps", "100", "--warmup-steps", "10", "--log-every", "0"),
    *("--standing-seconds", "20", "--wait-for-peers", "3", "--record-ttl", "10"),
]
STANDING_SECONDS = 20.0
HALVES = ((0, 1), (2, 3))
SPLIT_SECONDS = 60.0


@pytest.mark.slow  # four nodes for almost two minutes, one of them split: `make test-slow`
@pytest.mark.skipif(os.geteuid() != 0, reason="network namespaces need root")
def test_a_swarm_split_for_a_minute_merges_again_and_nobody_is_quarantined(tmp_path: Path) -> None:
    with shaped_network(4, rate_mbit=1000, rtt_ms=2, prefix="nlpart") as net:
        swarm = LocalSwarm(tmp_path, 4, ARGS, network=net)
        try:

            def statuses() -> list[dict]:
                return [swarm.status(slot) or {} for slot in swarm.slots]

            deadline = time.monotonic() + 180
            while not all(s.get("peer_id") for s in statuses()):
                assert time.monotonic() < deadline, "the nodes did not come up"
                time.sleep(0.5)
            ids = [s["peer_id"] for s in statuses()]
            half_of = {ids[i]: h for h, half in enumerate(HALVES) for i in half}

            def standing_across(status: dict) -> bool:
                """The promise holds for a node with standing on the far side (docs/threat-model.md): it blended
                with one of the far half, whose record it has seen for --standing-seconds."""
                return status.get("uptime_seconds", 0) > STANDING_SECONDS + 2 and any(
                    h["partner"] and half_of.get(h["partner"]) != half_of.get(status["peer_id"])
                    for h in status.get("history", [])
                )

            # Until standing is granted every peer is called alike, so each node blends across the halves-to-be.
            while not all(s.get("outer_step", 0) >= 10 and standing_across(s) for s in statuses()):
                assert time.monotonic() < deadline, [(s.get("outer_step"), standing_across(s)) for s in statuses()]
                time.sleep(0.5)
            with net.partition(*HALVES):
                split = time.time()
                time.sleep(SPLIT_SECONDS)
            healed = time.time()

            def merge(index: int) -> tuple[int, float] | None:
                """The node's outer steps and seconds from the heal to its first blend across the old split."""
                return steps_to_merge(statuses()[index].get("history", []), healed, half_of, ids[index])

            deadline = time.monotonic() + 120
            while not all(merge(i) for i in range(4)) and time.monotonic() < deadline:
                time.sleep(0.5)
            final = statuses()
            during = [[h for h in s.get("history", []) if split < h["time"] <= healed and h["partner"]] for s in final]
            merged = [merge(i) for i in range(4)]
            merged_after = [m[0] if m else None for m in merged]
            refused = [s.get("rejected_payloads", {}).get("norm_bound", 0) for s in final]
            moved = [
                [(h["clock_moved_from"], h["outer_step"]) for h in s["history"] if h.get("clock_moved_from")]
                for s in final
            ]
            print(
                f"outer steps to the first blend across the split after the heal: {merged_after} "
                f"({[m[1] if m else None for m in merged]} s); "
                f"blends during the split: {[len(d) for d in during]}; clocks moved (from, to): {moved}; "
                f"refused for the norm bound: {refused}"
            )
            # The split was real: no blend crossed it while it lasted, and each half kept blending inside.
            for index, blends in enumerate(during):
                assert blends and all(half_of.get(h["partner"]) == half_of[ids[index]] for h in blends), blends
            # Every node blends across the old split again within 5 outer steps of the heal (issue 28's promise).
            # The time it takes is the DHT's to show the far side again, a few seconds whatever the step time, so
            # in outer steps it depends on their length: H = 100 of the tiny model is 1-3 s a step here (2-4 steps
            # to merge), and this test runs in the slow tier, alone; under a full `make test` beside it a step is
            # shorter than the DHT's seconds (8-9 steps were seen). A real model's outer step is minutes.
            for index, steps in enumerate(merged_after):
                assert steps is not None, f"node {index} never blended across the old split"
                assert steps <= 5, f"node {index} blended across the old split only {steps} outer steps after the heal"
            for slot in swarm.slots:
                assert "quarantined for" not in swarm.logs(slot)
        finally:
            swarm.stop()
