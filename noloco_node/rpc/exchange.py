"""The gRPC service between peers and its client: weight exchange, state download, peer info.

``Exchange`` is a bidirectional stream: each side sends its payload (wire.py frames) while it receives the other's.
Both directions run at once; a side that only wrote before reading would deadlock against HTTP/2 flow control
as soon as both payloads exceed the window. A side hands the partner's payload to its node (to blend) only once
the payload is complete and verified; a stream cut at any byte leaves both nodes' state untouched.

Refusals are fast and precise: a node that is busy or not ready answers ABORTED at once (the caller tries another
peer); a peer of another run gets FAILED_PRECONDITION; a malformed payload gets INVALID_ARGUMENT (or
RESOURCE_EXHAUSTED when oversized), and each refusal is counted by reason in :class:`ExchangeMetrics`.

The server uses grpc's synchronous API on a thread pool: handlers convert and copy tensors, which must never run
on the node's event loop, and on loopback the synchronous stack with 1 MiB chunks is the faster one. Every call
carries a deadline, and the server enforces its own whatever the caller asked for (transport.Watchdog: a limit per
call and a minimum transfer rate, against slow-loris callers); the server bounds concurrent calls. Channels,
TLS and the membership proofs of a private run come from transport.py; a verified payload must still pass the
node's own admission check (the norm bound of payload_guard.py) before it is blended.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import Counter, deque
from collections.abc import Iterator, Sequence
from concurrent import futures
from dataclasses import dataclass
from typing import Any, Protocol

import grpc
from google.protobuf.message import DecodeError

from noloco_node.rpc import peer_pb2 as pb
from noloco_node.rpc import peer_pb2_grpc as pb_grpc
from noloco_node.rpc.transport import CHANNEL_OPTIONS, PLAIN, GuardedCall, Transport, Watchdog
from noloco_node.wire.payload import (
    DEFAULT_CHUNK_BYTES,
    Payload,
    PayloadError,
    PayloadReceiver,
    ReceiveBuffers,
    TensorLayout,
    iter_frames,
)

log = logging.getLogger(__name__)

# The service of proto/noloco/v1/peer.proto. Frames cross gRPC as encoded bytes (wire.py writes and reads them),
# so the streaming methods are registered and called without protobuf (de)serializers; a client built from the
# generated stubs still interoperates, since the bytes are the proto's own encoding.
SERVICE = "noloco.v1.Peer"
EXCHANGE_METHOD = f"/{SERVICE}/Exchange"
GET_STATE_METHOD = f"/{SERVICE}/GetState"
INFO_METHOD = f"/{SERVICE}/Info"


@dataclass
class Outgoing:
    """What a node sends in one exchange: a manifest and its tensors (a snapshot that will not change)."""

    manifest: pb.Manifest
    tensors: Sequence


class ExchangeSession(Protocol):
    """The node's side of one exchange, served or initiated; handed out only when the node can pair now."""

    def outgoing(self) -> Outgoing: ...

    def complete(self, payload: Payload) -> None:
        """The partner's verified payload: blend with it (atomically)."""

    def release(self) -> None:
        """The exchange is over, whatever its outcome; the node may pair again."""


class PeerNode(Protocol):
    """What the gRPC service needs from the node it serves."""

    run_fingerprint: str
    peer_id: str
    receive_buffers: ReceiveBuffers  # reused from one exchange to the next

    def expected_layout(self) -> Sequence[TensorLayout]: ...

    def max_payload_bytes(self) -> int: ...

    def open_session(self, partner_id: str, partner_outer_step: int) -> ExchangeSession | None:
        """A session if this node can exchange with that partner now; None means busy (ABORTED)."""

    def info(self) -> pb.InfoReply: ...

    def state_snapshot(self) -> Outgoing | None:
        """The full replica state at the last outer step, for joiners; None when there is none yet."""

    def admit(self, payload: Payload) -> None:
        """Raise PayloadError if this verified payload must still not be blended (the norm bound)."""

    def refused_peer(self, partner_id: str) -> bool:
        """True for a peer this node no longer exchanges with (it sent a bad payload recently)."""

    def bad_payload(self, partner_id: str, error: PayloadError) -> None:
        """A partner's payload was refused for its content (already counted): log it and avoid the partner."""


