"""How a node's gRPC calls travel and what guards its server: channels (plain or TLS), membership proofs, watchdogs.

:class:`Transport` is what exchange.py's client functions and server take instead of building channels
themselves: it makes a plaintext or TLS channel (tls.py), signs each call for a private run and checks the
server's answering proof (auth.py), and installs the authenticating interceptor on the server.

:class:`Watchdog` bounds every served call from the server's side, whatever deadline the caller set (or did not):
a call is cancelled when it runs past its limit, when no byte has moved for ``stall`` seconds (a stream that
never sent a byte, or stopped), or when, after a short grace, it moves fewer bytes per second than the slowest
link the run allows (``min_link_rate``). A slow-loris caller that opens streams and trickles (or
stops reading) therefore holds a worker thread and the pairing lock for seconds, not for the exchange ceiling.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc

from noloco_node.security.auth import AuthInterceptor, CallAuthenticator
from noloco_node.security.caller_proof import prove
from noloco_node.security.identity import NodeIdentity
from noloco_node.security.tls import TlsFiles
from noloco_node.wire.frames import MAX_MESSAGE_BYTES

log = logging.getLogger(__name__)

CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    # A fresh channel gets a fresh connection: a subchannel shared per address keeps its reconnect backoff (up to
    # 120 s), so calls across a healed partition kept failing (docs/threat-model.md, 8).
    ("grpc.use_local_subchannel_pool", 1),
    ("grpc.initial_reconnect_backoff_ms", 1000),
    # A connection attempt gets 5 s (gRPC's default: 20): an address that silently drops what is sent to it (a
    # private one of another network, a dead host) fails the call in seconds, not at its deadline.
    ("grpc.min_reconnect_backoff_ms", 5000),
    ("grpc.max_reconnect_backoff_ms", 5000),
]


class _PooledChannel:
    """``with transport.channel(address) as channel``: a kept-open channel to ``address``.

    Reusing one connection per peer saves the TCP (and TLS) handshakes and, with the kernel keeping its congestion
    window (``net.ipv4.tcp_slow_start_after_idle=0``), the slow start of every exchange: on a 50 ms path that is
    several round trips per call. A call that fails on its connection (not one the peer answered: busy, out of
    reach, refused) drops the channel from the pool (a restarted or dead peer gets a fresh connection next time).
    A channel that leaves the pool, dropped, idle or the least recently used, is closed as soon as no call is
    using it: calls still on it finish on it, and the last one out closes it.
    """

    def __init__(self, transport: Transport, address: str) -> None:
        self.transport, self.address = transport, address
        self._entry: _Pooled | None = None

    def __enter__(self) -> grpc.Channel:
        self._entry = self.transport._lend(self.address)
        return self._entry.channel

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, *_: object) -> None:
        assert self._entry is not None
        self.transport._give_back(self._entry, broken=kind is not None and _connection_may_be_broken(error))


@dataclass
class _Pooled:
    """A pooled channel, the calls using it, and whether it has left the pool (closed when the last call ends)."""

    channel: grpc.Channel
    last_use: float
    users: int = 0
    retired: bool = False
    closed: bool = False

    def to_close(self) -> grpc.Channel | None:
        """Under the pool's lock: the channel, once, when it is out of the pool and unused; else None."""
        if self.retired and self.users == 0 and not self.closed:
            self.closed = True
            return self.channel
        return None


# A call that ended with one of these says nothing against its connection: the peer answered (busy, out of reach,
# a refused payload). Keeping the connection matters most for a tunnel (discovery/tunnels.py), whose setup costs
# several round trips through a relay.
_ANSWERED = frozenset(
    {
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.OUT_OF_RANGE,
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.FAILED_PRECONDITION,
        grpc.StatusCode.ABORTED,
        grpc.StatusCode.PERMISSION_DENIED,
        grpc.StatusCode.UNAUTHENTICATED,
    }
)


def _connection_may_be_broken(error: BaseException | None) -> bool:
    code = getattr(error, "code", None)
    if callable(code):  # grpc.RpcError
        code = code()
    return code not in _ANSWERED


