"""noloco_node/addresses.py: one spelling per address in a record, and the network group that is one machine."""

from __future__ import annotations

import ipaddress
import random
from dataclasses import replace

import pytest

from noloco_node.addresses import (
    canonical_address,
    host_of_address,
    ip_literal_problem,
    network_group,
    record_address,
)
from noloco_node.config.node_config import NodeConfig
from noloco_node.discovery.dht import RELAYED_GROUP, PeerRecord
from noloco_node.node.catch_up import credible_front
from noloco_node.pairing.standing import Standing
from noloco_node.rpc.admission import remote_host


def record(address: str, peer_id: str = "p", outer_step: int = 0) -> PeerRecord | None:
    return PeerRecord.from_value(peer_id, {"address": address, "run_fingerprint": "run", "outer_step": outer_step})


def test_a_record_names_one_ip_in_one_spelling() -> None:
    for good in ("127.0.0.1:5000", "203.0.113.7:1", "[2001:db8::1]:7000", "[::1]:65535"):
        assert canonical_address(good) is None, good
        assert record(good) is not None
    # Every spelling that dials the same socket as 127.0.0.1:5000 (or 2001:db8::1), and names.
    for other in (
        "localhost:5000",
        "node.example.com:5000",
        "127.000.000.001:5000",
        "127.0.0.01:5000",
        "[::ffff:127.0.0.1]:5000",
        "[::ffff:7f00:1]:5000",
        "[2001:0db8::1]:7000",
        "[2001:DB8::1]:7000",
        "2001:db8::1:7000",  # IPv6 without brackets
        "[127.0.0.1]:5000",
        "127.0.0.1:05000",
        "127.0.0.1:0",
        "127.0.0.1:",
        "127.0.0.1.:5000",
    ):
        assert canonical_address(other) is not None, other
        assert record(other) is None, other


def test_network_groups() -> None:
    assert network_group("8.8.8.8") == network_group("8.8.8.200") == "8.8.8.0/24"
    assert network_group("8.8.9.8") != network_group("8.8.8.8")
    # A /64, a /56 and the rest of a /48 are one group; the next /48 is another.
    one_site = ["2606:4700:10::1", "2606:4700:10:ffff::2", "2606:4700:10:ab00::3"]
    assert {network_group(a) for a in one_site} == {"2606:4700:10::/48"}
    assert network_group("2606:4700:11::1") != network_group("2606:4700:10::1")
    # Loopback, private and link-local addresses are each their own group (a LAN's machines, a test's nodes).
    assert network_group("127.0.0.1") != network_group("127.0.0.2")
    assert network_group("192.168.1.4") != network_group("192.168.1.5")
    assert network_group("fe80::1") == "fe80::1"
    # An IPv4 caller of a dual-stack server is its IPv4 address, in the group of that address.
    assert remote_host("ipv6:[::ffff:8.8.8.8]:5555") == "8.8.8.8"
    assert network_group("::ffff:8.8.8.8") == "8.8.8.0/24"
    assert remote_host("ipv6:[2606:4700:10::1]:5555") == "2606:4700:10::1"
    assert network_group("p2p:QmRelayed") == "p2p:QmRelayed"


def test_an_announced_host_must_be_an_ip_in_its_one_spelling() -> None:
    assert ip_literal_problem("203.0.113.7") is None and ip_literal_problem("2001:db8::1") is None
    for bad in ("node.example.com", "localhost", "010.0.0.1", "::ffff:1.2.3.4"):
        assert ip_literal_problem(bad) is not None, bad
    assert record_address("2001:db8::1", 7000) == "[2001:db8::1]:7000"
    assert record_address("203.0.113.7", 7000) == "203.0.113.7:7000"
    with pytest.raises(ValueError, match="announce_host"):
        NodeConfig(announce_host="node.example.com")
    with pytest.raises(ValueError, match="grpc_host"):
        NodeConfig(grpc_host="localhost")
    NodeConfig(grpc_host="0.0.0.0")  # a wildcard announces the detected IP