class AdmitsEverything:
    """PeerNode defaults for nodes without an admission policy (benchmarks, test doubles): every verified payload
    is admitted and no peer is refused."""

    def admit(self, payload: Payload) -> None:
        return None

    def refused_peer(self, partner_id: str) -> bool:
        return False

    def bad_payload(self, partner_id: str, error: PayloadError) -> None:
        return None


# Upper bounds (s) of the exchange-duration histogram's buckets: loopback exchanges of small models take
# milliseconds, a 1.3B model over a 100 Mbit/s link takes minutes.
DURATION_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


class ExchangeMetrics:
    """Exchanges by outcome, refused payloads by reason, bytes, a duration histogram and the last exchanges.

    Thread-safe: the gRPC server's threads, the callers' worker threads and the status endpoint all touch it.
    """

    def __init__(self, keep_recent: int = 50) -> None:
        self._lock = threading.Lock()
        self.outcomes: Counter[str] = Counter()
        self.rejected: Counter[str] = Counter()
        self.bytes_sent = 0
        self.bytes_received = 0
        self.recent: deque[dict[str, Any]] = deque(maxlen=keep_recent)
        self.duration_bucket_counts = [0] * len(DURATION_BUCKETS)  # cumulative, as Prometheus wants them
        self.duration_sum = 0.0
        self.duration_count = 0

    def outcome(self, name: str) -> None:
        with self._lock:
            self.outcomes[name] += 1

    def rejection(self, reason: str) -> None:
        with self._lock:
            self.rejected[reason] += 1

    def add_bytes(self, sent: int = 0, received: int = 0) -> None:
        with self._lock:
            self.bytes_sent += sent
            self.bytes_received += received

    def record(self, *, peer: str, role: str, outcome: str, seconds: float, sent: int, received: int) -> None:
        """One finished exchange: counted by outcome, timed, and kept in the recent list."""
        with self._lock:
            self.outcomes[outcome] += 1
            self.duration_sum += seconds
            self.duration_count += 1
            for index, bound in enumerate(DURATION_BUCKETS):
                if seconds <= bound:
                    self.duration_bucket_counts[index] += 1
            self.recent.append(
                {
                    "peer": peer,
                    "role": role,
                    "outcome": outcome,
                    "seconds": seconds,
                    "bytes_sent": sent,
                    "bytes_received": received,
                    "time": time.time(),
                }
            )

    def snapshot(self) -> dict[str, Any]:
        """A consistent copy of everything, for the status endpoint and the metrics page."""
        with self._lock:
            return {
                "outcomes": dict(self.outcomes),
                "rejected": dict(self.rejected),
                "bytes_sent": self.bytes_sent,
                "bytes_received": self.bytes_received,
                "recent": list(self.recent),
                "duration_buckets": list(zip(DURATION_BUCKETS, self.duration_bucket_counts, strict=True)),
                "duration_sum": self.duration_sum,
                "duration_count": self.duration_count,
            }


