"""How a node is reached and how it reaches others: its reachability, its tunnels, and the relay it runs for others.

- **Reachability** (discovery/reachability.py): checked once the gRPC server is up, and again at each record
  refresh until a witness (a reachable peer) has said which address this node's calls come from.
- **A reachable node** dials everyone (tunnels to unreachable peers, discovery/tunnels.py) and, unless
  ``--no-relay``, relays for unreachable ones within its budget (discovery/relay.py); its record names its libp2p
  addresses so that they can hold a connection to it.
- **An unreachable node** (behind a NAT, a firewall) holds connections to a few relays and names them in its
  record; it dials reachable peers directly and unreachable ones through their relays, like anyone.

So any two members can pair, whatever their reachability: directly when the one called can be dialed, else through
one of its relays.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Callable, Sequence
from typing import Any

from noloco_node.config.node_config import NodeConfig
from noloco_node.discovery.dht import Discovery, PeerRecord
from noloco_node.discovery.reachability import check_reachable, witnesses_for
from noloco_node.discovery.relay import RelayBudget, RelayMetrics, RelayService
from noloco_node.discovery.tunnels import Tunnels
from noloco_node.rpc.metrics import ExchangeMetrics
from noloco_node.rpc.transport import Transport

log = logging.getLogger(__name__)

WITNESSES = 3  # reachable peers asked, in turn, which address this node's calls come from
WITNESS_SECONDS = 3.0
DAEMON_SECONDS = 30.0  # a request to the DHT's own libp2p daemon (local): it answers at once or is wedged


class Reach:
    def __init__(
        self,
        cfg: NodeConfig,
        discovery: Discovery,
        transport: Transport,
        metrics: ExchangeMetrics,
        *,
        established: Callable[[str], bool] = lambda _peer: False,
    ) -> None:
        self.cfg = cfg
        self.established = established  # peers with standing (pairing/standing.py): preferred as relays
        self.discovery = discovery
        self.transport = transport
        self.relay_metrics = RelayMetrics(metrics.registry)
        self.reachable = True  # until a check says otherwise
        self.witnessed = not cfg.check_reachability  # nothing to ask when the checks are off
        self.problem = ""
        self.nobody_to_ask = True  # the last check found no reachable peer to be its witness
        self.tunnels: Tunnels | None = None
        self.relay: RelayService | None = None
        self.address = ""
        self.bound_port = 0
        self._p2p_addrs: tuple[str, ...] = ()

    async def start(self, address: str, bound_port: int, dht_maddrs: Sequence[str]) -> None:
        """Once the gRPC server listens: the tunnel endpoint, the relay (if on), and the first check."""
        self.address, self.bound_port = address, bound_port
        # Each is a request to the DHT's local libp2p daemon (a socket on this machine): answered in milliseconds,
        # or the daemon is wedged and the start fails with a timeout that says so.
        p2p = await asyncio.wait_for(self.discovery.p2p(), DAEMON_SECONDS)
        self.tunnels = Tunnels(p2p, grpc_host=self.cfg.grpc_host, grpc_port=bound_port, transport=self.transport)
        await asyncio.wait_for(self.tunnels.start(), DAEMON_SECONDS)
        if self.cfg.relay:
            budget = RelayBudget(slots=self.cfg.relay_slots, bytes_per_hour=int(self.cfg.relay_gb_per_hour * 1e9))
            self.relay = RelayService(p2p, budget, self.relay_metrics)
            await asyncio.wait_for(self.relay.start(), DAEMON_SECONDS)
            self._p2p_addrs = tuple(dht_maddrs)
        await self.check()

    async def close(self) -> None:
        if self.tunnels is not None:
            await self.tunnels.close()

    async def check(self) -> None:
        """The reachability checks (discovery/reachability.py), with up to WITNESSES reachable peers to ask."""
        if not self.cfg.check_reachability:
            return
        try:
            peers = await self.discovery.live_peers()
        except Exception:  # no DHT answer yet: the self-check alone, and a witness is asked at the next refresh
            peers = []
        candidates = witnesses_for(self.address, [(p.address, p.peer_id) for p in peers if p.reachable and p.address])
        witnesses = random.sample(candidates, min(WITNESSES, len(candidates)))
        self.nobody_to_ask = not witnesses
        check = await asyncio.wait_for(
            asyncio.to_thread(
                check_reachable,
                self.address,
                self.discovery.peer_id,
                self.transport,
                witnesses=witnesses,
                # An Info call is a few round trips; a witness that takes longer is skipped (a peer claiming to be
                # reachable at an address that silently drops what is sent to it would hold the start 5 s each).
                timeout=WITNESS_SECONDS,
            ),
            timeout=10.0 + 10.0 * len(witnesses),  # each call has its own 5 s deadline; this bounds the hand-off too
        )
        changed = check.reachable != self.reachable
        self.reachable, self.problem, self.witnessed = check.reachable, check.problem, check.witnessed
        if self.tunnels is not None:
            self.tunnels.reachable = check.reachable
        if self.relay is not None:
            if self.relay.offered and not self.offers_relay:
                self.relay.withdraw()
            self.relay.offered = self.offers_relay
        if not check.reachable and (changed or check.witnessed):
            log.warning("%s", check.advice(self.address, self.bound_port))

    async def refresh(self) -> None:
        """Before each record refresh: ask a witness if none has answered yet; an unreachable node renews its
        relays."""
        if not self.witnessed:
            await self.check()
        if not self.reachable and self.tunnels is not None:
            await self.tunnels.hold_relays(await self.discovery.live_peers(), established=self.established)

    # ------------------------------------------------------------------------------------------ for callers

    def learn(self, peers: Sequence[PeerRecord]) -> None:
        if self.tunnels is not None:
            self.tunnels.learn(peers)

    async def prepare(self, peer: PeerRecord) -> str | None:
        """Where to dial ``peer`` now: its own address, or for an unreachable one a tunnel through its relays; None
        when there is no way to it."""
        if peer.reachable:
            return peer.address
        return None if self.tunnels is None else await self.tunnels.prepare(peer)

    @property
    def offers_relay(self) -> bool:
        """Offered as a relay once a witness has confirmed this node reachable, or while no reachable peer exists to
        ask (the only reachable member of a swarm). A member behind a NAT whose first check found nobody to ask
        looks reachable, and its neighbours on the same network could take it for a relay until a witness answers:
        then it withdraws (discovery/relay.py)."""
        return self.cfg.relay and self.reachable and (self.witnessed or self.nobody_to_ask)

    def record_fields(self) -> dict[str, Any]:
        """What this node's DHT record says about reaching it."""
        if self.tunnels is None:
            return {"reachable": self.reachable}
        return {
            "reachable": self.reachable,
            "p2p_id": self.tunnels.p2p_id,
            "p2p_addrs": self._p2p_addrs if self.offers_relay else (),
            "relays": () if self.reachable else tuple(self.tunnels.relays),
        }

    def status(self) -> dict[str, Any]:
        return {
            "relayed_bytes": self.relay_metrics.carried,
            "relays": [] if self.tunnels is None else list(self.tunnels.relays),
            "tunnels_served": 0 if self.tunnels is None else self.tunnels.tunnelled_calls,
            "tunnels_opened": 0 if self.tunnels is None else self.tunnels.tunnels_opened,
            "tunnels_punched": 0 if self.tunnels is None else self.tunnels.tunnels_punched,
        }
