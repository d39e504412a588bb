"""Where peers should dial this node, and whether they can: the announced address and two checks.

A node bound to all interfaces (``--grpc-host 0.0.0.0``, as in a container) cannot announce that; it announces
``--announce-host`` when given, else the address of the interface its default route leaves by (found by
"connecting" a UDP socket, which sends nothing), else its hostname's address.

After its gRPC server is up the node calls its own Info at the announced address (a node that does not answer
there, or where another node answers, is unreachable), and asks a reachable peer, its witness, which address this
node's call came from (Info's ``noloco-seen-as`` header) and to dial its port back (rpc/info_serving.py): a node
behind a NAT announces an address of its own network, and the witness sees the NAT's public one; a node behind a
firewall that drops what comes in (a cloud VM's security group, a port forward never set up) has the right address,
and the witness cannot connect to it. Calling itself cannot tell, since a machine always reaches its own
addresses. An unreachable node says what to open or forward, advertises ``reachable: false`` in its DHT record,
is never chosen as a donor, and is reached through relays (tunnels.py).
"""

from __future__ import annotations

import socket
from collections.abc import Sequence
from dataclasses import dataclass

import grpc

from noloco_node.addresses import host_of_address
from noloco_node.rpc.client import ExchangeError, fetch_info
from noloco_node.rpc.contracts import INFO_METHOD, SEEN_AS_HEADER
from noloco_node.rpc.info_serving import DIAL_BACK_SECONDS
from noloco_node.rpc.transport import Transport
from noloco_node.wire import peer_pb2 as pb

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

    witnessed: bool = False  # a peer has said where this node's calls come from

    def advice(self, address: str, bound_port: int) -> str:
        _host, _, port = address.rpartition(":")
        return (
            f"peers cannot reach this node at {address} ({self.problem}). It is reached through relays instead, "
            f"which costs them bandwidth: open TCP port {port} to the other participants, or forward it to this "
            f"machine's port {bound_port} and pass --announce-host with the public address (and --announce-port if "
            f"the public port differs); in a container, publish the port (-p {port}:{bound_port}). Until then it is "
            f"never chosen as a donor."
        )


@dataclass(frozen=True)
class WitnessView:
    """What a peer (a witness) says of this node: the address its calls come from ('' if it does not say), and for
    each port it was asked to dial back (rpc/info_serving.py) '' if it connected, else why not."""

    seen: str
    dialed: dict[int, str]


def ask_witness(
    address: str, peer_id: str, transport: Transport, *, dial_back: Sequence[int] = (), timeout: float = 5.0
) -> WitnessView:
    """Info of the node ``peer_id`` at ``address``: where it sees this node's call come from, and whether it could
    open a connection back to each of ``dial_back`` (ports at that same address)."""
    metadata, _nonce = transport.sign(INFO_METHOD, peer_id)  # read for its headers and dial-back only: no proof asked
    request = pb.InfoRequest(dial_back=list(dial_back)).SerializeToString()
    with transport.channel(address) as channel:
        call = channel.unary_unary(INFO_METHOD, response_deserializer=pb.InfoReply.FromString)
        reply, answered = call.with_call(
            request, timeout=timeout + DIAL_BACK_SECONDS * len(dial_back), metadata=metadata
        )
    seen = next((str(v) for k, v in answered.trailing_metadata() or () if k == SEEN_AS_HEADER), "")
    return WitnessView(seen, {d.port: "" if d.connected else (d.error or "not connected") for d in reply.dial_back})


def check_reachable(
    address: str,
    peer_id: str,
    transport: Transport,
    *,
    witnesses: Sequence[tuple[str, str]] = (),
    timeout: float = 5.0,
) -> Reachability:
    """Reachable if this node answers its own Info at ``address`` and none of ``witnesses`` ((address, peer id) of
    reachable peers) sees this node's call come from elsewhere than the announced host; ``witnessed`` once that is
    settled (see below)."""
    own = _answers_at(address, peer_id, transport, timeout=timeout)
    if not own.reachable:
        return own
    host, port = host_of_address(address), address.rpartition(":")[2]
    agreeing = 0
    for witness_address, witness_id in witnesses:
        try:
            view = ask_witness(witness_address, witness_id, transport, dial_back=[int(port)], timeout=timeout)
        except (ExchangeError, grpc.RpcError):
            continue  # this witness is gone or busy: the next
        if not view.seen:
            continue
        if view.seen != host:
            return Reachability(False, f"{witness_address} sees this node's calls come from {view.seen}: a NAT", True)
        # The right host, but a firewall may drop what comes in, or a port forward may be missing: the witness dials.
        why = view.dialed.get(int(port), "")
        if why:
            return Reachability(
                False, f"{witness_address} could not open a connection to {address} ({why}): a firewall", True
            )
        agreeing += 1
    # Settled by the first witness that answers, whether it disagrees or agrees: witnesses are off this node's own
    # network (witnesses_for).
    return Reachability(True, "", agreeing > 0)


def witnesses_for(address: str, candidates: Sequence[tuple[str, str]]) -> list[tuple[str, str]]:
    """The candidates ((address, peer id) of reachable peers) worth asking: those off this node's own /24. A
    witness behind the same NAT (a house's, a lab's network) sees this node's private address, just as this node
    sees its own, and would settle it as reachable: a swarm on one network (or one machine) has no witness, and
    there the self-check is right."""
    own = address.rpartition(":")[0].rsplit(".", 1)[0] + "."
    return [c for c in candidates if not c[0].startswith(own)]


def _answers_at(address: str, peer_id: str, transport: Transport, *, timeout: float) -> Reachability:
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