class PeerService:
    def __init__(
        self,
        node: PeerNode,
        metrics: ExchangeMetrics,
        *,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        max_call_seconds: float = 120.0,
        max_download_seconds: float = 600.0,
        max_state_downloads: int = 2,
        min_link_rate: float = 0.0,
        watchdog: Watchdog | None = None,
    ) -> None:
        self.node = node
        self.downloads = threading.BoundedSemaphore(max_state_downloads)
        self.metrics = metrics
        self.chunk_bytes = chunk_bytes
        # A caller that sets no deadline (or a huge one), or trickles its bytes, must not hold a worker thread and
        # the pairing lock for long: the watchdog cuts it at these limits, whatever the caller's deadline says.
        self.max_call_seconds = max_call_seconds
        self.max_download_seconds = max_download_seconds
        self.min_link_rate = min_link_rate
        self.watchdog = watchdog or Watchdog()

    def _receiver(self) -> PayloadReceiver:
        return PayloadReceiver(
            self.node.expected_layout(),
            run_fingerprint=self.node.run_fingerprint,
            max_total_bytes=self.node.max_payload_bytes(),
            buffers=self.node.receive_buffers,
        )

    def _refuse(self, context: grpc.ServicerContext, error: PayloadError) -> None:
        self.metrics.rejection(error.reason)
        self.metrics.outcome("refused_payload")
        context.abort(error.code, error.message)

    def Exchange(self, request_iterator: Iterator[bytes], context: grpc.ServicerContext) -> Iterator[bytes]:  # noqa: N802
        receiver = self._receiver()
        guard = self.watchdog.watch(
            context,
            limit=self.max_call_seconds,
            progress=lambda: receiver.bytes_received,
            min_rate=self.min_link_rate,
        )
        try:
            yield from self._exchange(request_iterator, context, receiver, guard)
        finally:
            self.watchdog.release(guard)

    def _exchange(
        self,
        request_iterator: Iterator[bytes],
        context: grpc.ServicerContext,
        receiver: PayloadReceiver,
        guard: GuardedCall,
    ) -> Iterator[bytes]:
        try:
            first = next(request_iterator)
            receiver.feed(first)  # the manifest: run, names, shapes and sizes are checked before anything else
        except (StopIteration, grpc.RpcError) as ended:
            # Cancelled by the watchdog (no manifest in time) or by the caller: to this side the stream may look
            # ended or broken, depending on timing. Only a caller that closed without sending is malformed.
            receiver.discard()
            if guard.cut_reason is None and isinstance(ended, StopIteration) and context.is_active():
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, "empty exchange stream")
            self.metrics.outcome(f"cut_{guard.cut_reason}" if guard.cut_reason else "aborted")
            return
        except PayloadError as error:
            self._refuse(context, error)
        assert receiver.manifest is not None
        partner = receiver.manifest.peer_id
        if self.node.refused_peer(partner):
            receiver.discard()
            self.metrics.outcome("refused_peer")
            context.abort(grpc.StatusCode.PERMISSION_DENIED, "refused: a recent payload from this peer was bad")
        started = time.monotonic()
        sent = 0

        def count_sent(n: int) -> None:
            nonlocal sent
            sent += n
            self.metrics.add_bytes(sent=n)

        def finish(outcome: str) -> None:
            self.metrics.record(
                peer=partner,
                role="served",
                outcome=outcome,
                seconds=time.monotonic() - started,
                sent=sent,
                received=receiver.bytes_received,
            )

        guard.progress = lambda: sent + receiver.bytes_received
        session = self.node.open_session(partner, receiver.manifest.outer_step)
        if session is None:
            receiver.discard()
            finish("busy")
            context.abort(grpc.StatusCode.ABORTED, f"{self.node.peer_id} is busy or not ready to pair")
        reader: threading.Thread | None = None
        try:
            outcome: dict[str, object] = {}

            def consume() -> None:
                try:
                    for frame in request_iterator:
                        receiver.feed(frame)
                    outcome["payload"] = receiver.finish()
                except PayloadError as error:
                    outcome["error"] = error
                except Exception as error:  # the stream broke (client gone, deadline): nothing to blend
                    outcome["broken"] = error

            reader = threading.Thread(target=consume, name="exchange-reader", daemon=True)
            reader.start()
            outgoing = session.outgoing()
            try:
                yield from iter_frames(
                    outgoing.manifest, outgoing.tensors, chunk_bytes=self.chunk_bytes, on_chunk=count_sent
                )
            except GeneratorExit:  # the caller went away while we were still sending
                finish(f"cut_{guard.cut_reason}" if guard.cut_reason else "aborted")
                raise
            remaining = context.time_remaining()
            limit = self.max_call_seconds if remaining is None else min(remaining, self.max_call_seconds)
            reader.join(timeout=max(0.0, limit))
            guard.transferred = True
            self.metrics.add_bytes(received=receiver.bytes_received)
            # A call the watchdog cancelled may look, to the reader, like a stream that simply ended early.
            if reader.is_alive() or "broken" in outcome or guard.cut_reason is not None:
                finish(f"cut_{guard.cut_reason}" if guard.cut_reason else "aborted")
                log.warning(
                    "exchange with %s aborted: the partner's payload did not arrive whole (%s)",
                    partner,
                    guard.cut_reason or outcome.get("broken", "deadline"),
                )
                context.abort(
                    grpc.StatusCode.DEADLINE_EXCEEDED if reader.is_alive() else grpc.StatusCode.CANCELLED,
                    "the partner's payload did not arrive whole",
                )
            if "error" not in outcome:
                try:
                    self.node.admit(outcome["payload"])  # type: ignore[arg-type]
                except PayloadError as error:
                    outcome["error"] = error
                    outcome.pop("payload").release()  # type: ignore[union-attr]
            if "error" in outcome:
                error = outcome["error"]
                assert isinstance(error, PayloadError)
                self.metrics.rejection(error.reason)
                if error.reason == "incomplete":
                    # The stream ended early: what a peer killed mid-exchange looks like from here. Refused, but
                    # not held against the peer (a restarted node must not find itself quarantined).
                    finish("aborted")
                else:
                    self.node.bad_payload(partner, error)
                    finish("refused_payload")
                context.abort(error.code, error.message)
            session.complete(outcome["payload"])  # type: ignore[arg-type]
            finish("completed")
        finally:
            session.release()
            if reader is None or not reader.is_alive():  # a reader still running owns the buffers until it stops
                receiver.discard()  # a no-op once the payload was handed over

    def GetState(self, raw: bytes, context: grpc.ServicerContext) -> Iterator[bytes]:  # noqa: N802
        request = _parse(pb.StateRequest, raw, context)
        if request.run_fingerprint != self.node.run_fingerprint:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"this peer trains run {self.node.run_fingerprint}")
        snapshot = self.node.state_snapshot()
        if snapshot is None:
            context.abort(grpc.StatusCode.UNAVAILABLE, "no outer-step snapshot to serve yet")
        if request.from_tensor and request.outer_step != snapshot.manifest.outer_step:
            context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"cannot resume a download of outer step {request.outer_step}: this snapshot is of outer step "
                f"{snapshot.manifest.outer_step}",
            )
        if request.from_tensor > len(snapshot.manifest.tensors) or (
            request.from_offset
            and (
                request.from_tensor >= len(snapshot.manifest.tensors)
                or request.from_offset % 4
                or request.from_offset >= snapshot.manifest.tensors[request.from_tensor].num_bytes
            )
        ):
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"cannot resume at tensor {request.from_tensor}, byte {request.from_offset}",
            )
        # Downloads are served from a snapshot (never blocking training) but cost CPU and bandwidth: a few at a time.
        if not self.downloads.acquire(blocking=False):
            self.metrics.outcome("download_busy")
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "busy: serving its maximum of state downloads")
        sent = 0

        def count_sent(n: int) -> None:
            nonlocal sent
            sent += n
            self.metrics.add_bytes(sent=n)

        # A joiner that stops reading must not hold a download slot (and a worker thread) until its own deadline.
        guard = self.watchdog.watch(
            context, limit=self.max_download_seconds, progress=lambda: sent, min_rate=self.min_link_rate
        )
        try:
            yield from iter_frames(
                snapshot.manifest,
                snapshot.tensors,
                chunk_bytes=self.chunk_bytes,
                on_chunk=count_sent,
                from_tensor=request.from_tensor,
                from_offset=request.from_offset,
            )
            self.metrics.outcome("download_served")
        except GeneratorExit:
            self.metrics.outcome(f"download_cut_{guard.cut_reason}" if guard.cut_reason else "download_aborted")
            raise
        finally:
            self.watchdog.release(guard)
            self.downloads.release()

    def Info(self, raw: bytes, context: grpc.ServicerContext) -> pb.InfoReply:  # noqa: N802
        _parse(pb.InfoRequest, raw, context)
        return self.node.info()


