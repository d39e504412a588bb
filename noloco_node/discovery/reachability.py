"""Where peers should dial this node, and whether they can: the announced address and a self-check.

A node bound to all interfaces (``--grpc-host 0.0.0.0``, as in a container) cannot announce that; it announces
``--announce-host`` when given, else the address of the interface its default route leaves by (found by
"connecting" a UDP socket, which sends nothing), else its hostname's address. After its gRPC server is up the node
calls its own Info at the announced address; a node that does not answer there, or where another node answers, is
unreachable: it says what to open or forward, still pairs by calling others (outbound connections work through
NAT), and advertises ``reachable: false`` in its DHT record so that nobody calls it or picks it as a donor.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass

from noloco_node.rpc.client import ExchangeError, fetch_info
from noloco_node.rpc.transport import Transport

_WILDCARDS = {"", "0.0.0.0", "::", "[::]"}
_ROUTE_PROBE = ("192.0.2.1", 9)  # TEST-NET-1: never contacted; only the route to it is looked up


def detect_host() -> str:
    """This machine's address on its default route, else its hostname's, else loopback."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(_ROUTE_PROBE)
            address = probe.getsockname()[0]
            if address and address != "0.0.0.0":
                return address
        except OSError:
            pass
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def announce_host(grpc_host: str, announce: str | None) -> str:
    if announce:
        return announce
    return detect_host() if grpc_host in _WILDCARDS else grpc_host


@dataclass(frozen=True)
class Reachability:
    reachable: bool
    problem: str = ""

    def advice(self, address: str, bound_port: int) -> str:
        _host, _, port = address.rpartition(":")
        return (
            f"peers cannot reach this node at {address} ({self.problem}). Open TCP port {port} to the other "
            f"participants, or forward it to this machine's port {bound_port} and pass --announce-host with the "
            f"public address (and --announce-port if the public port differs); in a container, publish the port "
            f"(-p {port}:{bound_port}). Until then this node pairs only by calling others, and is never chosen as a "
            f"donor."
        )


def check_reachable(address: str, peer_id: str, transport: Transport, *, timeout: float = 5.0) -> Reachability:
    """Call this node's own Info at ``address``: reachable if this node answers there."""
    try:
        reply = fetch_info(address, timeout=timeout, transport=transport, peer_id=peer_id)
    except ExchangeError as error:
        return Reachability(False, str(error))
    except Exception as error:  # grpc.RpcError and friends: whatever stops a peer stops us too
        details = getattr(error, "details", None)
        return Reachability(False, details() if callable(details) else repr(error))
    if reply.peer_id != peer_id:
        return Reachability(False, f"another node ({reply.peer_id}) answers there")
    return Reachability(True)
