"""Serving ``Settle``: the caller of an exchange whose acknowledgement never reached it asks whether this node
blended its payload (proto ``SettleRequest``).

An exchange commits on both sides or on neither, except when the server's acknowledgement is lost on its way back
(rpc/client.py): the server has blended, the caller has not, and neither knows what the other did. Nothing matters
more than a count in sync and overlap modes; in a stream run with the sparse wire each side's error-feedback
residual depends on whether its partner took what it sent (wire/sparse.py), so the caller asks, and both sides
put their residuals right (pairing/stream.py). Only the partner itself may ask: the caller must prove its id,
and the answer is about that id's payload alone.
"""

from __future__ import annotations

import grpc

from noloco_node.rpc.admission import INFO
from noloco_node.rpc.call_gate import CallGate, abort, parse
from noloco_node.rpc.contracts import SETTLE_METHOD, NoSettleRecordError, PeerNode
from noloco_node.wire import peer_pb2 as pb


class SettleServing:
    """The ``Settle`` handler of a node's service (Info's slots: both answer in microseconds)."""

    def __init__(self, node: PeerNode, gate: CallGate) -> None:
        self.node = node
        self.gate = gate

    def Settle(self, raw: bytes, context: grpc.ServicerContext) -> pb.SettleReply:  # noqa: N802
        caller = self.gate.caller(SETTLE_METHOD, context, required=True)
        ticket = self.gate.admit(INFO, context, caller)
        try:
            request = parse(pb.SettleRequest, raw, context)
            if request.run_fingerprint != self.node.run_fingerprint:
                self.gate.metrics.rejection("settle_run")
                abort(context, grpc.StatusCode.FAILED_PRECONDITION, "another run's caller")
            if caller is None:  # an open run without identities: nobody can be told apart, so nobody is answered
                self.gate.metrics.rejection("settle_unproven")
                abort(context, grpc.StatusCode.UNAUTHENTICATED, "Settle answers only a caller that proves its id")
            try:
                blended = self.node.settle(caller, request.outer_step)
            except NoSettleRecordError as error:
                self.gate.metrics.rejection("settle_unsupported")
                abort(context, grpc.StatusCode.FAILED_PRECONDITION, str(error))
            if blended is None:
                abort(context, grpc.StatusCode.UNAVAILABLE, "an exchange with this caller is still in flight")
            return pb.SettleReply(blended=blended)
        finally:
            self.gate.admission.leave(ticket)
