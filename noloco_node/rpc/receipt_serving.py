"""Serving ``GetReceipts``: a member hands out the receipts it keeps (security/receipts.py), a page at a time.

This is where receipts are published: on the member's own gRPC service, which its DHT record already names, so
the DHT carries nothing more and a reader (``noloco-node contributions --bootstrap``) pays one call per page of
one member, whatever the size of the swarm. A page costs the server a seek and the page's bytes (ReceiptBook keeps
each receipt's offset); calls have slots of their own (admission.py), so a flood of them never takes an exchange's
or Info's. Nothing served is trusted by the reader: each receipt carries both partners' signatures.
"""

from __future__ import annotations

import grpc

from noloco_node.rpc.admission import RECEIPTS
from noloco_node.rpc.call_gate import CallGate, abort, parse
from noloco_node.rpc.contracts import GET_RECEIPTS_METHOD, PeerNode
from noloco_node.security.receipts import ReceiptBook
from noloco_node.wire import peer_pb2 as pb

RECEIPTS_PAGE = 100  # receipts per page at most (about 2 KB each)


class ReceiptServing:
    """The ``GetReceipts`` handler of a node's service."""

    def __init__(self, book: ReceiptBook | None, node: PeerNode, gate: CallGate) -> None:
        self.book = book
        self.node = node
        self.gate = gate

    def GetReceipts(self, raw: bytes, context: grpc.ServicerContext) -> pb.ReceiptsPage:  # noqa: N802
        if self.book is None:
            abort(context, grpc.StatusCode.UNIMPLEMENTED, "this node keeps no receipts")
        caller = self.gate.caller(GET_RECEIPTS_METHOD, context, required=False)
        ticket = self.gate.admit(RECEIPTS, context, caller)
        try:
            request = parse(pb.ReceiptsRequest, raw, context)
            if request.run_fingerprint != self.node.run_fingerprint:
                self.gate.metrics.rejection("receipts_run")
                abort(context, grpc.StatusCode.FAILED_PRECONDITION, "another run's caller")
            limit = min(request.limit or RECEIPTS_PAGE, RECEIPTS_PAGE)
            return pb.ReceiptsPage(receipts=self.book.page(request.after, limit))
        finally:
            self.gate.admission.leave(ticket)
