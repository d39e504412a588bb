"""The gRPC service a node serves to its peers: weight exchange, state download (state_serving.py), peer info
(info_serving.py), rollouts (rollout_serving.py); the client is client.py.

``Exchange`` is a bidirectional stream: each side sends its payload (wire/frames.py) while it receives the other's.
Both directions run at once; a side that only wrote before reading would deadlock against HTTP/2 flow control
as soon as both payloads exceed the window. A side hands the partner's payload to its node (to blend) only once
the payload is complete and verified and both sides have committed to the exchange (the caller's ``Verdict`` on
the server's payload, then the server's acknowledgement); a stream cut at any byte leaves both nodes' state
untouched. With a proven caller both payloads are sealed (security/payload_seal.py): signed by their sender for
this call, so that a relay or proxy on the path can neither alter nor replace them undetected.

Refusals are fast and precise: a node that is busy or not ready answers ABORTED at once (the caller tries another
peer); a peer of another run gets FAILED_PRECONDITION; a malformed payload gets INVALID_ARGUMENT (or
RESOURCE_EXHAUSTED when oversized), and each refusal is counted by reason in :class:`ExchangeMetrics`.

The server uses grpc's synchronous API on a thread pool: handlers convert and copy tensors, which must never run
on the node's event loop, and on loopback the synchronous stack with 1 MiB chunks is the faster one. Every call
carries a deadline, and the server enforces its own whatever the caller asked for (transport.Watchdog: a limit per
call, a stall limit and a minimum transfer rate, against slow-loris callers), and admission.py decides who may
hold which slot: per kind of call, per proven peer, per remote address, and a bar on those whose calls stalled.
Channels, TLS and the membership proofs of a private run come from transport.py; a verified payload must still pass the
node's own admission check (the norm bound of payload_guard.py) before it is blended.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from typing import NoReturn

import grpc

from noloco_node.rpc.admission import DOWNLOAD, EXCHANGE, INFO, RECEIPTS, ROLLOUTS, Admission
from noloco_node.rpc.call_gate import CallGate, abort
from noloco_node.rpc.contracts import (
    EXCHANGE_METHOD,
    OUTER_STEP_HEADER,
    SERVICE,
    OutgoingPayload,
    OutOfReachError,
    PeerNode,
)
from noloco_node.rpc.info_serving import InfoServing
from noloco_node.rpc.metrics import ExchangeMetrics
from noloco_node.rpc.receipt_serving import ReceiptServing
from noloco_node.rpc.rollout_serving import RolloutServing, RolloutSource
from noloco_node.rpc.state_serving import StateServing
from noloco_node.rpc.transport import CHANNEL_OPTIONS, PLAIN, GuardedCall, Transport, Watchdog
from noloco_node.security.caller_proof import CallerVerifier
from noloco_node.security.identity import NodeIdentity
from noloco_node.security.payload_seal import PayloadSeal, call_binding
from noloco_node.security.receipts import Receipt, ReceiptBook, ReceiptDraft, ReceiptError, acceptable_time, terms_of
from noloco_node.wire import peer_pb2 as pb
from noloco_node.wire.frames import DEFAULT_CHUNK_BYTES, PayloadError, iter_frames, read_verdict, verdict_frame
from noloco_node.wire.payload import Payload, PayloadReceiver

log = logging.getLogger(__name__)

INFO_SLOTS = 4  # Info answers in milliseconds (a dial-back within seconds): a few slots keep it answerable
ROLLOUT_SLOTS = 4  # GetRollouts replies are prepared in advance: a lookup, then a few KiB to send
RECEIPT_SLOTS = 2  # a GetReceipts page is a seek and at most RECEIPTS_PAGE lines read
REFUSAL_THREADS = 8
HANDSHAKE_SECONDS = 5.0  # a TCP connection that says nothing is closed after this
IDLE_CONNECTION_SECONDS = 300.0
# How long a server waits, once both payloads have crossed, for the caller's verdict on its payload: the caller's
# own check of a payload it has already received takes well under this, and the pairing round is held meanwhile.
VERDICT_SECONDS = 10.0


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
        stall_seconds: float = 0.0,
        watchdog: Watchdog | None = None,
        verifier: CallerVerifier | None = None,
        admission: Admission | None = None,
        origin: Callable[[str], str | None] = lambda _peer: None,
        identity: NodeIdentity | None = None,
        rollouts: RolloutSource | None = None,
        receipts: ReceiptBook | None = None,
    ) -> None:
        self.node = node
        self.identity = identity  # seals this node's payloads (with a verifier: every proven caller's call)
        self.receipts = receipts  # where the receipts of served exchanges go, and are served from (GetReceipts)
        self.metrics = metrics
        self.gate = CallGate(
            metrics,
            admission
            or Admission(
                slots={
                    EXCHANGE: 8,
                    DOWNLOAD: max_state_downloads,
                    INFO: INFO_SLOTS,
                    ROLLOUTS: ROLLOUT_SLOTS,
                    RECEIPTS: RECEIPT_SLOTS,
                },
                per_address=8,
            ),
            verifier=verifier,
            watchdog=watchdog,
            min_link_rate=min_link_rate,
            stall_seconds=stall_seconds,
            origin=origin,
        )
        self.admission = self.gate.admission
        self.chunk_bytes = chunk_bytes
        self.max_call_seconds = max_call_seconds
        self.state = StateServing(node, self.gate, chunk_bytes=chunk_bytes, max_download_seconds=max_download_seconds)
        self.info = InfoServing(node, self.gate)
        self.rollouts = RolloutServing(rollouts, self.gate)
        self.receipt_serving = ReceiptServing(receipts, node, self.gate)

    def _seal(self, proven: str | None, context: grpc.ServicerContext) -> PayloadSeal | None:
        """The seals of a call whose caller proved its id (security/payload_seal.py): the caller's payload must be
        signed by it for this call, and this node signs its own for the caller."""
        binding = call_binding(context.invocation_metadata())
        if proven is None or self.identity is None or not binding:
            return None
        return PayloadSeal(self.identity, peer=proven, binding=binding)

    def _receiver(self, seal: PayloadSeal | None) -> PayloadReceiver:
        observer = self.node.value_observer()  # holds the latest published state until closed
        try:
            return PayloadReceiver(
                (),
                kinds=self.node.payload_kinds(),
                run_fingerprint=self.node.run_fingerprint,
                max_total_bytes=self.node.max_payload_bytes(),
                buffers=self.node.receive_buffers,
                observer=observer,
                seal_check=seal.check if seal is not None else None,
            )
        except BaseException:
            if observer is not None:
                observer.close()
            raise

    def _refuse(self, context: grpc.ServicerContext, error: PayloadError) -> NoReturn:
        self.metrics.rejection(error.reason)
        self.metrics.outcome("refused_payload")
        abort(context, error.code, error.message)

    def Exchange(self, request_iterator: Iterator[bytes], context: grpc.ServicerContext) -> Iterator[bytes]:  # noqa: N802
        proven = self.gate.caller(EXCHANGE_METHOD, context, required=True)
        ticket = self.gate.admit(EXCHANGE, context, proven)
        receiver: PayloadReceiver | None = None
        guard: GuardedCall | None = None
        try:  # whatever raises from here on, the slot (and what the observer holds) is given back
            seal = self._seal(proven, context)
            receiver = self._receiver(seal)
            guard = self.gate.watch(
                context,
                ticket,
                limit=self.max_call_seconds,
                progress=lambda: receiver.bytes_received if receiver is not None else 0,
            )
            yield from self._exchange(request_iterator, context, receiver, guard, proven, seal)
        finally:
            if receiver is not None:
                receiver.release_observer()
            if guard is not None:
                self.gate.leave(ticket, guard)
            else:
                self.gate.admission.leave(ticket)

    def _exchange(
        self,
        request_iterator: Iterator[bytes],
        context: grpc.ServicerContext,
        receiver: PayloadReceiver,
        guard: GuardedCall,
        proven: str | None,
        seal: PayloadSeal | None,
    ) -> Iterator[bytes]:
        try:
            first = next(request_iterator)
            receiver.feed(first)  # the manifest: run, names, shapes and sizes are checked before anything else
        except (StopIteration, grpc.RpcError) as ended:
            # Cancelled by the watchdog (no manifest in time) or by the caller: to this side the stream may look
            # ended or broken, depending on timing. Only a caller that closed without sending is malformed.
            receiver.discard()
            if guard.cut_reason is None and isinstance(ended, StopIteration) and context.is_active():
                abort(context, grpc.StatusCode.INVALID_ARGUMENT, "empty exchange stream")
            self.metrics.outcome(f"cut_{guard.cut_reason}" if guard.cut_reason else "aborted")
            return
        except PayloadError as error:
            self._refuse(context, error)
        assert receiver.manifest is not None
        partner = receiver.manifest.peer_id if proven is None else proven
        if receiver.manifest.peer_id != partner:
            # A payload under another peer's name: refused, and held against the one who sent it, never against
            # the peer it named (who may be honest and not even know).
            receiver.discard()
            spoofed = PayloadError(
                grpc.StatusCode.PERMISSION_DENIED,
                "spoofed_peer_id",
                f"the manifest names peer {receiver.manifest.peer_id[:24]!r}, but the caller proved it is {partner}",
            )
            self.node.bad_payload(partner, spoofed)
            self._refuse(context, spoofed)
        if self.node.refused_peer(partner):
            receiver.discard()
            self.metrics.outcome("refused_peer")
            abort(context, grpc.StatusCode.PERMISSION_DENIED, "refused: a recent payload from this peer was bad")
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
        assert receiver.kind is not None
        try:
            session = self.node.open_session(partner, receiver.manifest.outer_step, receiver.kind.name)
        except OutOfReachError as far:
            receiver.discard()
            finish("out_of_reach")
            context.set_trailing_metadata(((OUTER_STEP_HEADER, str(far.outer_step)),))
            abort(context, grpc.StatusCode.OUT_OF_RANGE, str(far))
        if session is None:
            receiver.discard()
            finish("busy")
            abort(context, grpc.StatusCode.ABORTED, f"{self.node.peer_id} is busy or not ready to pair")
        reader: threading.Thread | None = None
        try:
            outcome: dict[str, object] = {}
            verdict_heard = threading.Event()

            def consume() -> None:
                """The caller's payload, then its verdict on ours (the frame after its end)."""
                try:
                    for frame in request_iterator:
                        if receiver.ended:
                            outcome["verdict"] = read_verdict(frame)
                            break
                        receiver.feed(frame)
                        if receiver.ended:
                            outcome["payload"] = receiver.finish()
                            payload_heard.set()
                    else:
                        if "payload" not in outcome:
                            outcome["payload"] = receiver.finish()  # raises: the end never came
                except PayloadError as error:
                    outcome["error"] = error
                except Exception as error:  # the stream broke (client gone, deadline): nothing to blend
                    outcome["broken"] = error
                finally:
                    payload_heard.set()
                    verdict_heard.set()

            payload_heard = threading.Event()
            reader = threading.Thread(target=consume, name="exchange-reader", daemon=True)
            reader.start()
            outgoing = session.outgoing()
            try:
                yield from iter_frames(
                    outgoing.manifest,
                    outgoing.tensors,
                    chunk_bytes=self.chunk_bytes,
                    on_chunk=count_sent,
                    signer=seal.sign if seal is not None else None,
                )
            except GeneratorExit:  # the caller went away while we were still sending
                finish(f"cut_{guard.cut_reason}" if guard.cut_reason else "aborted")
                raise
            remaining = context.time_remaining()
            limit = self.max_call_seconds if remaining is None else min(remaining, self.max_call_seconds)
            payload_heard.wait(timeout=max(0.0, limit))
            guard.transferred = True
            self.metrics.add_bytes(received=receiver.bytes_received)
            # A call the watchdog cancelled may look, to the reader, like a stream that simply ended early.
            if not payload_heard.is_set() or "broken" in outcome or guard.cut_reason is not None:
                finish(f"cut_{guard.cut_reason}" if guard.cut_reason else "aborted")
                log.warning(
                    "exchange with %s aborted: the partner's payload did not arrive whole (%s)",
                    partner,
                    guard.cut_reason or outcome.get("broken", "deadline"),
                )
                abort(
                    context,
                    grpc.StatusCode.DEADLINE_EXCEEDED if not payload_heard.is_set() else grpc.StatusCode.CANCELLED,
                    "the partner's payload did not arrive whole",
                )
            received, problem = outcome.get("payload"), outcome.get("error")
            if isinstance(received, Payload):
                if problem is not None:
                    received.release()  # a garbled verdict after a good payload: the payload is let go
                else:
                    try:
                        received = self.node.admit(received)
                    except PayloadError as refused:
                        problem = refused
                        received.release()
            if isinstance(problem, PayloadError):
                self.metrics.rejection(problem.reason)
                if not problem.blames_sender:
                    finish("aborted")
                else:
                    self.node.bad_payload(partner, problem)
                    finish("refused_payload")
                abort(context, problem.code, problem.message)
            assert isinstance(received, Payload)
            # Both payloads have crossed and this side admits the caller's: the caller's verdict on ours decides.
            # It needs no more than the caller's own check of our payload; a caller that keeps us waiting longer
            # holds the pairing round, so the wait is bounded.
            remaining = context.time_remaining()
            verdict_heard.wait(timeout=min(VERDICT_SECONDS, limit if remaining is None else remaining))
            verdict = outcome.get("verdict")
            if not isinstance(verdict, pb.Verdict) or not verdict.commit:
                received.release()
                why = verdict.reason if isinstance(verdict, pb.Verdict) else "no verdict in time"
                finish("not_committed")
                abort(context, grpc.StatusCode.ABORTED, f"the caller did not commit: {why}"[:300])
            receipt = self._countersign(seal, verdict, receiver, outgoing, received)
            if not session.complete(received):  # the round closed meanwhile: the payload was let go
                finish("not_committed")
                yield verdict_frame(commit=False, reason="this node's round closed before the commit")
                return
            finish("completed")
            if receipt is not None and self.receipts is not None:
                self.receipts.add(receipt)
                self.metrics.receipt("kept")
            signature = receipt.server_signature.encode() if receipt is not None else b""
            # The acknowledgement: the caller blends on it, and keeps the receipt it countersigns.
            yield verdict_frame(commit=True, receipt_signature=signature, receipt_time=verdict.receipt_time)
        finally:
            session.release()
            if reader is None or not reader.is_alive():  # a reader still running owns the buffers until it stops
                receiver.discard()  # a no-op once the payload was handed over

    def _countersign(
        self,
        seal: PayloadSeal | None,
        verdict: pb.Verdict,
        receiver: PayloadReceiver,
        outgoing: OutgoingPayload,
        received: Payload,
    ) -> Receipt | None:
        """The exchange's receipt, signed by the caller in its commit and now by this side; None when the exchange
        is unsealed, the caller signed none, or its signature or named time is refused (counted by why)."""
        if seal is None or self.receipts is None or not seal.received_digest:
            return None
        if not verdict.receipt_signature:
            self.metrics.receipt("unsigned")
            return None
        assert self.gate.verifier is not None  # a sealed call is a proven caller's
        if not acceptable_time(verdict.receipt_time, self.gate.verifier.max_clock_skew):
            self.metrics.receipt("refused_time")
            return None
        assert receiver.kind is not None
        terms = terms_of(
            seal,
            caller_side=False,
            run=self.node.run_fingerprint,
            kind=receiver.kind.name,
            own=outgoing.manifest,
            peer=received.manifest,
            named_time=verdict.receipt_time,
        )
        draft = ReceiptDraft.sign(seal.identity, terms, seal.peer_key, caller_side=False)
        try:
            receipt = draft.countersigned(verdict.receipt_signature)
        except ReceiptError as refused:
            self.metrics.receipt(f"refused_{refused.reason}")
            return None
        return receipt


