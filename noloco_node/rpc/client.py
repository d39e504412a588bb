"""The client side of the peer service: exchange payloads with a peer, ask a peer for its Info.

Every call is bounded by its deadline, connection included. In a private run not one frame is sent before the
server has proved membership; a call to a known peer carries this node's proof of its own identity, made for that
peer alone (security/caller_proof.py), and the peer's answer must come from the peer id that was dialled.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import grpc

from noloco_node.errors import NolocoError
from noloco_node.rpc.contracts import (
    EXCHANGE_METHOD,
    GET_RECEIPTS_METHOD,
    GET_ROLLOUTS_METHOD,
    INFO_METHOD,
    OUTER_STEP_HEADER,
    OutgoingPayload,
)
from noloco_node.rpc.metrics import ExchangeMetrics
from noloco_node.rpc.transport import PLAIN, Transport
from noloco_node.security.payload_seal import PayloadSeal, call_binding
from noloco_node.security.receipts import Receipt, ReceiptDraft, ReceiptError, terms_of
from noloco_node.wire import peer_pb2 as pb
from noloco_node.wire import peer_pb2_grpc as pb_grpc
from noloco_node.wire.frames import (
    DEFAULT_CHUNK_BYTES,
    PayloadError,
    PayloadKind,
    TensorLayout,
    iter_frames,
    read_verdict,
    verdict_frame,
)
from noloco_node.wire.payload import Payload, PayloadReceiver, ValueObserver
from noloco_node.wire.receive_buffers import ReceiveBuffers

log = logging.getLogger(__name__)


class CallOwner:
    """The handle by which whoever waits for a blocking call (an exchange on a worker thread) ends it when it stops
    waiting: ``cancel`` cancels the gRPC call at once, or, before the call has started, makes it end as it starts.
    Without it a waiter that timed out or was cancelled left its thread blocked in gRPC until the call's own
    deadline (an exchange pool's few threads then had no room, and a stopping node waited on them)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._call: Any = None
        self.cancelled = False

    def attach(self, call: Any) -> None:
        """The call has started: ``cancel`` now ends it (at once, if it came first)."""
        with self._lock:
            self._call = call
            cancelled = self.cancelled
        if cancelled:
            call.cancel()

    def cancel(self) -> None:
        with self._lock:
            self.cancelled = True
            call = self._call
        if call is not None:
            call.cancel()


@dataclass
class Outgoing:
    """A static payload (benchmarks, tests, tools): a manifest and tensors that nothing ever writes, so holding it
    for a stream costs nothing. A node's own payloads are wire/published.py copies instead."""

    manifest: pb.Manifest
    tensors: Sequence

    def hold(self) -> bool:
        return True

    def release(self) -> None:
        return None


class ExchangeError(NolocoError):
    """An exchange that produced nothing to blend: refused, cut, timed out, or a bad payload from the partner."""

    def __init__(
        self,
        code: grpc.StatusCode,
        reason: str,
        message: str,
        *,
        bad_payload: PayloadError | None = None,
        peer_outer_step: int | None = None,
    ) -> None:
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.reason = reason
        self.bad_payload = bad_payload  # set when the partner's payload was refused here (not by the partner)
        self.peer_outer_step = peer_outer_step  # the partner's outer step, when it refused this node as out of reach


def _receive(
    responses: Iterator[bytes],
    call: Any,
    receiver: PayloadReceiver,
    address: str,
    what: str,
    metrics: ExchangeMetrics | None,
    on_first: Callable[[], None] | None = None,
) -> Payload:
    """Feed a response stream into its receiver up to the payload's end; any failure becomes an ExchangeError
    naming the peer. ``on_first`` runs when the first frame (the peer's manifest) has arrived."""
    try:
        try:
            for frame in responses:
                receiver.feed(frame)
                if on_first is not None:
                    on_first()
                    on_first = None
                if receiver.ended:
                    break
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
        raise _call_error(error, address) from None


def _call_error(error: grpc.RpcError, address: str, reason: str | None = None) -> ExchangeError:
    code = error.code() if hasattr(error, "code") else grpc.StatusCode.UNKNOWN
    details = error.details() if hasattr(error, "details") else str(error)
    if code == grpc.StatusCode.OUT_OF_RANGE:
        return ExchangeError(code, "out_of_reach", f"{address}: {details}", peer_outer_step=_outer_step_of(error))
    reason = reason or ("busy" if code == grpc.StatusCode.ABORTED else code.name.lower())
    return ExchangeError(code, reason, f"{address}: {details}")


def _outer_step_of(error: grpc.RpcError) -> int | None:
    """The outer step an out-of-reach refusal carries (a stranger's server may send anything: None if absent)."""
    trailing = error.trailing_metadata() if hasattr(error, "trailing_metadata") else None
    for key, value in trailing or ():
        if key == OUTER_STEP_HEADER and isinstance(value, str) and value.isdigit() and len(value) < 19:
            return int(value)
    return None


# The outcome of an exchange the called peer refused outright (PERMISSION_DENIED): it holds this node quarantined
# for a bad payload, or in a private run did not accept its proof. Counted apart: many refusing peers are an alert.
REFUSED = "refused"
# The reason of an exchange whose acknowledgement never came (the call ended otherwise after this side's commit):
# the server may or may not have blended. Counted as an outcome: the round goes on as if nothing crossed (a solo
# step here; the server may have blended this side's payload, once, as any partner's).
UNACKNOWLEDGED = "unacknowledged"
# How a call ends when the path or the server failed rather than the server deciding: after this side's commit, in
# doubt. Every other status is one the server sent on purpose before blending (a refusal of this side's payload,
# a verdict it did not hear in time).
_IN_DOUBT = {
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.CANCELLED,
    grpc.StatusCode.UNKNOWN,
    grpc.StatusCode.INTERNAL,
    grpc.StatusCode.DATA_LOSS,
}


def _acknowledged(responses: Iterator[bytes], call: Any, address: str) -> pb.Verdict:
    """The server's acknowledgement of this side's commit (it has blended): or ExchangeError, and nothing blends.
    A server whose round closed before the commit says so (``busy``: it could not pair now, nothing failed); one
    that refused this side's payload or did not hear the verdict in time ends the call with a status
    (``not_committed``, or the refusal's own reason). A call that ended otherwise after the commit (cut, timed out,
    cancelled, garbled) is ``UNACKNOWLEDGED``: whether the server blended is not known here."""
    try:
        ack = read_verdict(next(responses))
    except StopIteration:
        raise ExchangeError(
            grpc.StatusCode.ABORTED, "not_committed", f"{address} ended without acknowledging"
        ) from None
    except grpc.RpcError as error:
        in_doubt = not hasattr(error, "code") or error.code() in _IN_DOUBT
        raise _call_error(error, address, UNACKNOWLEDGED if in_doubt else "not_committed") from None
    except PayloadError as error:
        call.cancel()
        raise ExchangeError(error.code, UNACKNOWLEDGED, f"{address}: {error.message}") from None
    if not ack.commit:
        raise ExchangeError(grpc.StatusCode.ABORTED, "busy", f"{address} did not commit: {ack.reason}")
    return ack


def _draft_receipt(
    seal: PayloadSeal | None, receiver: PayloadReceiver, outgoing: OutgoingPayload, payload: Payload, run: str
) -> ReceiptDraft | None:
    """This side's signed part of the exchange's receipt (security/receipts.py), sent with its commit; None in an
    unsealed exchange, which proves nothing to a third party."""
    if seal is None or not seal.received_digest:
        return None
    terms = terms_of(
        seal,
        caller_side=True,
        run=run,
        kind=receiver.kind.name if receiver.kind is not None else "",
        own=outgoing.manifest,
        peer=payload.manifest,
        named_time=int(time.time()),
    )
    return ReceiptDraft.sign(seal.identity, terms, seal.peer_key, caller_side=True)


def _keep_receipt(
    draft: ReceiptDraft, ack: pb.Verdict, keep: Callable[[Receipt], None], metrics: ExchangeMetrics | None
) -> None:
    """The receipt both sides signed, kept; a committed exchange whose server signed nothing valid leaves none
    (counted by why: the blend stands, it is only not provable)."""
    try:
        receipt = draft.countersigned(ack.receipt_signature) if ack.receipt_signature else None
    except ReceiptError as refused:
        log.warning("the receipt of an exchange with %s is not countersigned: %s", draft.terms.server, refused)
        outcome = f"refused_{refused.reason}"
    else:
        outcome = "kept" if receipt is not None else "unsigned"
        if receipt is not None:
            keep(receipt)
    if metrics is not None:
        metrics.receipt(outcome)


def exchange_with(
    address: str,
    outgoing: OutgoingPayload,
    expected: Sequence[TensorLayout],
    *,
    answers: Sequence[PayloadKind] = (),
    run_fingerprint: str,
    max_payload_bytes: int,
    timeout: float,
    wire_dtype: str | None = None,
    metrics: ExchangeMetrics | None = None,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    buffers: ReceiveBuffers | None = None,
    peer: str | None = None,
    transport: Transport = PLAIN,
    observer: ValueObserver | None = None,
    admit: Callable[[Payload], Payload] | None = None,
    owner: CallOwner | None = None,
    receipts: Callable[[Receipt], None] | None = None,
) -> Payload:
    """Exchange payloads with the peer at ``address``; returns its verified payload or raises ExchangeError.

    The exchange commits on both sides or on neither (proto ``Verdict``): once the peer's payload is here, ``admit``
    checks it (it returns the payload to blend, or raises PayloadError); this side then sends its commit (or its
    refusal, and raises) and returns the payload only on the peer's acknowledgement, which the peer sends after it
    has blended with this side's payload. The one case left is an acknowledgement lost on its way back: then the
    peer may have blended and this side has not (ExchangeError ``UNACKNOWLEDGED``).

    With ``receipts``, a sealed exchange's commit signs its receipt (security/receipts.py) and the receipt the peer
    countersigns in its acknowledgement is handed to ``receipts``.

    ``answers``: the kinds of payload the peer may answer with (wire/frames.py ``PayloadKind``), when more than
    ``expected`` (in the kind's wire dtype) may.

    Blocking (call it from a worker thread); the whole call, connection included, is bounded by ``timeout``, and
    ``owner`` (CallOwner) ends it sooner when its waiter gives up (it raises ExchangeError CANCELLED then). With
    ``metrics``, the exchange is recorded under ``peer`` (default: the address) whatever its outcome. In a private
    run not one frame is sent before the server has proved membership.

    Only the manifest goes out before the peer accepts: the chunks follow its own manifest, which it sends once it
    has opened the exchange. A refusal (busy, not ready) thus costs one round trip and a few hundred bytes, not a
    flow-control window of weights. On a slow link the difference decides whether a round pairs at all: with the
    payload sent at once, eight nodes at 0.33 Mbit/s calling each other filled their links with the weights of
    refused calls, behind which every answer queued, and blended 4 of 32 outer steps (bench race).
    """
    metadata, nonce = transport.sign(EXCHANGE_METHOD, peer or "")
    # Both payloads are sealed (security/payload_seal.py) whenever this node proves who it is to a known peer: what
    # it receives must be that peer's, signed for this call, whatever path the bytes took.
    seal = (
        PayloadSeal(transport.identity, peer=peer, binding=call_binding(metadata))
        if transport.identity is not None and peer
        else None
    )
    receiver = PayloadReceiver(
        expected,
        kinds=answers,
        run_fingerprint=run_fingerprint,
        max_total_bytes=max_payload_bytes,
        allowed_dtypes=(wire_dtype,) if wire_dtype else ("bf16", "fp32"),
        buffers=buffers,
        observer=observer,
        seal_check=seal.check if seal is not None else None,
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
            checked, server_proved = threading.Event(), [False]
            answered, accepted = threading.Event(), [False]
            decided = threading.Event()
            all_sent = threading.Event()  # this side's payload is out, end frame (and its seal's digest) included
            verdict: list[bytes] = []  # this side's verdict on the peer's payload, once checked

            def frames() -> Iterator[bytes]:
                # grpc pulls this from its own thread as soon as the call starts: hold the model back until the
                # server has proved membership (a private run's stranger must not receive a byte of it).
                if transport.authenticates and not (checked.wait(timeout) and server_proved[0]):
                    return
                encoded = iter_frames(
                    outgoing.manifest,
                    outgoing.tensors,
                    chunk_bytes=chunk_bytes,
                    on_chunk=count_sent,
                    signer=seal.sign if seal is not None else None,
                )
                yield next(encoded)  # the manifest: the peer decides on it
                if answered.wait(timeout) and accepted[0]:
                    yield from encoded
                    all_sent.set()
                    if decided.wait(timeout) and verdict:
                        yield verdict[0]

            def accept() -> None:
                accepted[0] = True
                answered.set()

            call = channel.stream_stream(EXCHANGE_METHOD)(frames(), timeout=timeout, metadata=metadata)
            if owner is not None:
                owner.attach(call)
            try:
                if transport.authenticates:
                    problem = server_problem(transport, EXCHANGE_METHOD, nonce, call, address)
                    server_proved[0] = problem is None
                    checked.set()
                    if problem is not None:
                        raise problem
                responses = iter(call)
                payload = _receive(responses, call, receiver, address, "payload", metrics, on_first=accept)
                try:
                    payload = _checked(payload, peer, address, admit, metrics)
                except ExchangeError as refused:
                    verdict.append(verdict_frame(commit=False, reason=refused.reason))
                    decided.set()
                    raise
                # The receipt names both payloads' digests; this side's is known once its end frame is made, which
                # the peer's whole payload arriving does not wait for.
                signs = receipts is not None and all_sent.wait(timeout)
                draft = _draft_receipt(seal, receiver, outgoing, payload, run_fingerprint) if signs else None
                signed = (draft.own_signature, draft.terms.time) if draft is not None else (b"", 0)
                verdict.append(verdict_frame(commit=True, receipt_signature=signed[0], receipt_time=signed[1]))
                decided.set()
                try:
                    ack = _acknowledged(responses, call, address)
                except ExchangeError:
                    payload.release()
                    raise
                if draft is not None and receipts is not None:
                    _keep_receipt(draft, ack, receipts, metrics)
            finally:
                checked.set()
                answered.set()  # however the call ended: the sending thread stops waiting
                decided.set()
                all_sent.set()
        outcome = "completed"
    except ExchangeError as error:
        outcome = error.reason if error.reason in ("busy", UNACKNOWLEDGED) else "failed"
        if error.reason == "permission_denied":
            outcome = REFUSED  # the peer holds this node quarantined (or, in a private run, unproven)
        raise
    finally:
        receiver.release_observer()
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


def _checked(
    payload: Payload,
    peer: str | None,
    address: str,
    admit: Callable[[Payload], Payload] | None,
    metrics: ExchangeMetrics | None,
) -> Payload:
    """The peer's payload as this side will blend it, or ExchangeError (the payload released)."""
    if peer is not None and payload.peer_id != peer:
        # The DHT record that led here was signed by ``peer``; whoever answers at its address is someone else
        # (a restarted process on a reused port, or an impostor): its payload is not the partner's.
        payload.release()
        raise ExchangeError(
            grpc.StatusCode.PERMISSION_DENIED, "wrong_peer", f"{address} answered as {payload.peer_id}, not {peer}"
        )
    if admit is None:
        return payload
    try:
        return admit(payload)
    except PayloadError as error:
        payload.release()
        if metrics is not None:
            metrics.rejection(error.reason)
        raise ExchangeError(error.code, error.reason, error.message, bad_payload=error) from None


def server_problem(transport: Transport, method: str, nonce: str, call: Any, address: str) -> ExchangeError | None:
    """None when the server proved membership; else the error to raise. A server that refused us for want of a
    valid proof says UNAUTHENTICATED itself (another secret); any other server is not a member of the run."""
    problem = transport.server_problem(method, nonce, call)
    if problem is None:
        return None
    call.cancel()
    if call.code() == grpc.StatusCode.UNAUTHENTICATED:
        return ExchangeError(grpc.StatusCode.UNAUTHENTICATED, "unauthenticated", f"{address}: {call.details()}")
    return ExchangeError(grpc.StatusCode.UNAUTHENTICATED, "unauthenticated_peer", f"{address}: {problem}")


def _unary(address: str, method: str, request: Any, *, timeout: float, transport: Transport, peer_id: str) -> Any:
    """One unary call of ``method`` to the node ``peer_id`` at ``address``, with the proofs made for that node alone;
    its reply once the server has proved membership (a private run)."""
    metadata, nonce = transport.sign(method, peer_id)
    with transport.channel(address) as channel:
        stub = getattr(pb_grpc.PeerStub(channel), method.rsplit("/", 1)[1])
        reply, call = stub.with_call(request, timeout=timeout, metadata=metadata)
        problem = transport.server_problem(method, nonce, call)
        if problem is not None:
            raise ExchangeError(grpc.StatusCode.UNAUTHENTICATED, "unauthenticated_peer", f"{address}: {problem}")
        return reply


def fetch_info(address: str, *, timeout: float, transport: Transport = PLAIN, peer_id: str = "") -> pb.InfoReply:
    """The Info of the node ``peer_id`` at ``address``."""
    return _unary(address, INFO_METHOD, pb.InfoRequest(), timeout=timeout, transport=transport, peer_id=peer_id)


def fetch_rollouts(
    address: str, run_fingerprint: str, round_: int, *, timeout: float, transport: Transport = PLAIN, peer_id: str = ""
) -> pb.RolloutBatch:
    """The rollouts of round ``round_`` of the node ``peer_id`` at ``address`` (rpc/rollout_serving.py), unchecked:
    the caller decodes and checks them (rl/rollouts.py). A reply over the channel's message limit is
    RESOURCE_EXHAUSTED; every failure is a grpc.RpcError."""
    request = pb.RolloutRequest(run_fingerprint=run_fingerprint, round=round_)
    return _unary(address, GET_ROLLOUTS_METHOD, request, timeout=timeout, transport=transport, peer_id=peer_id)


def fetch_receipts(
    address: str,
    run_fingerprint: str,
    after: int,
    limit: int,
    *,
    timeout: float,
    transport: Transport = PLAIN,
    peer_id: str = "",
) -> list[str]:
    """Up to ``limit`` of the receipts the node ``peer_id`` at ``address`` keeps, from its ``after``-th on
    (rpc/receipt_serving.py), unchecked: the reader checks each one (observability/ledger.py). Empty: no more.
    Every failure is a grpc.RpcError (or ExchangeError, a private run's server that proves no membership)."""
    request = pb.ReceiptsRequest(run_fingerprint=run_fingerprint, after=after, limit=limit)
    page = _unary(address, GET_RECEIPTS_METHOD, request, timeout=timeout, transport=transport, peer_id=peer_id)
    return list(page.receipts)
