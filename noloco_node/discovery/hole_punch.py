"""A direct TCP connection to a member behind a NAT, set up over the relayed stream to it (tunnels.py).

A caller that reaches a member through a relay first tries to do without it. Over the relayed stream the two swap
the ports they will use, and each learns the other's public address from the relay (where the relay's connection
came from). Then one of two ways, by what the caller is:

- **Reversal** (the caller can be dialed: reachability.py). The caller listens on its offered port and the member
  connects out to it, through its own NAT, which lets any outbound connection through: this works whatever the
  member's NAT, a symmetric one included. A caller whose firewall opens only its gRPC port is not reached on the
  offered port, and keeps the relay.
- **Simultaneous open** (both are behind NATs). Both connect to each other at once, from the ports they swapped.
  A NAT that keeps a connection's source port whatever the destination (endpoint-independent mapping: most home
  routers, and the ``port_restricted`` kind of benchmarks/noloco_bench/nat_network.py) lets the other side's SYN
  in once its own member's SYN has gone out: the SYNs cross, and each side's connect completes on one connection.
  Timing decides it, as in libp2p's DCUtR: a SYN that reaches the other router before that router's member has
  sent its own is refused, and the router's record of it makes the member's SYN leave from another port. So the
  caller measures the round trip over the relay, tells the member to start, and starts half that round trip
  later: the two SYNs leave together. A NAT that maps each destination to a new port (``symmetric``, many carrier
  NATs) defeats it, as does one that does not loop back between two members behind it.

The exchange over the relayed stream (one JSON line at a time, relay.py's headers) is :func:`answer_offer` at the
member and :func:`take_offer` at the caller. Whichever way, after :data:`PUNCH_SECONDS` without a connection the two
keep the relayed stream they already have, and gRPC runs over what they keep exactly as over the relay (caller
proofs, admission, sealed payloads). hivemind's p2pd (1.1.12) has no hole punching (``p2pd -help`` lists none),
hence this small version on sockets.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import socket
import time
from typing import Any

from noloco_node.discovery.relay import HEADER_SECONDS, HeaderError, read_header, write_header

Stream = tuple[asyncio.StreamReader, asyncio.StreamWriter]

PUNCH_SECONDS = 2.5  # then the relay: well inside gRPC's 5 s to connect (rpc/transport.py), relay setup included
ATTEMPT_SECONDS = 0.5  # one SYN's worth: a SYN lost or dropped is not retransmitted for a second
RETRY_SECONDS = 0.05  # after a refused attempt


def punchable(host: str) -> bool:
    """An IPv4 address (what the sockets here speak): a relay reports hosts from libp2p addresses, maybe IPv6."""
    try:
        return isinstance(ipaddress.ip_address(host), ipaddress.IPv4Address)
    except ValueError:
        return False


def bound_socket(port: int = 0, *, listen: bool = False) -> socket.socket:
    """A non-blocking TCP socket bound to ``port`` on every interface (0: a free port), reusable at once (the same
    local port is tried again after a refused attempt); listening, with ``listen``."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("0.0.0.0", port))
        if listen:
            sock.listen(1)
        sock.setblocking(False)
    except OSError:
        sock.close()
        raise
    return sock


async def connect_from(
    first: socket.socket, host: str, port: int, *, seconds: float = PUNCH_SECONDS
) -> socket.socket | None:
    """Connect from ``first``'s local port to ``host:port``, attempt after attempt (each one SYN's worth, on a fresh
    socket of the same port), until it connects: the connected socket, or None after ``seconds``. Used for both
    ways: towards a listening caller, and towards a member connecting back at the same moment. ``first`` is
    consumed (closed on failure or cancellation)."""
    loop = asyncio.get_running_loop()
    local_port = first.getsockname()[1]
    deadline = time.monotonic() + seconds
    sock: socket.socket | None = first
    try:
        while (left := deadline - time.monotonic()) > 0:
            if sock is None:
                try:
                    sock = bound_socket(local_port)
                except OSError:  # the port is still held by the attempt just closed: a moment later
                    await asyncio.sleep(RETRY_SECONDS)
                    continue
            try:
                await asyncio.wait_for(loop.sock_connect(sock, (host, port)), min(ATTEMPT_SECONDS, left))
            except (OSError, asyncio.TimeoutError):
                sock.close()
                sock = None
                await asyncio.sleep(min(RETRY_SECONDS, max(0.0, deadline - time.monotonic())))
                continue
            connected, sock = sock, None
            return connected
        return None
    finally:  # given up, or cancelled (the other side chose the relay): nothing left open
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.close()


