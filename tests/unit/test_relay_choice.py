"""discovery/tunnels.py ``hold_relays``: which relays a member behind a NAT holds. Free keys can offer themselves as
relays by the hundred, so peers with standing come first, one relay per network group, and a relay that cannot be dialed
is passed over. The libp2p daemon is replaced by a recorder of dials (what is tested is the choice; the relaying
itself runs through real daemons in test_reachability.py and test_nat.py)."""

from __future__ import annotations

import asyncio
import hashlib
from types import SimpleNamespace
from typing import Any

from hivemind.p2p import PeerID

from noloco_node.discovery.dht import PeerRecord
from noloco_node.discovery.tunnels import RELAYS_HELD, Tunnels
from noloco_node.rpc.transport import Transport


def libp2p_id(name: str) -> str:
    return PeerID(b"\x12\x20" + hashlib.sha256(name.encode()).digest()).to_base58()  # a sha256 multihash


class Daemon:
    """Records the dials; refuses those to ``unreachable``."""

    def __init__(self, unreachable: set[str] | None = None) -> None:
        self.peer_id = SimpleNamespace(to_base58=lambda: libp2p_id("self"))
        self.dialed: list[str] = []
        self.unreachable = unreachable or set()
        self._client = self

    async def connect(self, peer_id: Any, addrs: list[Any]) -> None:
        self.dialed.append(peer_id.to_base58())
        if peer_id.to_base58() in self.unreachable:
            raise ConnectionError("no route")


def relay(name: str, host: str, *, reachable: bool = True) -> PeerRecord:
    return PeerRecord(
        peer_id=f"nl{name}",
        address=f"{host}:7000",
        run_fingerprint="run",
        reachable=reachable,
        p2p_id=libp2p_id(name),
        p2p_addrs=(f"/ip4/{host}/tcp/4000",),
    )


def hold(
    peers: list[PeerRecord], daemon: Daemon, established: set[str] | None = None, held: list[str] | None = None
) -> list[str]:
    tunnels = Tunnels(daemon, grpc_host="127.0.0.1", grpc_port=1, transport=Transport())
    tunnels.relays = list(held or [])
    return asyncio.run(tunnels.hold_relays(peers, established=lambda peer: peer in (established or set())))


def test_peers_with_standing_are_held_before_strangers_whatever_their_number() -> None:
    strangers = [relay(f"free{i}", f"11.0.0.{i}") for i in range(50)]
    friends = [relay("a", "11.1.0.1"), relay("b", "11.5.0.2")]
    for _ in range(5):  # the order of the records does not matter
        kept = hold(strangers + friends, Daemon(), established={"nla", "nlb"})
        assert sorted(kept) == sorted(p.p2p_id for p in friends)


def test_one_relay_per_host_while_other_hosts_offer() -> None:
    # One network group (noloco_node/addresses.py): one address, and the rest of its /24.
    same_host = [relay(f"k{i}", f"11.2.0.{1 + i % 2}") for i in range(10)]
    other = relay("other", "11.7.0.2")
    for _ in range(5):
        kept = hold([*same_host, other], Daemon())
        assert len(kept) == RELAYS_HELD and other.p2p_id in kept
    assert len(hold(same_host, Daemon())) == RELAYS_HELD  # one host is all there is: two of its keys then


def test_unreachable_or_non_relaying_peers_are_passed_over() -> None:
    down, up = relay("down", "11.3.0.1"), relay("up", "11.3.0.2")
    behind_nat = relay("nat", "192.168.0.2", reachable=False)
    no_relay = PeerRecord(peer_id="nlquiet", address="11.3.0.3:7000", run_fingerprint="run", p2p_id=libp2p_id("q"))
    daemon = Daemon(unreachable={down.p2p_id})
    kept = hold([down, up, behind_nat, no_relay], daemon, established={"nldown"})
    assert kept == [up.p2p_id] and down.p2p_id in daemon.dialed


def test_relays_held_stay_held_among_equals() -> None:
    peers = [relay(f"r{i}", f"11.4.0.{i}") for i in range(6)]
    held = [peers[4].p2p_id, peers[2].p2p_id]
    for _ in range(5):
        assert sorted(hold(peers, Daemon(), held=held)) == sorted(held)
