"""A swarm split in two and healed (docs/threat-model.md, "Drift is not hostility"): four real node processes, each
in a network namespace of its own behind the shaped network's router (noloco_node/bench/shaped_network.py), the
real DHT and gRPC. For a minute the router drops everything between the halves; then it stops. Replicas that were
apart have drifted: they must pair again, not refuse and quarantine each other."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from noloco_node.bench.shaped_network import shaped_network
from noloco_node.launcher.local_swarm import LocalSwarm

ARGS = [
    *("--model", "tiny", "--seq-len", "64", "--batch-size", "8", "--eval-batches", "2"),
    *("--steps", "100000", "--inner-steps", "20", "--warmup-steps", "10", "--log-every", "0"),
    *("--standing-seconds", "5", "--avoid-seconds", "2", "--wait-for-peers", "3", "--record-ttl", "10"),
]
HALVES = ((0, 1), (2, 3))
SPLIT_SECONDS = 60.0
MERGE_STEPS = 5  # every node blends across the old split within this many of its outer steps after the heal


@pytest.mark.skipif(os.geteuid() != 0, reason="network namespaces need root")
def test_a_swarm_split_for_a_minute_merges_again_and_nobody_is_quarantined(tmp_path: Path) -> None:
    with shaped_network(4, rate_mbit=1000, rtt_ms=2, prefix="nlpart") as net:
        swarm = LocalSwarm(tmp_path, 4, ARGS, network=net)
        try:

            def statuses() -> list[dict]:
                return [swarm.status(slot) or {} for slot in swarm.slots]

            deadline = time.monotonic() + 180
            while not all(s.get("outer_step", 0) >= 10 and s.get("uptime_seconds", 0) > 8 for s in statuses()):
                assert time.monotonic() < deadline, "the swarm did not get going"
                time.sleep(0.5)
            ids = [s["peer_id"] for s in statuses()]
            half_of = {ids[i]: h for h, half in enumerate(HALVES) for i in half}
            with net.partition(*HALVES):
                split = time.time()
                time.sleep(SPLIT_SECONDS)
            healed = time.time()
            at_heal = [s["outer_step"] for s in statuses()]

            def merged(index: int) -> dict | None:
                """The node's first blend across the old split after the heal."""
                history = statuses()[index].get("history", [])
                return next(
                    (
                        h
                        for h in history
                        if h["time"] > healed and h["partner"] and half_of.get(h["partner"]) != half_of[ids[index]]
                    ),
                    None,
                )

            deadline = time.monotonic() + 120
            while not all(merged(i) for i in range(4)) and time.monotonic() < deadline:
                time.sleep(0.5)
            during = [
                [h for h in s.get("history", []) if split < h["time"] <= healed and h["partner"]] for s in statuses()
            ]
            firsts = [merged(i) for i in range(4)]
            refused = [s.get("rejected_payloads", {}).get("norm_bound", 0) for s in statuses()]
            print(
                "outer steps to the first blend across the split after the heal: "
                f"{[f['outer_step'] - step if f else None for f, step in zip(firsts, at_heal, strict=True)]}; "
                f"blends during the split: {[len(d) for d in during]}; "
                f"refused for the norm bound: {refused}"
            )
            # The split was real: no blend crossed it while it lasted, and each half kept blending inside.
            for index, blends in enumerate(during):
                assert blends and all(half_of.get(h["partner"]) == half_of[ids[index]] for h in blends), blends
            for index, first in enumerate(firsts):
                assert first is not None, f"node {index} never blended across the old split"
                assert first["outer_step"] - at_heal[index] <= MERGE_STEPS, (index, first["outer_step"], at_heal)
            for slot in swarm.slots:
                assert "quarantined for" not in swarm.logs(slot)
        finally:
            swarm.stop()