class Transport:
    """Channel and call options shared by every call a node makes, and the server's security settings."""

    POOL_SIZE = 64  # peers kept connected; the least recently used is dropped beyond it
    POOL_IDLE_SECONDS = 600.0

    def __init__(
        self,
        *,
        authenticator: CallAuthenticator | None = None,
        tls: TlsFiles | None = None,
        identity: NodeIdentity | None = None,
        channel_options: Sequence[tuple[str, Any]] = tuple(CHANNEL_OPTIONS),
    ) -> None:
        self.authenticator = authenticator
        self.tls = tls
        self.identity = identity  # proves this node's peer id to the servers it calls (caller_proof.py)
        self.channel_options = list(channel_options)
        self._channel_credentials = tls.channel_credentials() if tls else None  # read once: fail at start
        self._pool: dict[str, _Pooled] = {}  # address -> its channel, least recently used first
        self._retired: list[_Pooled] = []  # out of the pool, still used by a call: closed by the last one out
        self._pool_lock = threading.Lock()

    def forget(self, address: str) -> None:
        """Keep nothing: the next call to ``address`` connects anew (a tunnel's local endpoint that was closed,
        discovery/tunnels.py, whose port another endpoint may reuse); the old channel closes once unused."""
        self._drop(address)

    @property
    def authenticates(self) -> bool:
        return self.authenticator is not None

    def channel(self, address: str) -> _PooledChannel:
        """A context manager giving the pooled channel to ``address`` (see _PooledChannel)."""
        return _PooledChannel(self, address)

    def _lend(self, address: str) -> _Pooled:
        now = time.monotonic()
        retired: list[_Pooled] = []
        with self._pool_lock:
            entry = self._pool.pop(address, None)
            if entry is not None and now - entry.last_use >= self.POOL_IDLE_SECONDS:
                retired.append(entry)
                entry = None
            if entry is None:
                entry = _Pooled(self.new_channel(address), now)
            entry.last_use = now
            entry.users += 1
            self._pool[address] = entry  # newest last
            while len(self._pool) > self.POOL_SIZE:
                retired.append(self._pool.pop(next(iter(self._pool))))
            closing = [self._retire(old) for old in retired]
        for channel in closing:
            if channel is not None:
                channel.close()
        return entry

    def _give_back(self, entry: _Pooled, *, broken: bool) -> None:
        with self._pool_lock:
            entry.users -= 1
            if broken and not entry.retired:  # out of the pool: the next call connects anew
                address = next((a for a, pooled in self._pool.items() if pooled is entry), None)
                if address is not None:
                    del self._pool[address]
                closing = self._retire(entry)
            else:
                closing = entry.to_close()
        if closing is not None:
            closing.close()

    def _retire(self, entry: _Pooled) -> grpc.Channel | None:
        """Out of the pool (under the lock): the channel to close now if no call uses it, else None (the last
        call out closes it)."""
        entry.retired = True
        self._retired = [e for e in self._retired if not e.closed]
        closing = entry.to_close()
        if closing is None:
            self._retired.append(entry)
        return closing

    def _drop(self, address: str) -> None:
        with self._pool_lock:
            entry = self._pool.pop(address, None)
            closing = self._retire(entry) if entry is not None else None
        if closing is not None:
            closing.close()

    def close_channels(self) -> None:
        """Close every channel, pooled or retired, in use or not: the node is stopping (a call on one ends
        CANCELLED, and its thread is free)."""
        with self._pool_lock:
            entries = [e for e in [*self._pool.values(), *self._retired] if not e.closed]
            self._pool.clear()
            self._retired.clear()
            for entry in entries:
                entry.retired, entry.closed = True, True
        for entry in entries:
            entry.channel.close()

    def new_channel(self, address: str) -> grpc.Channel:
        """A fresh, unpooled channel (the caller closes it)."""
        if self._channel_credentials is None:
            return grpc.insecure_channel(address, options=self.channel_options)
        assert self.tls is not None
        options = [*self.channel_options, ("grpc.ssl_target_name_override", self.tls.server_name)]
        return grpc.secure_channel(address, self._channel_credentials, options=options)

    def sign(self, method: str, target_peer_id: str) -> tuple[list[tuple[str, str]] | None, str]:
        """Metadata for one call to the server ``target_peer_id`` and the nonce its answer must prove: the
        membership proof of a private run and the proof of this node's own peer id, both made for that server
        alone (a proof captured in front of one node is worthless in front of another)."""
        metadata, nonce = (
            ([], "") if self.authenticator is None else self.authenticator.call_metadata(method, target_peer_id)
        )
        if self.identity is not None:
            metadata = [*metadata, *prove(self.identity, method, target_peer_id)]
        return (metadata or None), nonce

    def server_problem(self, method: str, nonce: str, call: Any) -> str | None:
        """None when the server of ``call`` proved membership (or the run is open); blocks for its metadata."""
        if self.authenticator is None:
            return None
        return self.authenticator.check_server(method, nonce, call.initial_metadata())

    def add_port(self, server: grpc.Server, bind: str) -> int:
        if self.tls is None:
            return server.add_insecure_port(bind)
        return server.add_secure_port(bind, self.tls.server_credentials())

    def interceptors(self, on_refusal: Callable[[str], None]) -> list[grpc.ServerInterceptor]:
        return [] if self.authenticator is None else [AuthInterceptor(self.authenticator, on_refusal)]


