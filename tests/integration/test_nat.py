"""Members behind real NATs pair like everyone else (issue 29): six real node processes, the real DHT, gRPC and
libp2p, in network namespaces (noloco_bench/nat_network.py). Two members are on the public segment; four sit behind
two home routers with nftables masquerade, two to a router (so two by two they share one public address): one
router keeps ports (port-restricted), the other picks a new one per connection (symmetric). Nobody outside a home
can open a connection into it.

The four find out that they cannot be dialed (a witness sees their calls come from their router), hold relays
among the public members, and are called through them (discovery/tunnels.py): every member blends at nearly every
outer step, pairs of two NAT'd members happen, and the relays count what they carried."""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import pytest

from noloco_bench.nat_network import Home, nat_network
from noloco_node.launcher.local_swarm import LocalSwarm

ARGS = [
    *("--model", "tiny", "--seq-len", "64", "--batch-size", "8", "--eval-batches", "2"),
    *("--steps", "100000", "--inner-steps", "50", "--warmup-steps", "10", "--log-every", "0"),
    *("--wait-for-peers", "5", "--record-ttl", "10", "--torch-threads", "1"),
    # What is measured here is reaching each other. Six CPU-bound nodes on two cores drift apart early (the tiny
    # model moves fast) and the adaptive norm bound then refuses a far partner, which is the bound's own business
    # (test_open_swarm.py, test_outsider.py): a fixed, loose bound keeps it out of this measurement.
    *("--norm-bound", "2.0"),
]
MEASURED_SECONDS = 60.0


@pytest.mark.skipif(os.geteuid() != 0, reason="network namespaces need root")
@pytest.mark.skipif(shutil.which("nft") is None and not os.environ.get("CI"), reason="needs nftables (.ci/run has)")
def test_members_behind_nats_blend_at_nearly_every_step_through_relays(tmp_path: Path) -> None:
    homes = [Home("port_restricted", 2), Home("symmetric", 2)]
    with nat_network(2, homes, rate_mbit=100, rtt_ms=20, prefix="nltnat") as net:
        behind = [m.behind is not None for m in net.members]
        swarm = LocalSwarm(tmp_path, len(net.members), ARGS, network=net)
        try:

            def statuses() -> list[dict]:
                return [swarm.status(slot) or {} for slot in swarm.slots]

            def settled(status: dict, nat: bool) -> bool:
                return status.get("reachable") is (not nat) and (not nat or len(status.get("relays", [])) >= 1)

            deadline = time.monotonic() + 180
            while not all(settled(s, nat) for s, nat in zip(statuses(), behind, strict=True)):
                assert time.monotonic() < deadline, [(s.get("reachable"), s.get("relays")) for s in statuses()]
                time.sleep(1)
            start = time.time()
            time.sleep(MEASURED_SECONDS)
            final = statuses()
        finally:
            codes = swarm.stop()
    ids = {s["peer_id"]: i for i, s in enumerate(final)}
    rates, nat_pairs = [], 0
    for i, status in enumerate(final):
        steps = [h for h in status["history"] if h["time"] > start]
        blended = [h for h in steps if h["partner"]]
        nat_pairs += sum(1 for h in blended if behind[i] and behind[ids.get(h["partner"], 0)])
        rates.append(len(blended) / max(1, len(steps)))
        print(
            f"member {i} ({net.members[i].behind or 'public'}, {net.members[i].public_address}): "
            f"blended {len(blended)}/{len(steps)} outer steps; relayed {status['relayed_bytes']} bytes for others; "
            f"tunnels served {status['tunnels_served']}, opened {status['tunnels_opened']}"
        )
    print(f"blends between two NAT'd members (counted at both ends): {nat_pairs}")
    assert all(len([h for h in s["history"] if h["time"] > start]) >= 10 for s in final), "a member barely trained"
    assert min(rates) >= 0.9, rates
    assert nat_pairs > 0
    assert sum(s["relayed_bytes"] for s in final if not behind[ids[s["peer_id"]]]) > 0
    assert all(s["relayed_bytes"] == 0 for s, nat in zip(final, behind, strict=True) if nat)  # nobody relays via them
    assert codes == [0] * len(final), codes