def _parse(message: Any, raw: bytes, context: grpc.ServicerContext) -> Any:
    """Requests are parsed here, not by grpc, so that garbage gets INVALID_ARGUMENT (grpc's own deserializer
    failing answers INTERNAL, which says nothing useful to the caller)."""
    try:
        return message.FromString(raw)
    except DecodeError:
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"malformed {message.DESCRIPTOR.name}")


def _handlers(service: PeerService) -> grpc.GenericRpcHandler:
    return grpc.method_handlers_generic_handler(
        SERVICE,
        {
            "Exchange": grpc.stream_stream_rpc_method_handler(service.Exchange),  # encoded frames both ways
            "GetState": grpc.unary_stream_rpc_method_handler(service.GetState),  # parsed by the handler
            "Info": grpc.unary_unary_rpc_method_handler(
                service.Info, response_serializer=pb.InfoReply.SerializeToString
            ),
        },
    )


def start_server(
    node: PeerNode,
    metrics: ExchangeMetrics,
    *,
    bind: str = "127.0.0.1:0",
    max_concurrent_calls: int = 8,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    max_call_seconds: float = 120.0,
    max_download_seconds: float = 600.0,
    max_state_downloads: int = 2,
    min_link_rate: float = 0.0,
    transport: Transport = PLAIN,
) -> tuple[grpc.Server, int]:
    """Start the service; returns the server and the port it bound (ephemeral when the bind port is 0).

    Calls beyond ``max_concurrent_calls`` get RESOURCE_EXHAUSTED from grpc itself; calls of a private run without
    a valid membership proof get UNAUTHENTICATED from the transport's interceptor before any handler runs.
    """
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=max_concurrent_calls, thread_name_prefix="grpc-peer"),
        options=CHANNEL_OPTIONS,
        maximum_concurrent_rpcs=max_concurrent_calls,
        interceptors=transport.interceptors(lambda reason: metrics.rejection(f"auth_{reason}")),
    )
    service = PeerService(
        node,
        metrics,
        chunk_bytes=chunk_bytes,
        max_call_seconds=max_call_seconds,
        max_download_seconds=max_download_seconds,
        max_state_downloads=max_state_downloads,
        min_link_rate=min_link_rate,
    )
    server.add_generic_rpc_handlers((_handlers(service),))
    port = transport.add_port(server, bind)
    if port == 0:
        raise OSError(f"could not bind the gRPC server to {bind}")
    server.start()
    return server, port