PLAIN = Transport()


@dataclass
class GuardedCall:
    """One served call under the watchdog. ``progress`` returns bytes moved so far (both directions)."""

    context: grpc.ServicerContext
    deadline: float  # monotonic
    progress: Callable[[], int]
    min_rate: float
    grace: float
    stall: float = 0.0  # cut when no byte has moved for this long (0: never)
    started: float = field(default_factory=time.monotonic)
    cut_reason: str | None = None
    transferred: bool = False  # every byte has moved: only the deadline applies from here on
    last_bytes: int = 0
    last_change: float = field(default_factory=time.monotonic)
    # Called on the watchdog's thread with the reason, before the call is cancelled: what a cut costs the caller
    # is settled before the caller can hear of it and call again.
    on_cut: Callable[[str], None] | None = None


class Watchdog:
    """One thread checking every served call twice a second; cancels those past their limit or too slow."""

    def __init__(self, *, tick: float = 0.5) -> None:
        self.tick = tick
        self._by_id: dict[int, GuardedCall] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="call-watchdog", daemon=True)
        self._thread.start()

    def watch(
        self,
        context: grpc.ServicerContext,
        *,
        limit: float,
        progress: Callable[[], int] = lambda: 0,
        min_rate: float = 0.0,
        grace: float = 5.0,
        stall: float = 0.0,
        on_cut: Callable[[str], None] | None = None,
    ) -> GuardedCall:
        call = GuardedCall(context, time.monotonic() + limit, progress, min_rate, grace, stall, on_cut=on_cut)
        with self._lock:
            self._by_id[id(call)] = call
        return call

    def release(self, call: GuardedCall) -> None:
        with self._lock:
            self._by_id.pop(id(call), None)

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(self.tick):
            now = time.monotonic()
            with self._lock:
                calls = list(self._by_id.values())
            for call in calls:
                reason = self._verdict(call, now)
                if reason is not None and call.cut_reason is None:
                    call.cut_reason = reason
                    if call.on_cut is not None:
                        call.on_cut(reason)
                    call.context.cancel()

    @staticmethod
    def _verdict(call: GuardedCall, now: float) -> str | None:
        if now >= call.deadline:
            return "deadline"
        elapsed = now - call.started
        if call.transferred:
            return None
        moved = call.progress()
        if moved != call.last_bytes:
            call.last_bytes, call.last_change = moved, now
        elif call.stall > 0 and now - call.last_change > call.stall:
            return "stalled"  # a silent stream (nothing since it opened), or one that stopped moving
        if call.min_rate > 0 and elapsed > call.grace and call.progress() < call.min_rate * (elapsed - call.grace):
            return "too_slow"
        return None
