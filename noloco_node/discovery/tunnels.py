"""Both ends of a tunnel to a member that nobody can dial: its gRPC service reached through a relay, over libp2p.

A member behind a NAT or a firewall (its reachability check failed, reachability.py) keeps libp2p connections open
to a few reachable members that relay (relay.py) and names them in its DHT record (``relays``). A caller that wants
to reach it opens a libp2p stream to one of them asking for it; the relay opens a stream to the member over the
connection the member made (outbound, so its NAT lets it through) and splices the two.

- At the member, each tunnel stream is joined to its own gRPC server on this machine (:meth:`Tunnels._serve`).
- At the caller, gRPC dials a local endpoint (127.0.0.1, one per member reached this way, kept by its peer id: two
  members behind different NATs may well announce the same private address) whose every connection becomes a
  relayed stream (:meth:`Tunnels.prepare`). gRPC, caller proofs, admission and every payload check therefore run end
  to end, unchanged, exactly as on a direct connection; both payloads are sealed by their senders
  (security/payload_seal.py), so the relay can neither alter nor replace them undetected, and with ``--tls`` it
  sees only ciphertext.

Why not libp2p's own circuit relay: the relay of hivemind's p2pd limits each relayed connection to 128 KiB and two
minutes (limited relays are meant for hole-punch coordination), and a model's exchange moves megabytes to
gigabytes. Why libp2p at all and not TCP to the relay's gRPC port: the member's outbound libp2p connection is what
the relay reaches back through, and p2pd multiplexes and encrypts every hop on it.

The member's server learns the caller's address from the relay (what the relay saw), so that admission per address
(rpc/admission.py) still tells machines apart: :meth:`Tunnels.origin` maps the tunnel's local port to it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import socket
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from noloco_node.discovery.dht import PeerRecord
from noloco_node.discovery.hole_punch import answer_offer, bound_socket, punchable, take_offer
from noloco_node.discovery.relay import (
    HEADER_SECONDS,
    RELAY_PROTOCOL,
    TUNNEL_PROTOCOL,
    HeaderError,
    host_of,
    read_header,
    splice,
    write_header,
)
from noloco_node.rpc.transport import Transport

log = logging.getLogger(__name__)

RELAYS_HELD = 2  # relays an unreachable member keeps a connection to: one can leave without cutting it off
MAX_ENDPOINTS = 64  # local endpoints kept for unreachable peers (as many as the transport's channel pool)
MAX_PUNCHING = 4  # hole punches this node answers at once
NO_PUNCH_SECONDS = 600.0  # after a failed hole punch to a member (its NAT maps each destination anew): relay only
_WILDCARDS = {"", "0.0.0.0", "::", "[::]"}


@dataclass
class _Endpoint:
    """A local endpoint for one unreachable peer: its listening server, its address, where the peer is on libp2p
    and the relays its latest record names (renewed at each call: a member replaces a relay that left)."""

    server: asyncio.Server
    address: str
    p2p_id: str
    relays: list[str] = field(default_factory=list)


class Tunnels:
    """This node's libp2p side of relayed gRPC: serves tunnels into its server, opens tunnels to unreachable peers."""

    def __init__(self, p2p: Any, *, grpc_host: str, grpc_port: int, transport: Transport) -> None:
        self.p2p = p2p  # a hivemind P2P replica of the DHT's daemon (Discovery.p2p)
        self.p2p_id = p2p.peer_id.to_base58()
        self.local_host = "127.0.0.1" if grpc_host in _WILDCARDS else grpc_host
        self.grpc_port = grpc_port
        self.transport = transport
        self.relays: list[str] = []  # the relays this node holds a connection to (when it is unreachable)
        self.tunnelled_calls = 0  # tunnels served into this node's server
        self.tunnels_opened = 0  # tunnels this node opened to unreachable peers
        self.tunnels_punched = 0  # of the tunnels opened or served, those that became direct (hole_punch.py)
        self.reachable = False  # whether this node can be dialed (node/reach.py keeps it): how it hole-punches
        self._punching = 0  # hole punches being answered now
        self._no_punch: dict[str, float] = {}  # peer's libp2p id -> until when a hole punch to it is not tried
        self._origins: dict[int, str] = {}  # local source port of a served tunnel -> the caller's address
        self._endpoints: dict[str, _Endpoint] = {}  # peer id -> its local endpoint, least recently used first
        self._relay_addrs: dict[str, list[str]] = {}  # relay libp2p id -> its multiaddrs (from DHT records)

    async def start(self) -> None:
        await self.p2p.add_binary_stream_handler(TUNNEL_PROTOCOL, self._serve)

    async def close(self) -> None:
        for endpoint in self._endpoints.values():
            endpoint.server.close()
        self._endpoints.clear()

    # ------------------------------------------------------------------------------------------ the member's end

    def origin(self, peer: str) -> str | None:
        """The caller's address for a gRPC ``context.peer()`` that is one of this node's served tunnels, else None."""
        host, _, port = peer.rpartition(":")
        if not port.isdigit() or not host.endswith(self.local_host):
            return None
        return self._origins.get(int(port))

    async def _serve(self, info: Any, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            header = await read_header(reader)
        except HeaderError:
            writer.close()
            return
        # A relay this node holds says whom it forwards; anyone else opening a tunnel is taken for where its own
        # connection comes from (a stranger cannot dodge admission per address by claiming an origin).
        held = str(info.peer_id) in self.relays
        claimed = str(header.get("origin", ""))[:64]
        origin = (claimed if held else "") or host_of(info) or f"p2p:{info.peer_id}"
        try:
            local = await asyncio.wait_for(asyncio.open_connection(self.local_host, self.grpc_port), HEADER_SECONDS)
        except (OSError, asyncio.TimeoutError):
            await write_header(writer, {"ok": False, "why": "server_down"})
            writer.close()
            return
        port = local[1].get_extra_info("sockname")[1]
        self._origins[port] = origin
        self.tunnelled_calls += 1
        try:
            # A hole punch only for a relay this node holds: anyone else could make it connect out to any address.
            direct = await self._punch_for_caller(header.get("punch") if held else None, origin, reader, writer)
            if direct is not None:
                with contextlib.suppress(Exception):
                    writer.close()  # the relay carries nothing more
                self.tunnels_punched += 1
                await splice(await asyncio.open_connection(sock=direct), local)
            else:
                await splice((reader, writer), local)
        except (ConnectionError, asyncio.TimeoutError, HeaderError, OSError):
            with contextlib.suppress(Exception):
                local[1].close()
                writer.close()
        finally:
            self._origins.pop(port, None)

    async def _punch_for_caller(
        self, port: Any, caller_host: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> socket.socket | None:
        """Answer a tunnel, with a hole punch when the caller offered one (hole_punch.answer_offer), a few at a
        time: each makes this node connect out to where its relay says the caller is."""
        sock = None
        if isinstance(port, int) and 0 < port < 65536 and punchable(caller_host) and self._punching < MAX_PUNCHING:
            with contextlib.suppress(OSError):
                sock = bound_socket()
        if sock is None:
            await write_header(writer, {"ok": True})
            return None
        self._punching += 1
        try:
            return await answer_offer(sock, port, caller_host, (reader, writer))
        finally:
            self._punching -= 1

    # ------------------------------------------------------------------------------------------ the caller's end

    def learn(self, peers: Sequence[PeerRecord]) -> None:
        """Where the relays among ``peers`` listen (their records' libp2p addresses)."""
        for peer in peers:
            if peer.reachable and peer.p2p_id and peer.p2p_addrs:
                self._relay_addrs[peer.p2p_id] = list(peer.p2p_addrs)
        if len(self._relay_addrs) > 4 * MAX_ENDPOINTS:
            live = {p.p2p_id for p in peers}
            self._relay_addrs = {k: v for k, v in self._relay_addrs.items() if k in live}

    async def prepare(self, peer: PeerRecord) -> str | None:
        """The gRPC address to dial ``peer`` at: its own for a reachable peer; for an unreachable one with relays,
        its local endpoint (made on first use); None when there is no way to it."""
        if peer.reachable:
            return peer.address
        if not peer.relays or not peer.p2p_id:
            return None
        endpoint = self._endpoints.pop(peer.peer_id, None)
        if endpoint is not None and endpoint.p2p_id != peer.p2p_id:  # the member restarted its daemon
            self._close(endpoint)
            endpoint = None
        if endpoint is None:
            while len(self._endpoints) >= MAX_ENDPOINTS:
                self._close(self._endpoints.pop(next(iter(self._endpoints))))
            holder: list[_Endpoint] = []
            server = await asyncio.wait_for(
                asyncio.start_server(lambda r, w: self._open(holder[0], r, w), host="127.0.0.1", port=0),
                HEADER_SECONDS,
            )
            address = f"127.0.0.1:{server.sockets[0].getsockname()[1]}"
            endpoint = _Endpoint(server, address, peer.p2p_id)
            holder.append(endpoint)
        endpoint.relays = list(peer.relays)
        self._endpoints[peer.peer_id] = endpoint  # most recently used last
        return endpoint.address

    def _close(self, endpoint: _Endpoint) -> None:
        endpoint.server.close()
        self.transport.forget(endpoint.address)  # its port may go to another peer's endpoint

    async def _open(self, endpoint: _Endpoint, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """One gRPC connection to the endpoint's peer: through the first of its relays that takes it."""
        from hivemind.p2p import PeerID  # the DHT's library; imported where used (the launcher never needs it)

        target, relays = endpoint.p2p_id, list(endpoint.relays)
        random.shuffle(relays)
        if self.p2p_id in relays:  # this node is one of the target's relays: the target holds a connection to it
            relays = [self.p2p_id] + [r for r in relays if r != self.p2p_id]
        for relay in relays:
            relay_writer: asyncio.StreamWriter | None = None
            punch = self._punch_socket(target)
            offer = {} if punch is None else {"punch": punch.getsockname()[1]}
            try:
                if relay == self.p2p_id:
                    info, relay_reader, relay_writer = await asyncio.wait_for(
                        self.p2p.call_binary_stream_handler(PeerID.from_base58(target), TUNNEL_PROTOCOL),
                        HEADER_SECONDS,
                    )
                    await write_header(relay_writer, {"origin": "", **offer})  # the member takes this connection's own
                    member_host = host_of(info)
                else:
                    relay_id = PeerID.from_base58(relay)
                    await self._connect(relay, relay_id)
                    _info, relay_reader, relay_writer = await asyncio.wait_for(
                        self.p2p.call_binary_stream_handler(relay_id, RELAY_PROTOCOL), HEADER_SECONDS
                    )
                    await write_header(relay_writer, {"to": target, **offer})
                    member_host = ""
                answer = await read_header(relay_reader)
                if not answer.get("ok"):
                    raise HeaderError(f"refused: {answer.get('why')}")
                punch, offered = None, punch  # handed over: _punch_to_member closes it
                member_host = member_host or str(answer.get("host", ""))
                if member_host and member_host == answer.get("caller_host"):
                    # Behind the same NAT as the member: few routers loop a connection to their own public address
                    # back in, so no hole punch is tried.
                    if offered is not None:
                        offered.close()
                    offered = None
                direct = await self._punch_to_member(
                    offered, member_host, answer.get("punch"), target, (relay_reader, relay_writer)
                )
            except Exception as error:  # this relay is gone, slow or refused: the next one
                log.debug("relay %s did not open a tunnel to %s: %r", relay, target, error)
                if relay_writer is not None:
                    relay_writer.close()
                continue
            finally:
                if punch is not None:
                    punch.close()
            self.tunnels_opened += 1
            with contextlib.suppress(ConnectionError, asyncio.TimeoutError, OSError):
                if direct is not None:
                    relay_writer.close()  # the relay carries nothing more
                    self.tunnels_punched += 1
                    await splice((reader, writer), await asyncio.open_connection(sock=direct))
                else:
                    await splice((reader, writer), (relay_reader, relay_writer))
            return
        writer.close()  # gRPC sees the connection close: UNAVAILABLE, and the caller tries another peer

    def _punch_socket(self, target: str) -> socket.socket | None:
        """A bound socket to offer the member for a hole punch (listening when this node can be dialed: the member
        connects to it), unless one to it failed lately (each attempt delays the connection by PUNCH_SECONDS)."""
        now = time.monotonic()
        if self._no_punch.get(target, 0.0) > now:
            return None
        if len(self._no_punch) > 4 * MAX_ENDPOINTS:
            self._no_punch = {peer: until for peer, until in self._no_punch.items() if until > now}
        try:
            return bound_socket(listen=self.reachable)
        except OSError:
            return None

    async def _punch_to_member(
        self,
        punch: socket.socket | None,
        member_host: str,
        member_port: Any,
        target: str,
        stream: tuple[asyncio.StreamReader, asyncio.StreamWriter],
    ) -> socket.socket | None:
        """The caller's side of a hole punch (hole_punch.take_offer); a member it fails for is not tried again for
        NO_PUNCH_SECONDS. ``punch`` is consumed."""
        tried = isinstance(member_port, int) and punch is not None and punchable(member_host)
        direct = await take_offer(punch, member_host, member_port, stream, listening=self.reachable)
        log.debug("hole punch to %s at %s:%s: %s", target, member_host, member_port, direct or "relayed")
        if tried and direct is None:
            self._no_punch[target] = time.monotonic() + NO_PUNCH_SECONDS
        return direct

    async def _connect(self, relay: str, relay_id: Any) -> None:
        """Dial a relay whose addresses a DHT record gave (p2pd may not know it yet)."""
        from hivemind.utils.multiaddr import Multiaddr

        addrs = self._relay_addrs.get(relay)
        if addrs:
            # hivemind's P2P has no public connect; its DHT uses the client's, as here. The daemon wants addresses
            # without their /p2p/<id> tail (with it, it cannot decode them).
            bare = [Multiaddr(a.split("/p2p/")[0]) for a in addrs]
            await asyncio.wait_for(self.p2p._client.connect(relay_id, bare), HEADER_SECONDS)

    # ------------------------------------------------------------------------------------------ an unreachable member

    async def hold_relays(
        self, peers: Sequence[PeerRecord], *, established: Callable[[str], bool] = lambda _peer: False
    ) -> list[str]:
        """Keep connections to up to RELAYS_HELD reachable, relaying members; the relays to name in this node's
        record. Whoever relays can cut this node off (never alter what it forwards: security/payload_seal.py), and
        free keys can offer themselves as relays by the hundred, so the choice is not left to chance alone: peers
        this node has standing with (``established``, pairing/standing.py) first, one relay per network group
        (noloco_node/addresses.py), those already held before new ones of the same rank."""
        from hivemind.p2p import PeerID

        self.learn(peers)
        relaying = {p.p2p_id: p for p in peers if p.reachable and p.p2p_id and p.p2p_addrs}
        shuffled = list(relaying.values())
        random.shuffle(shuffled)
        held = set(self.relays)
        shuffled.sort(key=lambda p: (not established(p.peer_id), p.p2p_id not in held))
        first_of_host: dict[str, PeerRecord] = {}
        for peer in shuffled:
            first_of_host.setdefault(peer.network_group, peer)
        ranked = list(first_of_host.values()) + [p for p in shuffled if first_of_host[p.network_group] is not p]
        kept: list[str] = []
        for peer in ranked:  # dialing a connected peer is a no-op, a lost one redials
            if len(kept) >= RELAYS_HELD:
                break
            try:
                await self._connect(peer.p2p_id, PeerID.from_base58(peer.p2p_id))
            except Exception as error:
                log.debug("could not hold relay %s: %r", peer.p2p_id, error)
                continue
            kept.append(peer.p2p_id)
        if kept != self.relays:
            log.info("unreachable: reached through relays %s", ", ".join(kept) or "(none yet)")
        self.relays = kept
        return kept
