"""How every call into a node's service starts and ends, whatever its kind: the caller proven (caller_proof.py), a
slot admitted (admission.py) or RESOURCE_EXHAUSTED at once, the watchdog's limits (transport.py), and what an
exchange the watchdog cut for stalling or trickling costs its peer and its address. Shared by the exchange
(service.py) and the state download (state_serving.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NoReturn

import grpc
from google.protobuf.message import DecodeError

from noloco_node.addresses import network_group
from noloco_node.rpc.admission import DOWNLOAD, EXCHANGE, Admission, Refused, Ticket, remote_host
from noloco_node.rpc.metrics import ExchangeMetrics
from noloco_node.rpc.transport import GuardedCall, Watchdog
from noloco_node.security.caller_proof import KEY_HEADER, CallerProofError, CallerVerifier
from noloco_node.security.payload_guard import Complaints

# The cuts that bar: a caller that moved nothing, or trickled below the minimum link rate, held the round on purpose
# or over a link that cannot carry an exchange; either way its next calls are not served for a while.
CUT_MEANING = {
    "stalled": "it moved no byte for the stall limit",
    "too_slow": "it moved its bytes below the minimum link rate",
}
BARRING_CUTS = frozenset(CUT_MEANING)


class CallGate:
    """Thread-safe (each part is): the service's handlers run on gRPC's thread pool."""

    def __init__(
        self,
        metrics: ExchangeMetrics,
        admission: Admission,
        *,
        verifier: CallerVerifier | None = None,
        watchdog: Watchdog | None = None,
        min_link_rate: float = 0.0,
        stall_seconds: float = 0.0,
        origin: Callable[[str], str | None] = lambda _peer: None,
    ) -> None:
        self.metrics = metrics
        # A call that came through a tunnel (discovery/tunnels.py) is a local connection: its caller's address is
        # the one the relay saw, which ``origin`` knows.
        self.origin = origin
        self.admission = admission
        # Who is calling: the peer id the caller proved (caller_proof.py). Without a verifier (benchmarks' bare
        # services) the manifest's word is taken, and nothing is decided about peers there.
        self.verifier = verifier
        # A caller that sets no deadline (or a huge one), or trickles its bytes, must not hold a worker thread (and
        # the pairing lock) for long: the watchdog cuts it at the service's limits, whatever its deadline says.
        self.watchdog = watchdog or Watchdog()
        self.min_link_rate = min_link_rate
        self.stall_seconds = stall_seconds
        self.complaints = Complaints()
        metrics.count_calls_in_use(admission.in_use)

    def caller(self, method: str, context: grpc.ServicerContext, *, required: bool) -> str | None:
        """The caller's proven peer id (None when this service verifies none, or for an optional proof that was
        not given); aborts a call with a bad or missing required proof (UNAUTHENTICATED) before its handler reads
        a byte."""
        metadata = context.invocation_metadata()
        if self.verifier is None or (not required and not any(key == KEY_HEADER for key, _ in metadata or ())):
            return None
        try:
            return self.verifier.verify(method, metadata)
        except CallerProofError as error:
            self.metrics.rejection(f"identity_{error.reason}")
            self.metrics.outcome("unproven_caller")
            busy = error.reason == "busy"  # a valid proof the table has no room for yet: not an identity failure
            abort(context, grpc.StatusCode.RESOURCE_EXHAUSTED if busy else grpc.StatusCode.UNAUTHENTICATED, str(error))

    def address_of(self, context: grpc.ServicerContext) -> str:
        """The caller's address: what this server sees, or, through a tunnel, what the relay saw."""
        peer = context.peer()
        return self.origin(peer) or remote_host(peer)

    def admit(self, kind: str, context: grpc.ServicerContext, caller: str | None) -> Ticket:
        """A slot for this call (admission.py), or RESOURCE_EXHAUSTED at once, before any work. Slots and bars are
        per network group of the caller's address (addresses.py): one machine may hold a whole /24 or /48."""
        try:
            return self.admission.enter(kind, peer=caller, address=network_group(self.address_of(context)))
        except Refused as refused:
            self.metrics.rejection(f"admission_{refused.reason}")
            self.metrics.outcome("download_busy" if kind == DOWNLOAD else f"refused_{refused.reason}")
            abort(context, grpc.StatusCode.RESOURCE_EXHAUSTED, str(refused))

    def watch(
        self, context: grpc.ServicerContext, ticket: Ticket, *, limit: float, progress: Callable[[], int]
    ) -> GuardedCall:
        """The watchdog on this call: cut past ``limit`` seconds, below the minimum link rate, or when stalled."""
        return self.watchdog.watch(
            context,
            limit=limit,
            progress=progress,
            min_rate=self.min_link_rate,
            stall=self.stall_seconds,
            on_cut=(lambda reason: self._cut(ticket, reason)) if ticket.kind == EXCHANGE else None,
        )

    def _cut(self, ticket: Ticket, reason: str) -> None:
        """An exchange the watchdog cut for moving no byte, or too few, held this node's pairing round: its peer and
        its address are barred (admission.py) before the cut reaches the caller, so its next call finds the bar.
        (A call past its deadline is not barred: it moved its bytes at the link rate, and the deadline ended it.)"""
        if reason not in BARRING_CUTS:
            return
        barred = self.admission.bar(ticket)
        self.complaints.complain(
            ticket.address,
            reason,
            f"an exchange from {ticket.peer or 'an unproven caller'} was cut ({CUT_MEANING[reason]}); "
            f"its address and peer are served no exchange for {barred:.0f}s",
        )

    def leave(self, ticket: Ticket, guard: GuardedCall) -> None:
        """Give the slot back."""
        self.watchdog.release(guard)
        self.admission.leave(ticket)


def abort(context: grpc.ServicerContext, code: grpc.StatusCode, message: str) -> NoReturn:
    """End the call with ``code``: grpc's ``abort`` raises, and saying so keeps the handlers' types honest."""
    context.abort(code, message)
    raise AssertionError("grpc's ServicerContext.abort returned")


def parse(message: Any, raw: bytes, context: grpc.ServicerContext) -> Any:
    """Requests are parsed here, not by grpc, so that garbage gets INVALID_ARGUMENT (grpc's own deserializer
    failing answers INTERNAL, which says nothing useful to the caller)."""
    try:
        return message.FromString(raw)
    except DecodeError:
        abort(context, grpc.StatusCode.INVALID_ARGUMENT, f"malformed {message.DESCRIPTOR.name}")
