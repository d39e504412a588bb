"""Members behind real NATs pair like everyone else (issue 29): six real node processes, the real DHT, gRPC and
libp2p, in network namespaces (noloco_bench/nat_network.py). Two members are on the public segment; four sit behind
two home routers with nftables masquerade, two to a router (so two by two they share one public address): one
router keeps ports (port-restricted), the other picks a new one per connection (symmetric). Nobody outside a home
can open a connection into it.

The four find out that they cannot be dialed (a witness sees their calls come from their router), hold relays
among the public members, and are called through them (discovery/tunnels.py): every member blends at nearly every
outer step, pairs of two NAT'd members happen, and the relays count what they carried. A public member's tunnel
to a NAT'd one becomes a direct connection (discovery/hole_punch.py: the member connects out, through any NAT);
between NAT'd members (behind one router, or a symmetric one) tunnels stay relayed."""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import pytest

from noloco_bench.nat import HOMES, measure_swarm, node_args, report
from noloco_bench.nat_network import firewall, nat_network
from noloco_node.launcher.local_swarm import LocalSwarm

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="network namespaces need root"),
    pytest.mark.skipif(shutil.which("nft") is None and not os.environ.get("CI"), reason="needs nftables (.ci/run has)"),
]


@pytest.mark.slow  # six nodes for about 100 s: `make test-slow` (bench nat measures the same swarm)
def test_members_behind_nats_blend_at_nearly_every_step_through_relays(tmp_path: Path) -> None:
    with nat_network(2, HOMES, rate_mbit=100, rtt_ms=20, prefix="nltnat") as net:
        figures = measure_swarm(net, tmp_path, node_args("tiny", 50), seconds=60.0, name="NATs")
    print(report([figures]))
    members = figures.members
    assert [m.reachable for m in members] == [m.label == "public" for m in members]
    assert all(m.outer_steps >= 10 for m in members), "a member barely trained"
    assert min(m.blend_rate for m in members) >= 0.9, [m.blend_rate for m in members]
    assert figures.nat_pairs > 0
    assert sum(m.relayed_bytes for m in members if m.label == "public") > 0
    # Once settled, nobody relays through a member behind a NAT (before its witness answered, a neighbour on its
    # own network may have: that is the one place it can be reached from). Each NAT'd member is called, and nobody
    # can dial it: every call it served came through a tunnel, relayed or made direct.
    assert all(m.relayed_bytes == 0 for m in members if m.label != "public")
    assert all(m.served > 0 for m in members if m.label != "public"), [m.served for m in members]
    # A public member's tunnel to a NAT'd one becomes direct, whatever its NAT: the member connects out to it (a
    # reversal). Which pairs call each other through a tunnel is the pairing's choice: some do.
    assert figures.direct_tunnels > 0, report([figures])
    assert figures.exit_codes == (0,) * len(members), figures.exit_codes


@pytest.mark.slow  # the relay path runs in the fast tier in test_reachability.py: `make test-slow`
def test_a_member_behind_a_firewall_is_found_out_by_a_dial_back_and_called_through_its_relay(tmp_path: Path) -> None:
    """A public address of its own, but nothing comes in (a cloud VM whose security group is closed): its witness
    sees its calls come from its announced address, as for a reachable member, and only the witness's dial-back
    (rpc/info_serving.py) finds the port shut. It then holds the other member as its relay and is called through it."""
    with nat_network(2, (), rate_mbit=100, rtt_ms=20, prefix="nltfw") as net:
        firewall(net.public[1])
        swarm = LocalSwarm(tmp_path, 2, node_args("tiny", 50), [["--wait-for-peers", "1"]] * 2, network=net)
        try:
            deadline = time.monotonic() + 180
            while True:
                open_status, walled = (swarm.status(slot) or {} for slot in swarm.slots)
                served = [
                    e for e in walled.get("exchanges", []) if e["role"] == "served" and e["outcome"] == "completed"
                ]
                if walled.get("reachable") is False and served:
                    break
                assert time.monotonic() < deadline, (walled.get("reachable"), walled.get("relays"), served)
                time.sleep(1)
        finally:
            codes = swarm.stop()
        log = swarm.logs(swarm.slots[1])
    assert f"could not open a connection to {net.public[1].address}:" in log and ": a firewall)" in log
    assert open_status["reachable"] is True
    assert len(walled["relays"]) == 1  # the one reachable member
    # Nobody can dial it: every call it served came through its relay (made direct where the caller listens).
    assert walled["tunnels_served"] > 0
    assert any(h["partner"] == open_status["peer_id"] for h in walled["history"])
    assert codes == [0, 0], codes
