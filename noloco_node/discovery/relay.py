"""What a reachable member carries for members that nobody can dial: a spliced libp2p stream, within a budget.

A caller asks a relay (on the libp2p protocol :data:`RELAY_PROTOCOL`) for a member by its libp2p id; the relay
opens a stream to that member (:data:`TUNNEL_PROTOCOL`, tunnels.py) over the connection the member keeps open to
it, and copies bytes both ways until either side closes. It reads one header line from each side and nothing else
(passing on the caller's port for a hole punch, hole_punch.py, and telling the caller the member's public address);
what it forwards is the caller's gRPC connection to the member, checked end to end by both of them (caller proofs,
admission, every payload check), encrypted end to end when the run uses TLS.

The budget is a hard bound, refused up front or cut mid-stream: at most ``slots`` relayed streams at once and
``bytes_per_hour`` bytes (both directions together, a sliding hour). ``--no-relay`` turns the service off. Every
byte carried is counted (``noloco_relayed_bytes``) and every refusal by reason (``noloco_relay_refusals``).

A member relays only while it offers to (``offered``, kept by node/reach.py): a member that learns it sits behind a
NAT withdraws, refusing new requests and cutting what it carries, so that its callers move to a reachable relay
instead of riding its home uplink (a libp2p connection it opened itself would otherwise carry them for good).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter

log = logging.getLogger(__name__)

RELAY_PROTOCOL = "/noloco/relay/1"
TUNNEL_PROTOCOL = "/noloco/tunnel/1"
HEADER_LIMIT = 1024  # bytes of one header line: a peer id or an address, never more
HEADER_SECONDS = 10.0  # to read or write a header, and for the relay to reach the member
CHUNK = 1 << 16


class HeaderError(Exception):
    """A header line that is missing, too long or malformed: the stream is closed, nothing is forwarded."""


async def read_header(reader: asyncio.StreamReader) -> dict[str, Any]:
    """One JSON object on one line, within HEADER_LIMIT bytes and HEADER_SECONDS."""
    try:
        line = await asyncio.wait_for(reader.readline(), HEADER_SECONDS)
    except (asyncio.TimeoutError, ValueError) as error:  # ValueError: a line beyond the reader's limit
        raise HeaderError(f"no header line: {error!r}") from None
    if not line.endswith(b"\n") or len(line) > HEADER_LIMIT:
        raise HeaderError("header line missing or too long")
    try:
        header = json.loads(line)
    except ValueError:
        raise HeaderError("header is not JSON") from None
    if not isinstance(header, dict):
        raise HeaderError("header is not an object")
    return header


async def write_header(writer: asyncio.StreamWriter, header: dict[str, Any]) -> None:
    writer.write(json.dumps(header, separators=(",", ":")).encode() + b"\n")
    await asyncio.wait_for(writer.drain(), HEADER_SECONDS)


async def pipe(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, *, count: Any = None, idle: float = 600.0
) -> None:
    """Copy until EOF (or ``idle`` s without a byte); ``count(n)`` hears of every chunk and may raise to cut."""
    try:
        while True:
            chunk = await asyncio.wait_for(reader.read(CHUNK), idle)
            if not chunk:
                break
            if count is not None:
                count(len(chunk))
            writer.write(chunk)
            await asyncio.wait_for(writer.drain(), idle)
    finally:
        with contextlib.suppress(Exception):
            writer.close()


async def splice(
    a: tuple[asyncio.StreamReader, asyncio.StreamWriter],
    b: tuple[asyncio.StreamReader, asyncio.StreamWriter],
    *,
    count: Callable[[int], None] | None = None,
) -> None:
    """Both directions until either ends; then both are closed (a half-open tunnel is a dead one for gRPC)."""
    tasks = [
        asyncio.ensure_future(pipe(a[0], b[1], count=count)),
        asyncio.ensure_future(pipe(b[0], a[1], count=count)),
    ]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in tasks:
            task.cancel()
        for _reader, writer in (a, b):
            with contextlib.suppress(Exception):
                writer.close()
        await asyncio.gather(*tasks, return_exceptions=True)


class OverBudget(Exception):  # noqa: N818  (a decision, not a failure)
    pass


@dataclass
class RelayBudget:
    """What a member carries for others: ``slots`` streams at once, ``bytes_per_hour`` bytes in any hour."""

    slots: int = 32
    bytes_per_hour: int = 8 << 30

    def __post_init__(self) -> None:
        self.open = 0
        self._carried: deque[tuple[float, int]] = deque()  # (monotonic second, bytes), the last hour
        self._hour_total = 0

    def _trim(self, now: float) -> None:
        while self._carried and self._carried[0][0] <= now - 3600.0:
            self._hour_total -= self._carried.popleft()[1]

    def in_last_hour(self) -> int:
        self._trim(time.monotonic())
        return self._hour_total

    def carry(self, n: int) -> None:
        now = time.monotonic()
        self._trim(now)
        if self._hour_total + n > self.bytes_per_hour:
            raise OverBudget(f"{self.bytes_per_hour} bytes relayed within the hour")
        second = float(int(now))
        if self._carried and self._carried[-1][0] == second:
            self._carried[-1] = (second, self._carried[-1][1] + n)
        else:
            self._carried.append((second, n))
        self._hour_total += n


class RelayMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.bytes = Counter(
            "noloco_relayed_bytes", "Bytes this member carried for others (both directions).", registry=registry
        )
        self.streams = Counter("noloco_relayed_streams", "Streams this member relayed.", registry=registry)
        self.refusals = Counter(
            "noloco_relay_refusals", "Relay requests refused or cut, by reason.", ["reason"], registry=registry
        )

    @property
    def carried(self) -> int:
        return int(self.bytes._value.get())


class RelayService:
    """The relay side: serves RELAY_PROTOCOL on this node's libp2p daemon (``p2p``: a hivemind P2P replica)."""

    def __init__(self, p2p: Any, budget: RelayBudget, metrics: RelayMetrics) -> None:
        self.p2p = p2p
        self.budget = budget
        self.metrics = metrics
        self.offered = True  # whether this node offers to relay now (node/reach.py)
        self._carrying: set[asyncio.StreamWriter] = set()  # the callers' ends of the streams relayed now

    def withdraw(self) -> None:
        """Stop relaying: refuse new requests and cut the streams carried now (their callers redial the member
        through its other relay)."""
        self.offered = False
        for writer in list(self._carrying):
            self.metrics.refusals.labels("withdrawn").inc()
            writer.close()

    async def start(self) -> None:
        await self.p2p.add_binary_stream_handler(RELAY_PROTOCOL, self._handle)

    def _refuse(self, reason: str) -> dict[str, Any]:
        self.metrics.refusals.labels(reason).inc()
        return {"ok": False, "why": reason}

    async def _handle(self, info: Any, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        from hivemind.p2p import PeerID  # the DHT's library; imported where used, as tunnels.py does

        try:
            header = await read_header(reader)
            target = PeerID.from_base58(str(header.get("to", "")))
        except (HeaderError, ValueError):
            self.metrics.refusals.labels("bad_header").inc()
            writer.close()
            return
        if not self.offered:
            await write_header(writer, self._refuse("not_offered"))
            writer.close()
            return
        if self.budget.open >= self.budget.slots:
            await write_header(writer, self._refuse("slots"))
            writer.close()
            return
        if self.budget.in_last_hour() >= self.budget.bytes_per_hour:
            await write_header(writer, self._refuse("bytes"))
            writer.close()
            return
        self.budget.open += 1
        try:
            try:
                member_info, member_reader, member_writer = await asyncio.wait_for(
                    self.p2p.call_binary_stream_handler(target, TUNNEL_PROTOCOL), HEADER_SECONDS
                )
                punch = header.get("punch")  # the caller's port for a direct connection (hole_punch.py)
                await write_header(
                    member_writer, {"origin": host_of(info), **({"punch": punch} if isinstance(punch, int) else {})}
                )
                answer = await read_header(member_reader)
                # Where each side's connection comes from, their public sides: for the caller's hole punch.
                answer["host"], answer["caller_host"] = host_of(member_info), host_of(info)
            except Exception as error:  # the member is gone, not connected to us, or slow: the caller tries another
                log.debug("relay to %s failed: %r", target, error)
                await write_header(writer, self._refuse("member_unreachable"))
                writer.close()
                return
            await write_header(writer, answer)
            if not answer.get("ok"):
                member_writer.close()
                writer.close()
                return
            self.metrics.streams.inc()

            def count(n: int) -> None:
                try:
                    self.budget.carry(n)
                except OverBudget:
                    self.metrics.refusals.labels("cut_bytes").inc()
                    raise
                self.metrics.bytes.inc(n)

            self._carrying.add(writer)
            with contextlib.suppress(OverBudget, ConnectionError, asyncio.TimeoutError):
                await splice((reader, writer), (member_reader, member_writer), count=count)
        finally:
            self._carrying.discard(writer)
            self.budget.open -= 1


def host_of(info: Any) -> str:
    """The IP address a libp2p stream came from (its remote multiaddr's first component), or ''."""
    parts = str(getattr(info, "addr", "")).split("/")
    return parts[2] if len(parts) > 2 and parts[1] in ("ip4", "ip6") else ""