async def accept_from(listener: socket.socket, host: str, *, seconds: float = PUNCH_SECONDS) -> socket.socket | None:
    """The first connection to ``listener`` from ``host`` within ``seconds`` (others are closed), or None. The
    listener is closed either way."""
    loop = asyncio.get_running_loop()
    deadline = time.monotonic() + seconds
    try:
        while (left := deadline - time.monotonic()) > 0:
            try:
                sock, (peer_host, _port) = await asyncio.wait_for(loop.sock_accept(listener), left)
            except (OSError, asyncio.TimeoutError):
                return None
            if peer_host == host:
                sock.setblocking(False)
                return sock
            sock.close()  # someone else found the port: not the member
        return None
    finally:
        listener.close()


# ---------------------------------------------------------------------------------------------- over the relay


async def answer_offer(sock: socket.socket, port: Any, caller_host: str, stream: Stream) -> socket.socket | None:
    """The member's side: answer the tunnel (``{"ok": true}``) with this end's port (``sock``'s), echo the caller's
    timing ping, connect towards the caller on its ``sync``, and take the way the caller chose: the punched
    connection, or None for the relayed stream. A caller that chose direct while this end did not connect has no
    tunnel: HeaderError. ``sock`` is consumed."""
    reader, writer = stream
    attempt: asyncio.Future[socket.socket | None] | None = None
    direct: socket.socket | None = None
    owned: socket.socket | None = sock
    try:
        await write_header(writer, {"ok": True, "punch": sock.getsockname()[1]})
        line: dict[str, Any] = {}
        for _ in range(3):  # at most a ping and a sync before the caller's choice
            line = await read_header(reader)
            if line.get("ping"):
                await write_header(writer, {"pong": True})
            elif line.get("sync") and owned is not None and isinstance(port, int):
                attempt = asyncio.ensure_future(connect_from(owned, caller_host, port))
                owned = None  # the attempt owns it
            else:
                break
        if line.get("use") == "direct":
            if attempt is None:
                raise HeaderError("the caller chose a direct connection that was never tried")
            # The caller's end connected, so ours did, on the same connection (or does within a moment).
            direct = await asyncio.wait_for(asyncio.shield(attempt), PUNCH_SECONDS + HEADER_SECONDS)
            if direct is None:
                raise HeaderError("the caller connected directly and this end did not")
        return direct
    finally:
        if owned is not None:
            owned.close()
        if attempt is not None and direct is None:  # the relay it is (or nothing): whatever it made is closed
            attempt.cancel()
            attempt.add_done_callback(_close_connected)


async def take_offer(
    punch: socket.socket | None, member_host: str, member_port: Any, stream: Stream, *, listening: bool
) -> socket.socket | None:
    """The caller's side, once the member answered the offer with a port: wait for the member to connect
    (``listening``: this node can be dialed, a reversal), or time a simultaneous open over the relayed stream
    (ping, then ``sync``, then dial half a round trip later); then tell the member which way the tunnel goes. The
    punched connection, or None for the relayed stream. ``punch`` is consumed."""
    reader, writer = stream
    direct: socket.socket | None = None
    try:
        if not isinstance(member_port, int):
            return None  # the member offered nothing: it expects no more header lines
        if punch is not None and punchable(member_host):
            if listening:  # reversal: the member connects out through its own NAT
                await write_header(writer, {"sync": True})
                direct = await accept_from(punch, member_host)
            else:  # both behind NATs: the two SYNs must leave together
                started = time.monotonic()
                await write_header(writer, {"ping": True})
                await read_header(reader)
                round_trip = time.monotonic() - started
                await write_header(writer, {"sync": True})
                await asyncio.sleep(round_trip / 2)
                direct = await connect_from(punch, member_host, member_port)
            punch = None  # consumed by accept_from or connect_from
        await write_header(writer, {"use": "direct" if direct is not None else "relay"})
        return direct
    except BaseException:
        if direct is not None:
            direct.close()
        raise
    finally:
        if punch is not None:
            punch.close()


def _close_connected(attempt: asyncio.Future[socket.socket | None]) -> None:
    """A hole punch that is not used: close the connection it made, if it made one before it was cancelled."""
    if not attempt.cancelled() and attempt.exception() is None and (sock := attempt.result()) is not None:
        sock.close()