class ExchangeError(Exception):
    """An exchange that produced nothing to blend: refused, cut, timed out, or a bad payload from the partner."""

    def __init__(
        self, code: grpc.StatusCode, reason: str, message: str, *, bad_payload: PayloadError | None = None
    ) -> None:
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.reason = reason
        self.bad_payload = bad_payload  # set when the partner's payload was refused here (not by the partner)


def _receive(call: Any, receiver: PayloadReceiver, address: str, what: str, metrics: ExchangeMetrics | None) -> Payload:
    """Feed a response stream into its receiver; any failure becomes an ExchangeError naming the peer."""
    try:
        try:
            for frame in call:
                receiver.feed(frame)
            return receiver.finish()
        except BaseException:
            receiver.discard()  # nothing to blend: the buffers may take the next payload
            raise
    except PayloadError as error:
        call.cancel()
        if metrics is not None:
            metrics.rejection(error.reason)
        raise ExchangeError(
            error.code, error.reason, f"bad {what} from {address}: {error.message}", bad_payload=error
        ) from None
    except grpc.RpcError as error:
        code = error.code() if hasattr(error, "code") else grpc.StatusCode.UNKNOWN
        reason = "busy" if code == grpc.StatusCode.ABORTED else code.name.lower()
        details = error.details() if hasattr(error, "details") else str(error)
        raise ExchangeError(code, reason, f"{address}: {details}") from None


