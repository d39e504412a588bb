"""Serving a node's state to a joiner (``GetState``): the slow weights of the outer snapshot (wire/published.py;
what its manifest names: a joiner rebuilds the rest), streamed as frames (wire/frames.py), resumable at any tensor
and 4-byte offset of the same outer step. Downloads never block training
(they read a copy) but cost CPU and bandwidth, so they come a few at a time, one per proven peer, in slots of their
own that an exchange flood cannot take (call_gate.py, admission.py).
"""

from __future__ import annotations

from collections.abc import Iterator

import grpc

from noloco_node.rpc.admission import DOWNLOAD
from noloco_node.rpc.call_gate import CallGate, abort, parse
from noloco_node.rpc.contracts import GET_STATE_METHOD, HeldPayload, PeerNode
from noloco_node.rpc.transport import GuardedCall
from noloco_node.wire import peer_pb2 as pb
from noloco_node.wire.frames import iter_frames


class StateServing:
    """The ``GetState`` handler of a node's service."""

    def __init__(self, node: PeerNode, gate: CallGate, *, chunk_bytes: int, max_download_seconds: float) -> None:
        self.node = node
        self.gate = gate
        self.chunk_bytes = chunk_bytes
        self.max_download_seconds = max_download_seconds

    def GetState(self, raw: bytes, context: grpc.ServicerContext) -> Iterator[bytes]:  # noqa: N802
        caller = self.gate.caller(GET_STATE_METHOD, context, required=True)
        request = parse(pb.StateRequest, raw, context)
        if request.run_fingerprint != self.node.run_fingerprint:
            abort(context, grpc.StatusCode.FAILED_PRECONDITION, f"this peer trains run {self.node.run_fingerprint}")
        ticket = self.gate.admit(DOWNLOAD, context, caller)
        sent = [0]
        # A joiner that stops reading must not hold a download slot (and a worker thread) until its own deadline.
        guard = self.gate.watch(context, ticket, limit=self.max_download_seconds, progress=lambda: sent[0])
        try:
            snapshot = self.node.state_snapshot()
            if snapshot is None:
                abort(context, grpc.StatusCode.UNAVAILABLE, "no outer-step snapshot to serve yet")
            try:
                yield from self._serve(request, snapshot, context, guard, sent)
            finally:
                snapshot.release()  # the copy's buffers may be reused once no joiner reads them
        finally:
            self.gate.leave(ticket, guard)

    def _serve(
        self,
        request: pb.StateRequest,
        snapshot: HeldPayload,
        context: grpc.ServicerContext,
        guard: GuardedCall,
        sent: list[int],
    ) -> Iterator[bytes]:
        tensors = snapshot.manifest.tensors
        if request.from_tensor and request.outer_step != snapshot.manifest.outer_step:
            abort(
                context,
                grpc.StatusCode.FAILED_PRECONDITION,
                f"cannot resume a download of outer step {request.outer_step}: this snapshot is of outer step "
                f"{snapshot.manifest.outer_step}",
            )
        if request.from_tensor > len(tensors) or (
            request.from_offset
            and (
                request.from_tensor >= len(tensors)
                or request.from_offset % 4
                or request.from_offset >= tensors[request.from_tensor].num_bytes
            )
        ):
            abort(
                context,
                grpc.StatusCode.INVALID_ARGUMENT,
                f"cannot resume at tensor {request.from_tensor}, byte {request.from_offset}",
            )
        metrics = self.gate.metrics

        def count_sent(n: int) -> None:
            sent[0] += n
            metrics.add_bytes(sent=n)

        try:
            yield from iter_frames(
                snapshot.manifest,
                snapshot.tensors[: len(tensors)],  # the manifest names what is served: the snapshot's first part
                chunk_bytes=self.chunk_bytes,
                on_chunk=count_sent,
                from_tensor=request.from_tensor,
                from_offset=request.from_offset,
            )
            metrics.outcome("download_served")
        except GeneratorExit:
            metrics.outcome(f"download_cut_{guard.cut_reason}" if guard.cut_reason else "download_aborted")
            raise
