"""Serving ``Info``: what a node says of itself (its DHT record's facts, its recent curve), and what it sees of its
caller: where the call came from (trailing metadata ``noloco-seen-as``) and, when asked, whether it can open a TCP
connection back to the caller's own ports (the dial-back).

A node cannot tell from inside whether others can dial it: it always reaches its own addresses, and a peer's view
of where its calls come from (Info's ``noloco-seen-as``) tells a NAT apart, not a firewall that drops what comes in
or a port forward that was never set up. So a caller names up to two of its ports (its gRPC port, its DHT port) in
``InfoRequest.dial_back`` and the peer tries to connect to each, at the caller's own address as the peer sees it,
and answers in ``InfoReply.dial_back`` (discovery/reachability.py and node/doctor.py ask). Info has slots of its own
(call_gate.py, admission.py), so that a flood of exchanges or downloads never makes a node unanswerable.

Only the caller's own address is ever dialed: a peer cannot be made to connect anywhere else, and what it learns
for the caller is what the caller could learn by asking anyone to dial it. The connection is opened and closed at
once; nothing is sent on it.
"""

from __future__ import annotations

import socket
from collections.abc import Sequence

import grpc

from noloco_node.rpc.admission import INFO
from noloco_node.rpc.call_gate import CallGate, parse
from noloco_node.rpc.contracts import INFO_METHOD, SEEN_AS_HEADER, PeerNode
from noloco_node.wire import peer_pb2 as pb

MAX_PORTS = 2  # gRPC and DHT: more is refused by trying only the first two
DIAL_BACK_SECONDS = 2.0  # per port: an open port answers a SYN in a round trip; a firewall's drop answers never


def dial_back(host: str, ports: Sequence[int], *, timeout: float = DIAL_BACK_SECONDS) -> list[pb.DialBack]:
    """Try a TCP connection to each of the first MAX_PORTS ``ports`` at ``host``: whether it opened, and why not."""
    results = []
    for port in list(ports)[:MAX_PORTS]:
        if not 0 < port < 65536:
            results.append(pb.DialBack(port=port, connected=False, error="not a port"))
            continue
        try:
            socket.create_connection((host.strip("[]"), port), timeout=timeout).close()
        except OSError as error:
            why = "timed out (a firewall drops it)" if isinstance(error, TimeoutError) else error.strerror
            results.append(pb.DialBack(port=port, connected=False, error=str(why or error)[:200]))
            continue
        results.append(pb.DialBack(port=port, connected=True))
    return results


class InfoServing:
    """The ``Info`` handler of a node's service."""

    def __init__(self, node: PeerNode, gate: CallGate) -> None:
        self.node = node
        self.gate = gate

    def Info(self, raw: bytes, context: grpc.ServicerContext) -> pb.InfoReply:  # noqa: N802
        # Info tells what the node's DHT record already says publicly: a caller may prove who it is, or not.
        caller = self.gate.caller(INFO_METHOD, context, required=False)
        ticket = self.gate.admit(INFO, context, caller)
        try:
            request = parse(pb.InfoRequest, raw, context)
            # Where the caller's connection came from, as this node sees it: a caller behind a NAT learns that it
            # announces an address nobody else can dial (discovery/reachability.py).
            seen = self.gate.address_of(context)
            context.set_trailing_metadata(((SEEN_AS_HEADER, seen),))  # initial: the run's proof
            reply = self.node.info()
            if request.dial_back:
                # To the caller's own address only: a tunnelled caller's address is its relay's word, and a relay
                # must not make this node connect where it likes.
                if self.gate.origin(context.peer()) is not None:
                    ports = request.dial_back[:MAX_PORTS]
                    reply.dial_back.extend(pb.DialBack(port=p, error="called through a relay") for p in ports)
                else:
                    reply.dial_back.extend(dial_back(seen, request.dial_back))
            return reply
        finally:
            self.gate.admission.leave(ticket)