def exchange_with(
    address: str,
    outgoing: Outgoing,
    expected: Sequence[TensorLayout],
    *,
    run_fingerprint: str,
    max_payload_bytes: int,
    timeout: float,
    metrics: ExchangeMetrics | None = None,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    buffers: ReceiveBuffers | None = None,
    peer: str | None = None,
    transport: Transport = PLAIN,
) -> Payload:
    """Exchange payloads with the peer at ``address``; returns its verified payload or raises ExchangeError.

    Blocking (call it from a worker thread); the whole call, connection included, is bounded by ``timeout``. With
    ``metrics``, the exchange is recorded under ``peer`` (default: the address) whatever its outcome. In a private
    run not one frame is sent before the server has proved membership.
    """
    receiver = PayloadReceiver(
        expected, run_fingerprint=run_fingerprint, max_total_bytes=max_payload_bytes, buffers=buffers
    )
    started = time.monotonic()
    sent = 0

    def count_sent(n: int) -> None:
        nonlocal sent
        sent += n
        if metrics is not None:
            metrics.add_bytes(sent=n)

    outcome = "failed"
    try:
        with transport.channel(address) as channel:
            metadata, nonce = transport.sign(EXCHANGE_METHOD)
            checked, server_proved = threading.Event(), [False]

            def frames() -> Iterator[bytes]:
                # grpc pulls this from its own thread as soon as the call starts: hold the model back until the
                # server has proved membership (a private run's stranger must not receive a byte of it).
                if transport.authenticates and not (checked.wait(timeout) and server_proved[0]):
                    return
                yield from iter_frames(
                    outgoing.manifest, outgoing.tensors, chunk_bytes=chunk_bytes, on_chunk=count_sent
                )

            call = channel.stream_stream(EXCHANGE_METHOD)(frames(), timeout=timeout, metadata=metadata)
            if transport.authenticates:
                problem = _server_problem(transport, EXCHANGE_METHOD, nonce, call, address)
                server_proved[0] = problem is None
                checked.set()
                if problem is not None:
                    raise problem
            payload = _receive(call, receiver, address, "payload", metrics)
        outcome = "completed"
    except ExchangeError as error:
        outcome = "busy" if error.reason == "busy" else "failed"
        raise
    finally:
        if metrics is not None:
            metrics.add_bytes(received=receiver.bytes_received)
            metrics.record(
                peer=peer or address,
                role="caller",
                outcome=outcome,
                seconds=time.monotonic() - started,
                sent=sent,
                received=receiver.bytes_received,
            )
    log.debug("exchange with %s: %d bytes in %.3fs", address, receiver.bytes_received, time.monotonic() - started)
    return payload


def _server_problem(transport: Transport, method: str, nonce: str, call: Any, address: str) -> ExchangeError | None:
    """None when the server proved membership; else the error to raise. A server that refused us for want of a
    valid proof says UNAUTHENTICATED itself (another secret); any other server is not a member of the run."""
    problem = transport.server_problem(method, nonce, call)
    if problem is None:
        return None
    call.cancel()
    if call.code() == grpc.StatusCode.UNAUTHENTICATED:
        return ExchangeError(grpc.StatusCode.UNAUTHENTICATED, "unauthenticated", f"{address}: {call.details()}")
    return ExchangeError(grpc.StatusCode.UNAUTHENTICATED, "unauthenticated_peer", f"{address}: {problem}")


def fetch_info(address: str, *, timeout: float, transport: Transport = PLAIN) -> pb.InfoReply:
    metadata, nonce = transport.sign(INFO_METHOD)
    with transport.channel(address) as channel:
        reply, call = pb_grpc.PeerStub(channel).Info.with_call(pb.InfoRequest(), timeout=timeout, metadata=metadata)
        problem = transport.server_problem(INFO_METHOD, nonce, call)
        if problem is not None:
            raise ExchangeError(grpc.StatusCode.UNAUTHENTICATED, "unauthenticated_peer", f"{address}: {problem}")
        return reply