def _handlers(service: PeerService) -> grpc.GenericRpcHandler:
    return grpc.method_handlers_generic_handler(
        SERVICE,
        {
            "Exchange": grpc.stream_stream_rpc_method_handler(service.Exchange),  # encoded frames both ways
            "GetState": grpc.unary_stream_rpc_method_handler(service.state.GetState),  # parsed by the handler
            "Info": grpc.unary_unary_rpc_method_handler(
                service.info.Info, response_serializer=pb.InfoReply.SerializeToString
            ),
            "GetRollouts": grpc.unary_unary_rpc_method_handler(
                service.rollouts.GetRollouts, response_serializer=pb.RolloutBatch.SerializeToString
            ),
            "GetReceipts": grpc.unary_unary_rpc_method_handler(
                service.receipt_serving.GetReceipts, response_serializer=pb.ReceiptsPage.SerializeToString
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
    stall_seconds: float = 0.0,
    max_calls_per_address: int = 8,
    max_connections: int = 1024,
    transport: Transport = PLAIN,
    verifier: CallerVerifier | None = None,
    origin: Callable[[str], str | None] = lambda _peer: None,
    rollouts: RolloutSource | None = None,
    receipts: ReceiptBook | None = None,
) -> tuple[grpc.Server, int]:
    """Start the service; returns the server and the port it bound (ephemeral when the bind port is 0).

    Exchanges beyond ``max_concurrent_calls``, downloads beyond ``max_state_downloads`` and Info calls beyond
    ``INFO_SLOTS`` are refused with RESOURCE_EXHAUSTED by admission.py, each kind in its own slots; calls of a
    private run without a valid membership proof get UNAUTHENTICATED from the transport's interceptor before any
    handler runs. Connections are bounded too (file descriptors): at most ``max_connections`` open, one that has
    not finished its HTTP/2 handshake within ``HANDSHAKE_SECONDS`` is closed, and one with no call for
    ``IDLE_CONNECTION_SECONDS`` as well (a peer's pooled channel reconnects by itself).
    """
    admission = Admission(
        slots={
            EXCHANGE: max_concurrent_calls,
            DOWNLOAD: max_state_downloads,
            INFO: INFO_SLOTS,
            ROLLOUTS: ROLLOUT_SLOTS,
            RECEIPTS: RECEIPT_SLOTS,
        },
        per_address=max_calls_per_address,
    )
    # Every admitted call holds a thread; refusals are quick but need one too, hence the margin.
    threads = max_concurrent_calls + max_state_downloads + INFO_SLOTS + ROLLOUT_SLOTS + RECEIPT_SLOTS + REFUSAL_THREADS
    options = [
        *CHANNEL_OPTIONS,
        ("grpc.max_allowed_incoming_connections", max_connections),
        ("grpc.server_handshake_timeout_ms", int(HANDSHAKE_SECONDS * 1000)),
        ("grpc.max_connection_idle_ms", int(IDLE_CONNECTION_SECONDS * 1000)),
    ]
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=threads, thread_name_prefix="grpc-peer"),
        options=options,
        maximum_concurrent_rpcs=threads,
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
        stall_seconds=stall_seconds,
        verifier=verifier,
        admission=admission,
        origin=origin,
        identity=transport.identity,
        rollouts=rollouts,
        receipts=receipts,
    )
    server.add_generic_rpc_handlers((_handlers(service),))
    port = transport.add_port(server, bind)
    if port == 0:
        raise OSError(f"could not bind the gRPC server to {bind}")
    server.start()
    return server, port