def test_many_keys_in_one_network_group_weigh_as_one_machine() -> None:
    """The partner order, the stranger choice and the front all count groups: 40 established keys spread over
    one /24 are one host beside two honest ones."""
    clock = [0.0]
    standing = Standing(standing_seconds=10, stranger_share=0.0, clock=lambda: clock[0], rng=random.Random(1))
    attacker = [PeerRecord(f"sybil{i}", f"8.8.8.{i + 1}:7000", "run", outer_step=1) for i in range(40)]
    honest = [
        PeerRecord("honest-a", "9.9.9.9:7000", "run", outer_step=1),
        PeerRecord("honest-b", "1.1.1.1:7000", "run", outer_step=1),
    ]
    everyone = attacker + honest
    standing.observe(everyone, 1, 5)
    clock[0] = 11.0
    for peer in [attacker[0], *honest]:  # a blend with each group (its other keys are partners by record age)
        standing.blended(peer.peer_id, 1)
    later = [replace(p, outer_step=8) for p in everyone]  # 7 steps later, with G = 3: no group's share is spent
    standing.observe(later, 8, 5)
    firsts = [standing.order(later, {})[0].peer_id for _ in range(300)]
    share = sum(f.startswith("sybil") for f in firsts) / len(firsts)
    assert 0.2 < share < 0.45, share  # one group of three, not 40 keys of 42
    # The front: 40 keys of one /24 claiming step 10**6 are one claim beside two honest hosts at step 5.
    honest_addresses = [("a", "9.9.9.9:7000"), ("b", "1.1.1.1:7000")]
    claims = [PeerRecord(f"liar{i}", f"8.8.8.{i + 1}:7000", "run", outer_step=10**6) for i in range(40)]
    honest_claims = [PeerRecord(name, address, "run", outer_step=5) for name, address in honest_addresses]
    assert credible_front([*claims, *honest_claims]) == 5


def test_members_reached_through_relays_weigh_as_one_group_whatever_address_they_write() -> None:
    """An unreachable member is dialled through a relay, never at the address its record names: 40 such records
    naming 40 public /24s are one claim on the front, beside two honest hosts."""
    relayed = [
        PeerRecord(f"nat{i}", f"{i + 20}.1.1.1:7000", "run", outer_step=10**6, reachable=False, relays=("QmRelay",))
        for i in range(40)
    ]
    assert {r.network_group for r in relayed} == {RELAYED_GROUP}
    honest = [
        PeerRecord(name, address, "run", outer_step=5)
        for name, address in (("a", "9.9.9.9:7000"), ("b", "1.1.1.1:7000"))
    ]
    assert credible_front([*relayed, *honest]) == 5
    # With the address its record names, each would have been a group of its own, and the front theirs.
    assert len({network_group(host_of_address(r.address)) for r in relayed}) == 40


def test_the_patient_sybils_spellings_are_refused_and_its_ipv6_networks_are_one_group() -> None:
    """bench outsider's Sybil (noloco_bench/echo_flood.py) writes every other record in another spelling of its IP
    and, on a network of namespaces, speaks from eight /64s of one /48 (shaped_network.py): every spelling is
    refused as a record's address, and its IPv6 addresses weigh as one machine."""
    from noloco_bench.echo_flood import other_spelling
    from noloco_bench.shaped_network import ShapedNetwork

    for address in ("100.81.3.5:4000", "127.0.0.1:4000", "[2a0d:81:3:1::2]:4000"):
        assert canonical_address(address) is None
        spellings = {other_spelling(address, number) for number in range(3)}
        assert len(spellings) >= 2, spellings
        for spelling in spellings:
            assert canonical_address(spelling) is not None, spelling
    net = ShapedNetwork(4, 1000, 0, 0, "nlx", subnet="100.81", subnet6="2a0d:81")
    sybil6 = [str(ipaddress.ip_address(f"2a0d:81:3:{k:x}::2")) for k in range(1, 9)]
    assert {network_group(address) for address in sybil6} == {"2a0d:81:3::/48"}
    assert network_group(net.address6(3)) == "2a0d:81:3::/48"
    assert len({network_group(net.address6(host)) for host in range(4)}) == 4  # a /48 per host, as a site's