class StateDownload:
    """A joiner's download of a donor's outer-step snapshot, resumable chunk-wise from another donor.

    Every chunk is verified as it arrives; when a donor fails mid-transfer, what arrived is kept and the next donor
    is asked for the rest (from the tensor and byte where the first stopped), but only if its snapshot is of the
    same outer step (its counters must match too). The result then holds parts of two replicas of that step, which
    differ only by the swarm's replica spread; another step means starting over: a state is never stitched across
    steps.
    """

    def __init__(self, layout: Sequence[tuple[str, tuple[int, ...]]], *, run_fingerprint: str, peer_id: str) -> None:
        self.expected = [TensorLayout(name, tuple(shape)) for name, shape in layout]
        self.run_fingerprint = run_fingerprint
        self.peer_id = peer_id
        self.done: list = []  # leading tensors received, the last only in part when partial_bytes is not 0
        self.partial_bytes = 0
        self.counters: dict[str, int] | None = None  # of the snapshot being downloaded
        self.resumed = 0  # downloads that continued where another donor stopped

    def fetch(self, address: str, *, timeout: float, transport: Transport = PLAIN) -> tuple[dict, dict[str, int]]:
        """Download (the rest of) the snapshot from ``address``; returns the tensors and the counters, or raises
        ExchangeError with what is complete so far kept for the next donor."""
        max_bytes = sum(item.numel for item in self.expected) * 4 + 1024
        resuming = bool(self.done) and self.counters is not None
        receiver = PayloadReceiver(
            self.expected,
            run_fingerprint=self.run_fingerprint,
            max_total_bytes=max_bytes,
            allowed_dtypes=("fp32",),
            prefilled=self.done if resuming else (),
            prefilled_partial_bytes=self.partial_bytes if resuming else 0,
        )
        request = pb.StateRequest(
            run_fingerprint=self.run_fingerprint,
            peer_id=self.peer_id,
            from_tensor=len(self.done) - (1 if self.partial_bytes else 0) if resuming else 0,
            from_offset=self.partial_bytes if resuming else 0,
            outer_step=self.counters["outer_step"] if resuming and self.counters else 0,
        )
        try:
            with transport.channel(address) as channel:
                get_state = channel.unary_stream(GET_STATE_METHOD, request_serializer=pb.StateRequest.SerializeToString)
                metadata, nonce = transport.sign(GET_STATE_METHOD)
                call = get_state(request, timeout=timeout, metadata=metadata)
                if transport.authenticates:
                    problem = _server_problem(transport, GET_STATE_METHOD, nonce, call, address)
                    if problem is not None:
                        raise problem
                for frame in call:
                    had_manifest = receiver.manifest is not None
                    receiver.feed(frame)
                    if not had_manifest and receiver.manifest is not None:
                        self._check_counters(receiver.manifest, address, resuming)
                payload = receiver.finish()
        except PayloadError as error:
            if error.reason == "resume_mismatch":
                self.done, self.partial_bytes = [], 0
            else:
                self._keep(receiver)
            raise ExchangeError(error.code, error.reason, f"bad state from {address}: {error.message}") from None
        except grpc.RpcError as error:
            code = error.code() if hasattr(error, "code") else grpc.StatusCode.UNKNOWN
            if resuming and code == grpc.StatusCode.FAILED_PRECONDITION:  # its snapshot is of another step
                self.done, self.partial_bytes, self.counters = [], 0, None
            else:
                self._keep(receiver)
            reason = "busy" if code == grpc.StatusCode.RESOURCE_EXHAUSTED else code.name.lower()
            details = error.details() if hasattr(error, "details") else str(error)
            raise ExchangeError(code, reason, f"{address}: {details}") from None
        self.resumed += resuming
        assert self.counters is not None
        return payload.tensors, self.counters

    def _keep(self, receiver: PayloadReceiver) -> None:
        self.done, self.partial_bytes = receiver.received_so_far()

    def _check_counters(self, manifest: pb.Manifest, address: str, resuming: bool) -> None:
        try:
            metadata = json.loads(manifest.metadata_json)
            counters = {key: int(metadata[key]) for key in ("inner_step", "outer_step", "adam_step")}
        except (ValueError, KeyError, TypeError):
            raise PayloadError(
                grpc.StatusCode.INVALID_ARGUMENT, "metadata", f"bad state metadata from {address}"
            ) from None
        if min(counters.values()) < 0 or counters["outer_step"] != manifest.outer_step:
            raise PayloadError(grpc.StatusCode.INVALID_ARGUMENT, "metadata", f"inconsistent counters from {address}")
        if resuming and counters != self.counters:
            self.done, self.partial_bytes, self.counters = [], 0, None  # another step: start over elsewhere
            raise PayloadError(grpc.StatusCode.FAILED_PRECONDITION, "resume_mismatch", f"{address} moved on")
        self.counters = counters


def download_state(
    address: str,
    layout: Sequence[tuple[str, tuple[int, ...]]],
    *,
    run_fingerprint: str,
    peer_id: str,
    timeout: float,
) -> tuple[dict, dict]:
    """A joiner's download of a donor's whole outer-step snapshot: verified tensors and the counters."""
    return StateDownload(layout, run_fingerprint=run_fingerprint, peer_id=peer_id).fetch(address, timeout=timeout)
